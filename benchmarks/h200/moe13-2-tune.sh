# Step 2: re-tune the FP8 decode entries (the kernels changed) and benchmark on the new table.
source benchmarks/h200/moe13-common.sh
for s in qwen3-30b-a3b deepseek-v3-tp8; do
  python3 -m rubin_compile.kernels.triton.tune_moe --shapes $s --formats fp8_block,fp8_tensor --tokens 1,2,4,8 --merge --reps 15 2>&1 \
    | grep -v "^  compile failed" | tee -a "$OUT/tune.log"
done
cp rubin_compile/kernels/triton/moe_configs/NVIDIA_H200.json "$OUT/"
python3 benchmarks/moe.py --shapes qwen3-30b-a3b,deepseek-v3-tp8 --tokens 1,2,4,8 --formats bf16,fp8_block,fp8_tensor \
  --baselines none --reps 30 --out "$OUT" --tag=-step2 2>&1 | tee "$OUT/moe-step2.log"
