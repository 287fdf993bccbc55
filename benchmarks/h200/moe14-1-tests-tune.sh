#!/usr/bin/env bash
# Issue 14, GPU step 1 of 3 (one call, < 10 min): the persistent prefill path (kernels/triton/moe_prefill.py) on the
# GPU, then the tuner with its tiles against the committed table's entries at prefill sizes.
#   1. GPU tests of the persistent path (every tuner tile, routings, dtypes, epilogues, PDL / graph replay bitwise;
#      SKIP_TESTS=1 leaves them out), then every persistent tile at T = 4096 on the three shapes (moe14_check_real.py);
#   2. tune_moe --modes persistent at T = 1024, 4096, bf16 and FP8 block, the three shapes of issue 14, merged into a
#      copy of this GPU's table under $OUT/moe_configs. Copy it over the committed one before step 2.
# Before: bash benchmarks/h200/vllm-src.sh on the CPU machine; carry [".whl", ".vllm-src"].
#   bash benchmarks/h200/moe14-1-tests-tune.sh
. "$(dirname "$0")/common.sh"
TABLE=$(moe_table_file)
echo "this GPU's tables: $TABLE"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
{ time timeout 170 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/gpu/test_triton_moe.py -k persistent ; } \
  > "$OUT/pytest-prefill.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed|^real" "$OUT/pytest-prefill.log" | cut -c1-300 | tail -12
grep -E "^E   " "$OUT/pytest-prefill.log" | cut -c1-300 | head -12
fi
# every persistent tile at the real sizes the tuner times, one process per (shape, format): a fault names its config
{ time timeout 170 python3 benchmarks/h200/moe14_check_real.py --tokens 4096 ; } > "$OUT/check-real.log" 2>&1
echo "check exit $?"; cut -c1-300 "$OUT/check-real.log"
mkdir -p "$OUT/moe_configs"
[ -f "rubin_compile/kernels/triton/moe_configs/$TABLE" ] && cp "rubin_compile/kernels/triton/moe_configs/$TABLE" "$OUT/moe_configs/"
{ time timeout 360 python3 -m rubin_compile.kernels.triton.tune_moe --shapes qwen3-30b-a3b,deepseek-v3-tp8,mixtral-8x7b \
  --formats bf16,fp8_block --tokens 1024,4096 --modes persistent --merge --reps 10 --out "$OUT/moe_configs" \
  --log "$OUT/tune-prefill-detail.log" ; } > "$OUT/tune-prefill.log" 2>&1
echo "tune exit $?"; grep -v "compile failed" "$OUT/tune-prefill.log" | grep -E "T=|WRONG|Error|compiled|^real" | cut -c1-220
archive_out results.tgz
