# Issue 13's routing goal, final numbers at the heuristic's new choices: the routing tests, benchmarks/route.py with
# Inductor's compiles (the documented table), and the decode step of 8 Qwen3-30B-A3B layers with the fused routing
# and without it (per-layer routing and MoE block in the profile). Carry .whl (transformers).
source benchmarks/h200/common.sh
echo "tree of commit ${RUBIN_COMMIT:-?}"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/gpu/test_triton_route.py tests/gpu/test_match_routing_gpu.py 2>&1 | grep -v Warn | tail -8 | tee "$OUT/pytest-route.log"
timeout 200 python3 benchmarks/route.py --out "$OUT" --tokens 1 4 16 32 2>&1 | tail -16 | tee "$OUT/route.log"
timeout 170 python3 benchmarks/decode_step.py --tokens 1 --variants rubin-pdl,rubin-pdl-route-aten --iters 20 --rounds 2 \
  --profile --out "$OUT" 2>&1 | tail -45 | tee "$OUT/decode-step.log"
