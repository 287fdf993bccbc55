#!/usr/bin/env bash
# Issue 16, at the commit submitted: the whole GPU suite (generate-17's run stopped at its 200 s limit with two
# failures it did not name), then GPT-OSS-20B dims' decode step alone as one CUDA graph at 4k with its per-kernel
# profile (gptoss16-1's step recompiled during the capture: the sliding layers' int counter, now rewound).
# ~8.5 min.   bash benchmarks/h200/generate-18-final.sh   (carry .whl and .vllm-src)
. "$(dirname "$0")/common.sh"
{ time timeout 330 python3 -m pytest tests/gpu -q -n 8 -p no:cacheprovider -rfE --durations=12 ; } \
    > "$OUT/pytest-final.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed|^real" "$OUT/pytest-final.log" | tail -12
mkdir -p "$OUT/step"
timeout 170 python3 benchmarks/generate.py --model gpt-oss-20b-8l --contexts "" --batches "" \
    --step-contexts 4096 --out "$OUT/step" > "$OUT/step-gpt-oss.log" 2>&1
echo "step exit $?"
grep -v '^{' "$OUT/step-gpt-oss.log" | grep -iv "warn\|rope" | grep -E "^\||Error" | tail -30
