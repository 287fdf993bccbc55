#!/usr/bin/env bash
# Measures match_moe's rewrite of df70801 (taken back out untimed): re-apply it first (generate-19's header says how).
# generate-19 cut to what ~4 min of device time holds: the new GPU test of the MoE lowering (with and without CUDA
# graphs), then GPT-OSS-20B dims' generate() at 4k, batch 1, under rubin (Inductor: 5011 us a token on an H100).
#   bash benchmarks/h200/generate-20-moe-lowering-min.sh   (carry .whl)
. "$(dirname "$0")/common.sh"
timeout 90 python3 -m pytest tests/gpu/test_select_kernels_gpu.py -v -p no:cacheprovider -rfE -k grouped_gemms \
    > "$OUT/pytest-moe-lowering.log" 2>&1
grep -E "(FAILED|ERROR|PASSED)|passed|failed" "$OUT/pytest-moe-lowering.log" | tail -6
mkdir -p "$OUT/gen"
timeout 110 python3 benchmarks/generate.py --model gpt-oss-20b-8l --contexts 4096 --batches 1 --variants rubin \
    --eager-batches "" --new-tokens 64 --repeats 1 --step-contexts "" --out "$OUT/gen" > "$OUT/generate-gpt-oss.log" 2>&1
echo "generate exit $?"
grep '^{' "$OUT/generate-gpt-oss.log" | cut -c1-300
