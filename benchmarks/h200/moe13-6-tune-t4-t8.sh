# Step 6: the FP8 entries at T = 4 / 8 re-tuned with the K-split candidates (FC1 summing its own partials), then
# benchmarks/moe.py at those sizes.
source benchmarks/h200/moe13-common.sh
for spec in deepseek-v3-tp8:4,8 qwen3-30b-a3b:4; do
  timeout 100 python3 -m rubin_compile.kernels.triton.tune_moe --shapes ${spec%%:*} --formats fp8_block,fp8_tensor --tokens ${spec##*:} \
    --merge --reps 12 2>&1 | grep -v "^  compile failed" | cut -c1-250 | tee -a "$OUT/tune6.log"
done
cp rubin_compile/kernels/triton/moe_configs/NVIDIA_H200.json "$OUT/"
timeout 60 python3 benchmarks/moe.py --shapes qwen3-30b-a3b,deepseek-v3-tp8 --tokens 4,8 --formats fp8_block,fp8_tensor \
  --baselines none --reps 20 --out "$OUT" --tag=-step6 2>&1 | cut -c1-140 | tee "$OUT/moe-step6.log"
