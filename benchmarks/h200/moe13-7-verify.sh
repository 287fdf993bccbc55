# Step 7 (session 2 of issue 13, first call): the GPU tests that had not run on the last kernel changes
# (split-N FP8 path 5b85286, e767d7d, 2f30117): PDL / locality, the MoE and routing kernels, selection, end to end.
source benchmarks/h200/moe13-common.sh
{ time timeout 420 python3 -m pytest tests/gpu/test_pdl_locality.py tests/gpu/test_triton_moe.py tests/gpu/test_triton_route.py \
    tests/gpu/test_select_kernels_gpu.py tests/gpu/test_end_to_end_gpu.py -q -n 8 -p no:cacheprovider -rfE ; } 2>&1 \
  | grep -v Warning | grep -v warner | tail -40 | tee "$OUT/pytest-step7.log"
