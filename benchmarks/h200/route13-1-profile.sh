# Issue 13's routing goal (<= 3 us per layer at T <= 32): where the two routing kernels' time goes
# (benchmarks/route_profile.py: the launch floor, each kernel alone, the profiled per-kernel times, a tile sweep),
# then the routing benchmark as it stands (benchmarks/route.py, without Inductor's compiles).
source benchmarks/h200/moe13-common.sh
timeout 420 python3 benchmarks/route_profile.py --out "$OUT" 2>&1 | grep -v Warning | tail -40 | tee "$OUT/route-profile.log"
timeout 90 python3 benchmarks/route.py --out "$OUT" --tokens 1 4 16 32 --no-inductor 2>&1 | tail -16 | tee "$OUT/route.log"
