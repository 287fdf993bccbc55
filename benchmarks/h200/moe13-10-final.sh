# Step 10 (final): the GPU tests changed after step 9 (test_match_routing_gpu.py's expectations) and the ones step 9
# saw fail or that run through the fused routing (selection, PDL / locality, end to end, generate), full log under $OUT.
source benchmarks/h200/moe13-common.sh
{ time timeout 400 python3 -m pytest tests/gpu/test_match_routing_gpu.py tests/gpu/test_select_kernels_gpu.py \
    tests/gpu/test_pdl_locality.py tests/gpu/test_end_to_end_gpu.py tests/gpu/test_generate.py tests/gpu/test_triton_route.py \
    -q -n 8 -p no:cacheprovider -rfE ; } > "$OUT/pytest-step10-full.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest-step10-full.log" | tail -30
grep -E "^E   " "$OUT/pytest-step10-full.log" | cut -c1-300 | head -30
