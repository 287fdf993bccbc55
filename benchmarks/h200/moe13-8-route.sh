# Step 8: the routing fused into the pipeline (match_routing -> rubin.route -> kernels/triton/route.py). GPU tests of
# the new path and of everything it now runs through (PDL / locality, end to end, selection); the routing benchmark;
# the decode step with and without the fused routing, profiled (routing kernels per step, the MoE block per layer).
source benchmarks/h200/moe13-common.sh
{ time timeout 300 python3 -m pytest tests/gpu/test_match_routing_gpu.py tests/gpu/test_triton_route.py tests/gpu/test_pdl_locality.py \
    tests/gpu/test_end_to_end_gpu.py tests/gpu/test_select_kernels_gpu.py -q -n 8 -p no:cacheprovider -rfE ; } 2>&1 \
  | grep -v Warning | grep -v warner | tail -30 | tee "$OUT/pytest-step8.log"
timeout 60 python3 benchmarks/route.py --out "$OUT" --tokens 1 4 16 64 2>&1 | tail -20 | tee "$OUT/route.log"
timeout 220 python3 benchmarks/decode_step.py --tokens 1,8 --variants rubin-pdl,rubin-pdl-route-aten --iters 20 --rounds 2 \
  --profile --out "$OUT" 2>&1 | tail -60 | tee "$OUT/decode-step.log"
