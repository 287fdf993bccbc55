#!/usr/bin/env bash
# Issue 16, H200 step 6b (at the commit submitted): the generate() matrix (contexts 512 / 4k / 16k / 32k, batch 1
# and 8, 128 new tokens; the one-CUDA-graph decode step at 4k and 16k with its per-kernel profile).
#   bash benchmarks/h200/generate-6-final-b.sh
. "$(dirname "$0")/common.sh"
timeout 560 python3 benchmarks/generate.py --contexts 512,4096,16384,32768 --batches 1,8 --new-tokens 128 \
    --repeats 2 --step-contexts 4096,16384 --out "$OUT" > "$OUT/generate.log" 2>&1
echo "generate exit $?"
grep -v '^{' "$OUT/generate.log" | grep -iv "warn" | tail -60
