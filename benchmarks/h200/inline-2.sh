#!/usr/bin/env bash
# Issue 16, sixth session, H200 step 2: the whole GPU suite with passes/inline_kernels.py on (every compile without
# CUDA graphs now traces our Triton launches into the graph), then generate() with model.forward compiled (no CUDA
# graphs), Inductor against rubin, per token at batch 1 (512, 16k) and batch 8 (4k).
#   bash benchmarks/h200/inline-2.sh
. "$(dirname "$0")/common.sh"
( time timeout 300 python3 -m pytest -q -n 8 -p no:cacheprovider -rfE tests/gpu ) > "$OUT/pytest-gpu.log" 2>&1
echo "pytest exit $?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/pytest-gpu.log" | tail -14
timeout 130 python3 benchmarks/generate.py --setup forward --contexts 512,16384 --batches 1 --new-tokens 64 \
    --variants inductor,rubin --repeats 2 --step-contexts "" --out "$OUT/b1" > "$OUT/generate-forward-b1.log" 2>&1
echo "generate b1 exit $?"; grep "^| 1 " "$OUT/generate-forward-b1.log"
timeout 110 python3 benchmarks/generate.py --setup forward --contexts 4096 --batches 8 --new-tokens 64 \
    --variants inductor,rubin --repeats 2 --step-contexts "" --out "$OUT/b8" > "$OUT/generate-forward-b8.log" 2>&1
echo "generate b8 exit $?"; grep "^| 8 " "$OUT/generate-forward-b8.log"
