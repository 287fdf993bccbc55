#!/usr/bin/env bash
# Issue 12 (second session), H200 step 2: what step 1 left (its bf16 run stopped at DeepSeek-V3 kv_a M = 64 on a
# tuner error since fixed, its FP8 run at its time limit): bf16 for the last five shapes, FP8 block at M = 1, 16, 64
# for the last six, and the other FP8 buckets of the new Qwen3 k/v shape, merged into the committed table.
#   bash benchmarks/h200/gemm-10-finish-tune.sh
. "$(dirname "$0")/common.sh"
mkdir -p "$OUT/gemm_configs" && cp rubin_compile/kernels/triton/gemm_configs/NVIDIA_H200.json "$OUT/gemm_configs/"
T="python3 -m rubin_compile.kernels.triton.tune_gemm --merge --out $OUT/gemm_configs"
DS=deepseek-v3-tp8
timeout 150 $T --formats bf16 --shapes $DS.kv_a,$DS.kv_b,$DS.o,$DS.mlp_gate_up,$DS.mlp_down > "$OUT/tune-gemm-bf16.log" 2>&1
echo "tune bf16 exit $?"
timeout 150 $T --formats fp8_block --ms 1,16,64 --shapes $DS.q_b,$DS.kv_a,$DS.kv_b,$DS.o,$DS.mlp_gate_up,$DS.mlp_down \
    > "$OUT/tune-gemm-fp8.log" 2>&1
echo "tune fp8 exit $?"
timeout 60 $T --formats fp8_block --ms 2,4,8,32 --shapes qwen3-30b-a3b.kv > "$OUT/tune-gemm-fp8-kv.log" 2>&1
echo "tune fp8 kv exit $?"
grep -h -E "compiled|Error|error|wrong| best " "$OUT"/tune-gemm-*.log | cut -c1-200 | head -80
