#!/usr/bin/env bash
# Issue 12, the next H200 step for the GEMM (written 2026-12-03 in a session with no device time; not yet run):
# the GPU tests of the reduction (GEMV) form (every format and epilogue, split-K, the early tile, PDL on / off
# bitwise under graph replay), then the tuner at M = 1, 2, 4 with its GEMV candidates, bf16 and FP8 block, merged
# into the committed table (other buckets kept), and how often the GEMV form won and by how much against the
# committed entries and Inductor's max-autotune times already in the table. The table lands in $OUT/gemm_configs.
#   bash benchmarks/h200/gemm-11-gemv.sh
. "$(dirname "$0")/common.sh"
timeout 120 python3 -m pytest tests/gpu/test_triton_gemm.py -q -p no:cacheprovider -k "gemv or pdl_bitwise" \
    > "$OUT/pytest-gemv.log" 2>&1
echo "pytest exit $?"; grep -E "FAILED|passed|failed|Error" "$OUT/pytest-gemv.log" | tail -6
mkdir -p "$OUT/gemm_configs" && cp rubin_compile/kernels/triton/gemm_configs/NVIDIA_H200.json "$OUT/gemm_configs/"
T="python3 -m rubin_compile.kernels.triton.tune_gemm --merge --out $OUT/gemm_configs --ms 1,2,4"
timeout 240 $T --formats bf16 > "$OUT/tune-gemm-bf16.log" 2>&1
echo "tune bf16 exit $?"
timeout 120 $T --formats fp8_block > "$OUT/tune-gemm-fp8.log" 2>&1
echo "tune fp8 exit $?"
grep -h -E "Error|error|wrong" "$OUT"/tune-gemm-*.log | head -10
python3 - "$OUT/gemm_configs/NVIDIA_H200.json" <<'PY'
import json, math, sys
old = json.load(open("rubin_compile/kernels/triton/gemm_configs/NVIDIA_H200.json"))["entries"]
new = json.load(open(sys.argv[1]))["entries"]
print(f"{'entry':34s} {'M':>2s} {'old':>7s} {'new':>7s} {'cuBLAS':>7s} {'Ind.':>7s} {'floor':>7s} {'%BW':>4s} gemv config")
ratios, gemv = [], 0
for key in sorted(new):
    for m in ("1", "2", "4"):
        n, o = new[key].get(m), old.get(key, {}).get(m)
        if n is None:
            continue
        g = bool(n["config"].get("gemv"))
        gemv += g
        if o is not None:
            ratios.append(o["ours_us"] / n["ours_us"])
        ind = o.get("inductor_us") if o else None
        cfg = " ".join(f"{k}={v}" for k, v in sorted(n["config"].items()) if v not in (False, None))
        print(f"{key:34s} {m:>2s} {o['ours_us'] if o else float('nan'):7.2f} {n['ours_us']:7.2f} {n['cublas_us']:7.2f} "
              f"{ind if ind else float('nan'):7.2f} {n['floor_us']:7.2f} {100 * n['floor_us'] / n['ours_us']:4.0f} "
              f"{'yes' if g else 'no ':4s} {cfg}")
if ratios:
    print(f"old / new geometric mean {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f} over {len(ratios)} rows;"
          f" the GEMV form chosen in {gemv}")
PY
