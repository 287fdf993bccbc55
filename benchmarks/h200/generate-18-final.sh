#!/usr/bin/env bash
# Issue 16, at the commit submitted: the whole GPU suite (generate-17's run stopped at its 200 s limit with two
# failures it did not name; -v names each test as it ends), then GPT-OSS-20B dims' generate() at 4k, batch 1, under
# rubin (4750 us a token against Inductor's 5011 on an H100 at 03eaa3e, benchmarks/results/issue16-gpt-oss-h100-
# 2026-12-07; with df70801's match_moe half re-applied, its experts run as grouped GEMMs: generate-19's header).
# ~7.5 min.   bash benchmarks/h200/generate-18-final.sh   (carry .whl and .vllm-src)
. "$(dirname "$0")/common.sh"
{ time timeout 300 python3 -m pytest tests/gpu -v -n 8 -p no:cacheprovider -rfE --durations=12 ; } \
    > "$OUT/pytest-final.log" 2>&1
grep -E "(FAILED|ERROR)|passed|failed|^real" "$OUT/pytest-final.log" | grep -v "PASSED\|SKIPPED" | tail -14
mkdir -p "$OUT/gen"
timeout 120 python3 benchmarks/generate.py --model gpt-oss-20b-8l --contexts 4096 --batches 1 --variants rubin \
    --eager-batches "" --new-tokens 128 --repeats 2 --step-contexts "" --out "$OUT/gen" > "$OUT/generate-gpt-oss.log" 2>&1
echo "generate exit $?"
grep '^{' "$OUT/generate-gpt-oss.log" | cut -c1-300
