#!/usr/bin/env bash
# Issue 16, seventh session, H200 step 3 (the commit submitted): step 2 (the interleaved rounds) could not get a machine;
# here it runs, then the whole GPU suite.
#   bash benchmarks/h200/s7-3-forward-interleaved-and-suite.sh
. "$(dirname "$0")/common.sh"
timeout 300 python3 benchmarks/h200/forward_interleaved.py --contexts 4096,16384 --rounds 7 --out "$OUT" \
    > "$OUT/forward-interleaved.log" 2>&1
echo "forward-interleaved exit $?"; grep -E '^\||Error' "$OUT/forward-interleaved.log" | tail -8
( time timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider -rfE tests/gpu ) > "$OUT/pytest-gpu.log" 2>&1
echo "pytest exit $?"; grep -E "^FAILED|^ERROR|passed|failed|^real" "$OUT/pytest-gpu.log" | tail -15
