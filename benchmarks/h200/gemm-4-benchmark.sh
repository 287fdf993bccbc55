#!/usr/bin/env bash
# Issue 12, H200 step 4: benchmarks/gemm.py over every shape, M = 1..256, bf16 and FP8 block, with the tuned
# table; Inductor max-autotune at M = 1 and 16; then its Inductor times merged into the table.
. "$(dirname "$0")/common.sh"
timeout 500 python3 benchmarks/gemm.py --inductor-ms 1,16 --commit "${COMMIT:-?}" --out "$OUT" > "$OUT/gemm.log" 2>&1
echo "benchmark exit $?"
grep -v -i warn "$OUT/gemm.log" | grep -E "M=  1 |M= 16 |M=256|bf16, M|FP8|selection|PDL on|off the table|  - |Error|error" | head -150
mkdir -p "$OUT/merged" && cp rubin_compile/kernels/triton/gemm_configs/NVIDIA_H200.json "$OUT/merged/"
python3 -m rubin_compile.kernels.triton.tune_gemm --shapes "" --inductor-from "$OUT/gemm-$SLUG.json" --out "$OUT/merged" | tail -1
