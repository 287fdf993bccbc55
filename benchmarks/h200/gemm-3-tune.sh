#!/usr/bin/env bash
# Issue 12, H200 step 3: tune the GEMM for every benchmark shape, bf16 and FP8 block, M buckets 1..64; the table
# lands in $OUT/gemm_configs (committed as rubin_compile/kernels/triton/gemm_configs/NVIDIA_H200.json).
. "$(dirname "$0")/common.sh"
timeout 560 python3 -m rubin_compile.kernels.triton.tune_gemm --out "$OUT/gemm_configs" > "$OUT/tune-gemm.log" 2>&1
echo "tune exit $?"
grep -v -i warn "$OUT/tune-gemm.log" | grep -E "compiled|M=  1|M= 16|M= 64|wrote|Error|error" | head -120
