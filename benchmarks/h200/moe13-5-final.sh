# Step 5 (final): the MoE and routing GPU tests, the routing benchmark, the FP8 decode entries re-tuned with the
# K-split candidates (FC1 summing its own partials), and benchmarks/moe.py on the resulting table.
source benchmarks/h200/moe13-common.sh
{ time timeout 150 python3 -m pytest tests/gpu/test_triton_moe.py tests/gpu/test_triton_route.py -q -n 8 -p no:cacheprovider ; } 2>&1 \
  | grep -v Warning | grep -v warner | tail -12 | tee "$OUT/pytest-final.log"
timeout 120 python3 benchmarks/route.py --out "$OUT" --tokens 1 4 16 64 2>&1 | tail -25 | tee "$OUT/route.log"
for spec in deepseek-v3-tp8:1,2 qwen3-30b-a3b:1; do
  timeout 110 python3 -m rubin_compile.kernels.triton.tune_moe --shapes ${spec%%:*} --formats fp8_block,fp8_tensor --tokens ${spec##*:} \
    --merge --reps 12 2>&1 | grep -v "^  compile failed" | cut -c1-250 | tee -a "$OUT/tune5.log"
done
cp rubin_compile/kernels/triton/moe_configs/NVIDIA_H200.json "$OUT/"
timeout 90 python3 benchmarks/moe.py --shapes qwen3-30b-a3b,deepseek-v3-tp8 --tokens 1,2,4,8 --formats bf16,fp8_block,fp8_tensor \
  --baselines none --reps 20 --out "$OUT" --tag=-step5 2>&1 | cut -c1-140 | tee "$OUT/moe-step5.log"
