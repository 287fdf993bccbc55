"""A tuned GEMM table against the committed one: per (shape, M) the old and new time of ours, cuBLAS, the floor,
% of copy bandwidth, the config, and whether the stream-K form won; then geometric means.

    python3 benchmarks/h200/gemm_table_diff.py NEW.json [OLD.json]
"""

import json
import math
import sys

OLD = "rubin_compile/kernels/triton/gemm_configs/NVIDIA_H200.json"


def main() -> None:
    new = json.load(open(sys.argv[1]))["entries"]
    old = json.load(open(sys.argv[2] if len(sys.argv) > 2 else OLD))["entries"]
    print(f"{'entry':34s} {'M':>3s} {'old':>7s} {'new':>7s} {'cuBLAS':>7s} {'floor':>6s} {'%BW':>4s} config")
    ratios, vs_cublas, sk = [], [], 0
    for key in sorted(new):
        for m in sorted(new[key], key=int):
            n, o = new[key][m], old.get(key, {}).get(m)
            cfg = n["config"]
            sk += bool(cfg.get("stream_k"))
            if o is not None:
                ratios.append(o["ours_us"] / n["ours_us"])
            vs_cublas.append(n["cublas_us"] / n["ours_us"])
            desc = " ".join(f"{k}={v}" for k, v in sorted(cfg.items()) if v not in (False, 0) or k == "split_k")
            ou = f"{o['ours_us']:7.2f}" if o else "      -"
            print(
                f"{key:34s} {m:>3s} {ou} {n['ours_us']:7.2f} {n['cublas_us']:7.2f} {n['floor_us']:6.2f} "
                f"{100 * n['floor_us'] / n['ours_us']:4.0f} {desc}"
            )

    def gm(xs):
        return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")

    print(f"old / new geometric mean {gm(ratios):.3f} over {len(ratios)} entries; stream-K chosen in {sk}")
    print(f"cuBLAS / new geometric mean {gm(vs_cublas):.3f} over {len(vs_cublas)} entries")


if __name__ == "__main__":
    main()
