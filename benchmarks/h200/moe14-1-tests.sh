#!/usr/bin/env bash
# Issue 14, GPU step 1 of 3 (one call, < 10 min): the persistent prefill path (kernels/triton/moe_prefill.py) on the
# GPU: its tests (every tuner tile -- bf16, FP8 W8A8, W8A16, and the variants: two programs per SM, flattened item
# loops --, routings, dtypes, epilogues, PDL / graph replay bitwise), then every tuner tile at T = 4096 on the four
# benchmark shapes against the float32 reference (moe14_check_real.py, one process per shape and format,
# CUDA_LAUNCH_BLOCKING: a fault names its config).
# Before: bash benchmarks/h200/vllm-src.sh on the CPU machine; carry [".whl", ".vllm-src"].
#   bash benchmarks/h200/moe14-1-tests.sh
. "$(dirname "$0")/common.sh"
{ time timeout 280 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/gpu/test_triton_moe.py -k persistent ; } \
  > "$OUT/pytest-prefill.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed|^real" "$OUT/pytest-prefill.log" | cut -c1-300 | tail -12
grep -E "^E   " "$OUT/pytest-prefill.log" | cut -c1-300 | head -12
{ time timeout 280 python3 benchmarks/h200/moe14_check_real.py --tokens 4096 ; } > "$OUT/check-real.log" 2>&1
echo "check exit $?"; grep -E "WRONG|exit|^real" "$OUT/check-real.log" | cut -c1-300; grep -c " OK" "$OUT/check-real.log"
archive_out results.tgz
