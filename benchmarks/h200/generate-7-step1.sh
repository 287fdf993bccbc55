#!/usr/bin/env bash
# Issue 16, third session, H200 step 1: the decode attention benchmark (PDL on / off), the decode step alone at 4k
# (rubin planned for a captured graph, cudagraphs="external", and its ablations, profiled) and 16k, then the GPU
# tests of the changed kernels (attention with PDL and its L2 prefetch, fused projections under CUDA graphs).
#   bash benchmarks/h200/generate-7-step1.sh
. "$(dirname "$0")/common.sh"
# (at most 8 files come back: the logs that only repeat a table stay in /tmp)
timeout 90 python3 benchmarks/decode_attention.py --contexts 4096,16384,32768 --batches 1,8 --out "$OUT" \
    > /tmp/decode-attention.log 2>&1
echo "decode_attention exit $?"; grep "^|\|Error" /tmp/decode-attention.log | tail -30
timeout 240 python3 benchmarks/generate.py --contexts "" --step-contexts 4096 --new-tokens 64 \
    --step-variants inductor,rubin,rubin-uncaptured-plan,rubin-nofuse,rubin-inductor-pdl \
    --profile-variants rubin,rubin-inductor-pdl --out "$OUT/s4k" > "$OUT/step4k.log" 2>&1
echo "step 4k exit $?"
grep -v '^{' "$OUT/step4k.log" | grep -iv "warn" | grep "^|\|^kernel\|^Per-\|Error" | tail -45
timeout 110 python3 benchmarks/generate.py --contexts "" --step-contexts 16384 --new-tokens 64 \
    --step-variants inductor,rubin --profile-variants "" > "$OUT/step16k.log" 2>&1
echo "step 16k exit $?"; grep "^| 16384" "$OUT/step16k.log"
{ time timeout 100 python3 -m pytest tests/gpu/test_decode_attention.py "tests/gpu/test_triton_gemm.py::test_fused_projections_under_cuda_graphs" \
    -q -n 8 -p no:cacheprovider -rfE ; } > "$OUT/pytest-step1.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest-step1.log" | tail -15
grep -E "^E   " "$OUT/pytest-step1.log" | cut -c1-300 | head -12
