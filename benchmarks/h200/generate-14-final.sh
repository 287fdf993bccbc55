#!/usr/bin/env bash
# Issue 16, fourth session, H200 step 2 (at the commit submitted): the whole GPU test suite, then generate() at
# 512 / 4k, batch 1 and 8, 128 new tokens, Inductor against rubin (benchmarks/generate.py, the issue's per-token
# formula (t(N) - t(1)) / (N - 1)).
#   bash benchmarks/h200/generate-14-final.sh
. "$(dirname "$0")/common.sh"
{ time timeout 300 python3 -m pytest tests/gpu -q -n 8 -p no:cacheprovider -rfE ; } > "$OUT/pytest-final.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed|^real" "$OUT/pytest-final.log" | tail -15
grep -E "^E   " "$OUT/pytest-final.log" | cut -c1-300 | head -10
timeout 250 python3 benchmarks/generate.py --contexts 512,4096 --batches 1,8 --variants inductor,rubin \
    --new-tokens 128 --repeats 3 --step-contexts "" --out "$OUT/gen" > "$OUT/generate.log" 2>&1
echo "generate exit $?"
grep -v "^{" "$OUT/generate.log" | grep -iv "warn" | grep "^|\|Error" | tail -12
