#!/usr/bin/env bash
# Issue 16, H200 step 6a (at the commit submitted): compile time (fresh processes, cold then warm caches), the decode
# attention table, the GPU suite.   bash benchmarks/h200/generate-6-final-a.sh
. "$(dirname "$0")/common.sh"
timeout 280 python3 benchmarks/compile_time.py --out "$OUT" > "$OUT/compile-time.log" 2>&1
echo "compile_time exit $?"
grep -v '^{' "$OUT/compile-time.log" | grep -iv warn | tail -9
timeout 100 python3 benchmarks/decode_attention.py --out "$OUT" > "$OUT/decode-attention.log" 2>&1
echo "decode_attention exit $?"
grep -v '^{' "$OUT/decode-attention.log" | grep -iv warn | tail -30
timeout 200 python3 -m pytest tests/gpu -q -n 6 -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | grep -E "passed|failed|FAILED|Error" | tail -8
