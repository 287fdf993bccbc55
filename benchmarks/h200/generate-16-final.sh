#!/usr/bin/env bash
# Issue 16, at the commit submitted (H200): the whole GPU suite, then the generate() matrix (contexts 512 / 4k / 16k /
# 32k, batch 1 and 8, 128 new tokens, Inductor against rubin; the one-CUDA-graph decode step at 4k and 16k with its
# per-kernel profile). Each row of the matrix is printed as it is measured, so a timeout keeps the rows before it.
# ~9.5 min.   bash benchmarks/h200/generate-16-final.sh   (carry .whl and .vllm-src)
. "$(dirname "$0")/common.sh"
{ time timeout 200 python3 -m pytest tests/gpu -q -n 8 -p no:cacheprovider -rfE ; } > "$OUT/pytest-final.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed|^real" "$OUT/pytest-final.log" | tail -12
timeout 340 python3 benchmarks/generate.py --contexts 512,4096,16384,32768 --batches 1,8 --variants inductor,rubin \
    --eager-batches "" --new-tokens 128 --repeats 2 --step-contexts 4096,16384 --out "$OUT" > "$OUT/generate.log" 2>&1
echo "generate exit $?"
grep -v '^{' "$OUT/generate.log" | grep -iv "warn" | grep -E "^\||Error" | tail -40
grep '^{' "$OUT/generate.log" | cut -c1-200
