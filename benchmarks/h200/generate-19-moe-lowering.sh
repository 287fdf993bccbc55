#!/usr/bin/env bash
# Measures match_moe's rewrite of df70801 (taken back out untimed): re-apply it first with
#   git show df70801 -- rubin_compile/passes/match_moe tests/cpu/passes/match_moe README.md | git apply
# Issue 16, when only ~6 min of device time are left: the GPU tests of the change (a Hugging Face experts block only
# the reference takes is rewritten and lowered into grouped GEMMs on sm_90+: tests/gpu/test_select_kernels_gpu.py;
# generate() ids against eager, gpt-oss-tiny among them: tests/gpu/test_generate.py), -v so a timeout keeps the
# names; then GPT-OSS-20B dims' generate() at 4k, batch 1, under rubin (Inductor's 5011 us a token on an H100:
# benchmarks/results/issue16-gpt-oss-h100-2026-12-07).   bash benchmarks/h200/generate-19-moe-lowering.sh (carry .whl)
. "$(dirname "$0")/common.sh"
{ time timeout 150 python3 -m pytest tests/gpu/test_select_kernels_gpu.py tests/gpu/test_generate.py -v -n 8 \
    -p no:cacheprovider -rfE ; } > "$OUT/pytest-moe-lowering.log" 2>&1
grep -E "(FAILED|ERROR)|passed|failed|^real" "$OUT/pytest-moe-lowering.log" | grep -v "PASSED\|SKIPPED" | tail -14
mkdir -p "$OUT/gen"
timeout 120 python3 benchmarks/generate.py --model gpt-oss-20b-8l --contexts 4096 --batches 1 --variants rubin \
    --eager-batches "" --new-tokens 128 --repeats 2 --step-contexts "" --out "$OUT/gen" > "$OUT/generate-gpt-oss.log" 2>&1
echo "generate exit $?"
grep '^{' "$OUT/generate-gpt-oss.log" | cut -c1-300
