#!/usr/bin/env bash
# Issue 12 (second session), H200 step 2: benchmarks/gemm.py over every shape, M = 1..256, bf16 and FP8 block,
# with the retuned table (committed from step 1); Inductor max-autotune at M = 1 and 16; its times merged into
# the table.
#   bash benchmarks/h200/gemm-9-benchmark.sh
. "$(dirname "$0")/common.sh"
timeout 500 python3 benchmarks/gemm.py --inductor-ms 1,16 --commit "${COMMIT:-?}" --out "$OUT" > "$OUT/gemm.log" 2>&1
echo "benchmark exit $?"
grep -v -i warn "$OUT/gemm.log" | sed -n '/## Goals/,/## All rows/p' | head -40
grep -E "^- |^  - " "$OUT/gemm-$SLUG.md" | head -40
mkdir -p "$OUT/merged" && cp rubin_compile/kernels/triton/gemm_configs/NVIDIA_H200.json "$OUT/merged/"
python3 -m rubin_compile.kernels.triton.tune_gemm --shapes "" --inductor-from "$OUT/gemm-$SLUG.json" --out "$OUT/merged" | tail -1
