# Issue 13's routing goal, after the bitonic top-k: the routing tests (both logits forms at T <= 16), then the profile
# with whole-call timings of other logits tiles and both logits forms at T <= 8 (benchmarks/route_profile.py's SWEEP),
# for the heuristic's next choice; then the routing table as it stands (benchmarks/route.py, without Inductor).
source benchmarks/h200/moe13-common.sh
timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/gpu/test_triton_route.py 2>&1 | grep -v Warn | tail -12 | tee "$OUT/pytest-route.log"
timeout 330 python3 benchmarks/route_profile.py --out "$OUT" 2>&1 | grep -v Warning | grep -v "^{" | tail -24 | tee "$OUT/route-profile.log"
timeout 90 python3 benchmarks/route.py --out "$OUT" --tokens 1 2 4 8 16 32 --no-inductor 2>&1 | tail -22 | tee "$OUT/route.log"
