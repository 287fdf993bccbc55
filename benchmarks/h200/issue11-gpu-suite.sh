#!/usr/bin/env bash
# Issue 11 (the MoE families and versions work touches the Triton MoE's activation check and plan cache, the
# matchers' GPU-target rule): the GPU suite on 8 workers at the commit it runs on.
#   bash benchmarks/h200/issue11-gpu-suite.sh
. "$(dirname "$0")/common.sh"
timeout 260 python3 -m pytest tests/gpu -q -p no:cacheprovider -n 8 -rf > "$OUT/pytest-h200-issue11.log" 2>&1
echo "pytest exit $?"; grep -E "FAILED|passed|failed" "$OUT/pytest-h200-issue11.log" | tail -8
