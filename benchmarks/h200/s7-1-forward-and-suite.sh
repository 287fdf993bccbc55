#!/usr/bin/env bash
# Issue 16, seventh session, H200 step 1: generate() with model.forward compiled (no CUDA graphs), Inductor against
# rubin with its kernels traced into the graph (passes/inline_kernels.py), batch 1 at 512 / 4k / 16k: the whole-model
# measurement the sixth session could not make; then the whole GPU suite at this tree.
#   bash benchmarks/h200/s7-1-forward-and-suite.sh
. "$(dirname "$0")/common.sh"
timeout 330 python3 benchmarks/generate.py --setup forward --contexts 512,4096,16384 --batches 1 --new-tokens 64 \
    --variants inductor,rubin --step-contexts "" --repeats 3 --out "$OUT" > "$OUT/generate-forward.log" 2>&1
echo "generate-forward exit $?"; grep -E '^\| 1 |Error|error' "$OUT/generate-forward.log" | tail -12
( time timeout 230 python3 -m pytest -q -n 8 -p no:cacheprovider -rfE tests/gpu ) > "$OUT/pytest-gpu.log" 2>&1
echo "pytest exit $?"; grep -E "^FAILED|^ERROR|passed|failed|^real" "$OUT/pytest-gpu.log" | tail -15
