#!/usr/bin/env bash
# Issue 12, H200 step 5 (at the commit submitted): the whole GPU suite, then the decode step of 8 Qwen3-30B-A3B
# layers at T = 1 and 8 -- rubin now (fused q/k/v, our GEMM where the table says), rubin with its dense GEMMs on
# cuBLAS as before this issue, Inductor + CUDA graphs -- with the per-kernel profile. The suite runs on 8 workers (a
# serial run needs more than 4.5 minutes); two tests failed only that way at 045fdb9 (docs/kernels/gemm.md).
#   bash benchmarks/h200/gemm-5-final.sh
. "$(dirname "$0")/common.sh"
timeout 240 python3 -m pytest tests/gpu -q -p no:cacheprovider -n 8 -rf > "$OUT/pytest-h200-issue12.log" 2>&1
echo "pytest exit $?"; grep -E "FAILED|passed|failed" "$OUT/pytest-h200-issue12.log" | tail -8
mkdir -p "$OUT/decode-step"
timeout 280 python3 benchmarks/decode_step.py --tokens 1,8 --variants inductor-cg,rubin-pdl,rubin-pdl-gemm-cublas \
    --iters 20 --rounds 2 --profile --out "$OUT/decode-step" > "$OUT/decode-step.log" 2>&1
echo "decode_step exit $?"
grep -v -i warn "$OUT/decode-step.log" | tail -45
