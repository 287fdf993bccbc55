#!/usr/bin/env bash
# Issue 16, GPT-OSS (attention sinks, built 2026-12-07 on the CPU, not yet run on a GPU): the decode attention's GPU
# tests (the sinks test among them), then generate() of 8 layers of GPT-OSS-20B's dimensions (random bf16 weights:
# eager attention with sinks, every other layer a 128-position sliding window, 32 experts top 4) at 4k and 16k,
# batch 1 and 8, Inductor against rubin (ids checked against Inductor's); then the decode step alone as one CUDA
# graph at 4k and 16k with its per-kernel profile (a full sliding-window layer rolls its window on every replay;
# only the full layers' counters are rewound). ~8 min.
#   bash benchmarks/h200/gptoss16-1-generate.sh   (carry .whl)
. "$(dirname "$0")/common.sh"
{ time timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/gpu/test_decode_attention.py \
    tests/gpu/test_inline_kernels.py ; } > "$OUT/pytest-attention.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed|^real" "$OUT/pytest-attention.log" | tail -8
mkdir -p "$OUT/gen" "$OUT/step"
timeout 300 python3 benchmarks/generate.py --model gpt-oss-20b-8l --contexts 4096,16384 --batches 1,8 \
    --variants inductor,rubin --eager-batches "" --new-tokens 128 --repeats 2 --step-contexts "" --out "$OUT/gen" \
    > "$OUT/generate-gpt-oss.log" 2>&1
echo "generate exit $?"
grep -v '^{' "$OUT/generate-gpt-oss.log" | grep -iv "warn\|rope" | grep -E "^\||Error" | tail -12
timeout 200 python3 benchmarks/generate.py --model gpt-oss-20b-8l --contexts "" --batches "" \
    --step-contexts 4096,16384 --out "$OUT/step" > "$OUT/step-gpt-oss.log" 2>&1
echo "step exit $?"
grep -v '^{' "$OUT/step-gpt-oss.log" | grep -iv "warn\|rope" | grep -E "^\||Error" | tail -30
