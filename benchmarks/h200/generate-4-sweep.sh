#!/usr/bin/env bash
# Issue 16, H200 step 4: the decode attention kernel's GPU tests (fused merge, separate merge, graphs), then the
# sweep of its Configs at batch 1 / 8 and contexts 4k / 16k / 32k (the defaults are chosen from it).
#   bash benchmarks/h200/generate-4-sweep.sh
. "$(dirname "$0")/common.sh"
timeout 150 python3 -m pytest tests/gpu/test_decode_attention.py -q -x -n 4 -p no:cacheprovider 2>&1 | tee "$OUT/pytest-attention.log" | tail -4
timeout 380 python3 benchmarks/decode_attention.py --sweep --batches 1,8 --contexts 4096,16384,32768 --out "$OUT" \
    > "$OUT/sweep.log" 2>&1
echo "sweep exit $?"
grep -E '"wrong"|"error"' "$OUT/sweep.log" | head -5
grep -v '^{' "$OUT/sweep.log" | grep -iv warn | tail -12
