#!/usr/bin/env bash
# Issue 16, sixth session, H200 step 1: passes/inline_kernels.py (our Triton launches traced into the graph, launched
# by Inductor) -- its GPU tests; generate() with model.forward compiled (no CUDA graphs) at 4k for Inductor, rubin
# with every kernel node an op call (inline_kernels='off', the path before) and rubin as it is now; then the GPU
# tests of every kernel and compile path the pass touches.
#   bash benchmarks/h200/inline-1.sh
. "$(dirname "$0")/common.sh"
( time timeout 120 python3 -m pytest -q -s -p no:cacheprovider -rfE tests/gpu/test_inline_kernels.py ) > "$OUT/pytest-inline.log" 2>&1
echo "pytest exit $?"; grep -E "^FAILED|^ERROR|passed|failed|host us per call|Error" "$OUT/pytest-inline.log" | tail -12
timeout 270 python3 benchmarks/h200/generate_host_diagnose.py --context 4096 --setup forward --repeats 2 \
    --backends inductor,rubin-call,rubin --profile-out "$OUT" > "$OUT/host-forward.log" 2>&1
echo "host-forward exit $?"; grep "^|\|Error" "$OUT/host-forward.log" | tail -8
sed -n 1,12p "$OUT/profile-forward-rubin.txt" | cut -c1-160
( time timeout 170 python3 -m pytest -q -n 8 -p no:cacheprovider -rfE tests/gpu/test_generate.py \
    tests/gpu/test_end_to_end_gpu.py tests/gpu/test_decode_attention.py tests/gpu/test_triton_route.py \
    tests/gpu/test_triton_launch.py tests/gpu/test_match_routing_gpu.py ) > "$OUT/pytest-gpu.log" 2>&1
echo "pytest gpu exit $?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/pytest-gpu.log" | tail -14
