# Step 1: the fused-MoE GPU tests, then benchmarks/moe.py for the decode sizes of Qwen3-30B-A3B and DeepSeek-V3 TP8
# in bf16, FP8 128x128 block and FP8 per-expert-tensor weights (the tuned table as committed).
source benchmarks/h200/moe13-common.sh
{ time python3 -m pytest tests/gpu/test_triton_moe.py -q -x -n 4 -p no:cacheprovider ; } 2>&1 | tail -15 | tee "$OUT/pytest-moe.log"
python3 benchmarks/moe.py --shapes qwen3-30b-a3b,deepseek-v3-tp8 --tokens 1,2,4,8 --formats bf16,fp8_block,fp8_tensor \
  --baselines none --reps 30 --out "$OUT" --tag=-step1 2>&1 | tee "$OUT/moe-step1.log"
