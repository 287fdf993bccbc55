# Issue 13's routing goal: the routing tests on the GPU, the top-k probe (ways to choose k of E in one program) and the
# profile. Ran at 64e32ba and 6458bea with a one-kernel form (RouteConfig.fused) beside; that form measured slower than
# the two PDL-chained kernels at every shape (results/route-h100-2026-12-06) and was removed.
source benchmarks/h200/moe13-common.sh
timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/gpu/test_triton_route.py 2>&1 | grep -v Warn | tail -15 | tee "$OUT/pytest-route.log"
timeout 150 python3 benchmarks/h200/route_topk_probe.py 2>&1 | grep -v Warn | tail -22 | tee "$OUT/topk-probe.log"
timeout 200 python3 benchmarks/route_profile.py --no-sweep --out "$OUT" 2>&1 | grep -v Warning | tail -18 | tee "$OUT/route-profile.log"
