#!/usr/bin/env bash
# Issue 16, H200 step 2 (at the commit submitted): the GPU suite, the decode attention kernel against the ATen form,
# and the generate() matrix (contexts 512 / 4k / 16k / 32k, batch 1 and 8, 128 new tokens; the one-CUDA-graph
# decode step at 4k and 16k with its per-kernel profile). Run from the checkout root (carry .whl):
#   bash benchmarks/h200/generate-2-final.sh
. "$(dirname "$0")/common.sh"
timeout 200 python3 -m pytest tests/gpu -q -n 6 -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -8
timeout 60 python3 benchmarks/decode_attention.py --out "$OUT" 2>&1 | grep -v '^{' | tail -30
timeout 290 python3 benchmarks/generate.py --contexts 512,4096,16384,32768 --batches 1,8 --new-tokens 128 \
    --repeats 2 --step-contexts 4096,16384 --out "$OUT" > "$OUT/generate.log" 2>&1
echo "generate exit $?"
grep -v '^{' "$OUT/generate.log" | grep -iv "warn" | tail -60
