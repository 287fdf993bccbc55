#!/usr/bin/env bash
# Issue 12 (second session), H200 step 1: the GPU tests of the early weight tile, then the tuner over the widened
# candidates (6 stages, 8 warps, K tiles of 256, the early tile on the four fastest): bf16 at every M bucket,
# FP8 block at M = 1, 16, 64, merged into the committed table (other buckets and Inductor's times kept). The
# table lands in $OUT/gemm_configs; the summary compares it with the committed one.
#   bash benchmarks/h200/gemm-8-retune.sh
. "$(dirname "$0")/common.sh"
timeout 80 python3 -m pytest tests/gpu/test_triton_gemm.py -q -p no:cacheprovider -k "early or pdl_bitwise" \
    > "$OUT/pytest-early.log" 2>&1
echo "pytest exit $?"; grep -E "FAILED|passed|failed|Error" "$OUT/pytest-early.log" | tail -6
mkdir -p "$OUT/gemm_configs" && cp rubin_compile/kernels/triton/gemm_configs/NVIDIA_H200.json "$OUT/gemm_configs/"
timeout 320 python3 -m rubin_compile.kernels.triton.tune_gemm --formats bf16 --merge --out "$OUT/gemm_configs" \
    > "$OUT/tune-gemm-bf16.log" 2>&1
echo "tune bf16 exit $?"
timeout 140 python3 -m rubin_compile.kernels.triton.tune_gemm --formats fp8_block --ms 1,16,64 --merge \
    --out "$OUT/gemm_configs" > "$OUT/tune-gemm-fp8.log" 2>&1
echo "tune fp8 exit $?"
grep -h -E "compiled|Error|error|wrong" "$OUT"/tune-gemm-*.log | head -10
python3 - "$OUT/gemm_configs/NVIDIA_H200.json" <<'PY'
import json, math, sys
old = json.load(open("rubin_compile/kernels/triton/gemm_configs/NVIDIA_H200.json"))["entries"]
new = json.load(open(sys.argv[1]))["entries"]
print(f"{'entry':30s} {'M':>3s} {'old':>7s} {'new':>7s} {'cuBLAS':>7s} {'floor':>7s} {'%BW':>4s} config")
ratios, early = [], 0
for key in sorted(new):
    for m in ("1", "4", "16", "64"):
        n, o = new[key].get(m), old.get(key, {}).get(m)
        if n is None:
            continue
        early += bool(n["config"].get("early"))
        if o is not None:
            ratios.append(o["ours_us"] / n["ours_us"])
        cfg = " ".join(f"{k}={v}" for k, v in sorted(n["config"].items()))
        ou = f"{o['ours_us']:7.2f}" if o else "      -"
        print(f"{key:30s} {m:>3s} {ou} {n['ours_us']:7.2f} {n['cublas_us']:7.2f} {n['floor_us']:7.2f} "
              f"{100 * n['floor_us'] / n['ours_us']:4.0f} {cfg}")
g = math.exp(sum(map(math.log, ratios)) / len(ratios))
print(f"old / new geometric mean {g:.3f} over {len(ratios)} rows; early chosen in {early}")
PY
