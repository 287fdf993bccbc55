#!/usr/bin/env bash
# Issue 16, fifth session, H200 step 3: the launcher's hook check fixed (Triton 3.6 keeps launch hooks in empty
# chains, not None, so step 2 never bound a binary): the GPU tests of every kernel whose launch path changed, the
# host cost of the decode ops, and generate() with model.forward compiled (no CUDA graphs) per backend.
#   bash benchmarks/h200/host-3-final.sh
. "$(dirname "$0")/common.sh"
( time timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider -rfE tests/gpu/test_triton_launch.py \
    tests/gpu/test_decode_attention.py tests/gpu/test_triton_route.py tests/gpu/test_triton_moe.py \
    tests/gpu/test_triton_gemm.py tests/gpu/test_generate.py tests/gpu/test_end_to_end_gpu.py ) > "$OUT/pytest-gpu.log" 2>&1
echo "pytest exit $?"; grep -E "^FAILED|^ERROR|passed|failed|host us per launch" "$OUT/pytest-gpu.log" | tail -12
timeout 100 python3 benchmarks/host_cost.py --out "$OUT" --label final --reps 200 > "$OUT/host-cost.log" 2>&1
echo "host_cost exit $?"; grep -v '^{' "$OUT/host-cost.log" | tail -15
timeout 240 python3 benchmarks/h200/generate_host_diagnose.py --context 4096 --setup forward --repeats 2 \
    --profile-out "$OUT" > "$OUT/host-forward.log" 2>&1
echo "host-forward exit $?"; grep "^|\|Error" "$OUT/host-forward.log" | tail -5
sed -n 1,14p "$OUT/profile-forward-rubin.txt" | cut -c1-150
