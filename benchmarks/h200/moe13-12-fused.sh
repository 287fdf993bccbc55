#!/usr/bin/env bash
# Issue 13, the fused decode kernel (kernels/triton/moe_decode.py, MoEConfig.mode "fused": FC1, FC2 and the top-k sum
# in one persistent launch) on the GPU, in two calls (each within the device's 10-minute limit):
#  PHASE=tune (call 1):
#  1. the tuner at T = 1, 2, 4, 8 on Qwen3-30B-A3B and DeepSeek-V3 TP8 (bf16) with the fused candidates only, besides
#     the table's entry and the heuristic (re-timed in the same run), merged into a copy of the committed table in
#     $OUT/moe_configs; then, per entry, the best fused config against the best other one from the tuner's log;
#  PHASE=check (call 2, after the tuned table is committed):
#  2. the GPU tests of the fused path, and test_triton_moe.py's PDL / graph tests of the other modes;
#  3. benchmarks/moe.py at T = 1, 2, 4, 8 (bf16; ours, the ATen form and vLLM's fused_moe where .vllm-src is carried)
#     with the table in the tree, its rows merged into a copy of the per-size selection table (moe_baselines/).
#   PHASE=tune RUBIN_COMMIT=<hash> bash benchmarks/h200/moe13-12-fused.sh
#   PHASE=check RUBIN_COMMIT=<hash> bash benchmarks/h200/moe13-12-fused.sh   (carry .vllm-src for the vLLM column)
. "$(dirname "$0")/moe13-common.sh"
TABLE=$(python3 -c "import torch; from rubin_compile.kernels.triton import moe_choice; print(moe_choice.table_file(torch.cuda.get_device_name()))")
if [ "${PHASE:-tune}" = tune ]; then
mkdir -p "$OUT/moe_configs"
# the table this GPU runs today (its own, or its stand-in's: the H100 runs the H200's), so its entries are re-timed
RUNS=$(python3 -c "import torch; from rubin_compile.kernels.triton import moe_choice as c; n = torch.cuda.get_device_name(); print(c.table_file(c.CONFIG_STAND_INS.get(n, n)))")
cp "rubin_compile/kernels/triton/moe_configs/$RUNS" "$OUT/moe_configs/$TABLE" && echo "seeded with $RUNS"
timeout ${TUNE_TIMEOUT:-300} python3 -m rubin_compile.kernels.triton.tune_moe --shapes qwen3-30b-a3b,deepseek-v3-tp8 \
  --formats bf16 --tokens ${TOKENS:-1,2,4,8} --merge --modes fused --reps 20 --out "$OUT/moe_configs" \
  --log "$OUT/tune-fused-detail.log" > "$OUT/tune-fused.log" 2>&1
echo "tune exit $?"; grep -v "compile failed" "$OUT/tune-fused.log" | grep -E "T=|WRONG|Error|compiled" | cut -c1-220
python3 "$(dirname "$0")/tuner_log_compare.py" "^fused" fused other "$OUT/tune-fused-detail.log"
else
timeout ${TEST_TIMEOUT:-240} python3 -m pytest tests/gpu/test_triton_moe.py tests/gpu/test_inline_kernels.py -q \
  -p no:cacheprovider -rfE -k "fused_decode or pdl or graph or traced_launches_equal" > "$OUT/pytest-fused.log" 2>&1
echo "pytest exit $?"; grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest-fused.log" | tail -8
VLLM=(); [ -d .vllm-src ] && VLLM=(--baselines grouped_mm,vllm --vllm-src .vllm-src) || VLLM=(--baselines grouped_mm)
# the per-size selection rows (moe_baselines/) of the sizes re-tuned, re-timed with the entries in the tree
mkdir -p "$OUT/moe_baselines"
cp "rubin_compile/kernels/triton/moe_baselines/$TABLE" "$OUT/moe_baselines/" 2>/dev/null || echo "no committed baselines"
timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/moe.py --shapes qwen3-30b-a3b,deepseek-v3-tp8 --tokens 1,2,4,8 \
  --formats bf16 "${VLLM[@]}" --write-baselines "$OUT/moe_baselines/$TABLE" --out "$OUT" --tag "-fused" \
  > "$OUT/bench.log" 2>&1
echo "bench exit $?"; grep -E "T=|Error|merged" "$OUT/bench.log" | cut -c1-230
fi
# at most 8 files come back from $OUT: everything in one archive
(cd "$OUT" && tar czf /tmp/moe13-12-fused.tgz . && find . -mindepth 1 -delete && mv /tmp/moe13-12-fused.tgz .)
