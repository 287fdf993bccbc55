#!/usr/bin/env bash
# Issue 13, the next H200 step for the MoE decode kernels (written 2026-12-03 in a session with no device time; not
# yet run): the GPU tests of the reduction (GEMV) form of FC1 / FC2 (every weight format, row chunks, with the MMA
# form, PDL on / off bitwise, graph replay), then the tuner at T = 1, 2, 4 with its GEMV candidates on Qwen3-30B-A3B
# and DeepSeek-V3 TP8, bf16 and FP8 block, merged into a copy of the committed table in $OUT/moe_configs (the old
# winner is a candidate, so it is re-timed in the same run), and, per entry, the best GEMV candidate against the best
# MMA-form one from the tuner's own log (same run, same inputs).
#   bash benchmarks/h200/moe13-11-gemv.sh
. "$(dirname "$0")/moe13-common.sh"
timeout 180 python3 -m pytest tests/gpu/test_triton_moe.py -q -p no:cacheprovider -k gemv > "$OUT/pytest-moe-gemv.log" 2>&1
echo "pytest exit $?"; grep -E "FAILED|passed|failed|Error" "$OUT/pytest-moe-gemv.log" | tail -6
mkdir -p "$OUT/moe_configs" && cp rubin_compile/kernels/triton/moe_configs/NVIDIA_H200.json "$OUT/moe_configs/"
for fmt in bf16 fp8_block; do
  timeout 200 python3 -m rubin_compile.kernels.triton.tune_moe --shapes qwen3-30b-a3b,deepseek-v3-tp8 --formats $fmt \
    --tokens 1,2,4 --merge --reps 12 --out "$OUT/moe_configs" --log "$OUT/tune-moe-$fmt-detail.log" \
    > "$OUT/tune-moe-$fmt.log" 2>&1
  echo "tune $fmt exit $?"; grep -v "compile failed" "$OUT/tune-moe-$fmt.log" | grep -E "T=|WRONG|Error" | cut -c1-200
done
python3 "$(dirname "$0")/tuner_log_compare.py" "/gemv" GEMV MMA "$OUT"/tune-moe-*-detail.log
