# Step 3: re-tune the decode entries with the deeper-pipeline candidates (FP8 at T = 1, 2, 8, bf16 at T = 1), then
# benchmark on the new table.
source benchmarks/h200/moe13-common.sh
for s in qwen3-30b-a3b deepseek-v3-tp8; do
  python3 -m rubin_compile.kernels.triton.tune_moe --shapes $s --formats fp8_block,fp8_tensor --tokens 1,2,8 --merge --reps 12 2>&1 \
    | grep -v "^  compile failed" | cut -c1-250 | tee -a "$OUT/tune3.log"
  python3 -m rubin_compile.kernels.triton.tune_moe --shapes $s --formats bf16 --tokens 1 --merge --reps 12 2>&1 \
    | grep -v "^  compile failed" | cut -c1-250 | tee -a "$OUT/tune3.log"
done
cp rubin_compile/kernels/triton/moe_configs/NVIDIA_H200.json "$OUT/"
python3 benchmarks/moe.py --shapes qwen3-30b-a3b,deepseek-v3-tp8 --tokens 1,2,4,8 --formats bf16,fp8_block,fp8_tensor \
  --baselines none --reps 30 --out "$OUT" --tag=-step3 2>&1 | cut -c1-140 | tee "$OUT/moe-step3.log"
