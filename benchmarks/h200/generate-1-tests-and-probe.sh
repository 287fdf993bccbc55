#!/usr/bin/env bash
# Issue 16, H200 step 1: the GPU suite, the decode attention kernel against the ATen form, and one generate() point
# (context 4096, batch 1, 64 new tokens) with the one-CUDA-graph step and its profile. Run from the checkout root:
#   bash benchmarks/h200/generate-1-tests-and-probe.sh      (carry .whl)
. "$(dirname "$0")/common.sh"
timeout 260 python3 -m pytest tests/gpu -q -n 6 -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -25
timeout 90 python3 benchmarks/decode_attention.py --out "$OUT" 2>&1 | grep -v '^{' | tail -25
TORCH_LOGS=perf_hints timeout 220 python3 benchmarks/generate.py --contexts 4096 --batches 1 --new-tokens 64 \
    --repeats 2 --step-contexts 4096 --out "$OUT/probe" > "$OUT/probe.log" 2>&1
echo "generate probe exit $?"
grep -v '^{' "$OUT/probe.log" | grep -iv "warn" | tail -40
echo "--- cudagraph messages:"; grep -i "cudagraph" "$OUT/probe.log" | sort | uniq -c | head -10
