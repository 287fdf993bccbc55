#!/usr/bin/env bash
# Issue 16, H200 step 5: compile time of generate() under Inductor and rubin (fresh processes, cold then warm
# caches), then the GPU suite.
#   bash benchmarks/h200/generate-5-compile-and-suite.sh
. "$(dirname "$0")/common.sh"
timeout 330 python3 benchmarks/compile_time.py --out "$OUT" > "$OUT/compile-time.log" 2>&1
echo "compile_time exit $?"
grep -v '^{' "$OUT/compile-time.log" | grep -iv warn | tail -12
timeout 220 python3 -m pytest tests/gpu -q -n 6 -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | grep -E "passed|failed|FAILED|Error" | tail -8
