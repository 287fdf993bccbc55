#!/usr/bin/env bash
# Issue 12, H200 step 6 (at the commit submitted): the whole GPU suite, 8 workers.
#   bash benchmarks/h200/gemm-6-final-tests.sh
. "$(dirname "$0")/common.sh"
timeout 330 python3 -m pytest tests/gpu -q -p no:cacheprovider -n 8 -rf > "$OUT/pytest-h200-issue12.log" 2>&1
echo "pytest exit $?"; grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest-h200-issue12.log" | tail -15
