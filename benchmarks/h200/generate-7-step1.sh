#!/usr/bin/env bash
# Issue 16, third session, H200 step 1: the GPU tests of the changed kernels and passes (attention with PDL and
# its L2 prefetch, fused projections under CUDA graphs, generate()), the decode attention benchmark (PDL on / off),
# and the decode step alone at 4k / 16k for rubin planned for a captured graph (cudagraphs="external") and its
# ablations, each profiled at 4k.
#   bash benchmarks/h200/generate-7-step1.sh
. "$(dirname "$0")/common.sh"
{ time timeout 170 python3 -m pytest tests/gpu/test_decode_attention.py tests/gpu/test_triton_gemm.py \
    tests/gpu/test_generate.py tests/gpu/test_pdl_locality.py tests/gpu/test_end_to_end_gpu.py \
    -q -n 8 -p no:cacheprovider -rfE ; } > "$OUT/pytest-step1.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest-step1.log" | tail -15
grep -E "^E   " "$OUT/pytest-step1.log" | cut -c1-300 | head -12
timeout 100 python3 benchmarks/decode_attention.py --contexts 4096,16384,32768 --batches 1,8 --out "$OUT" \
    > "$OUT/decode-attention.log" 2>&1
echo "decode_attention exit $?"; grep "^|" "$OUT/decode-attention.log" | tail -30
timeout 300 python3 benchmarks/generate.py --contexts "" --step-contexts 4096,16384 --new-tokens 64 \
    --step-variants inductor,rubin,rubin-uncaptured-plan,rubin-nofuse,rubin-inductor-pdl \
    --profile-variants rubin,rubin-inductor-pdl --out "$OUT" > "$OUT/step.log" 2>&1
echo "generate step exit $?"
grep -v '^{' "$OUT/step.log" | grep -iv "warn" | grep "^|\|^kernel\|^Per-\|Error" | tail -60
