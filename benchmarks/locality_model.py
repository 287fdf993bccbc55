"""The split-N locality cost model of docs/pdl_locality.md, evaluated (no GPU needed).

    python benchmarks/locality_model.py                      # MiniMax-M2-like shards, T = 1..16
    python benchmarks/locality_model.py --r 1.4 --c-us 3 --j-us 1.5 --hbm-tbps 19

Model: t_whole = (W / B) * (1 + r) / 2 + c,  t_split = W / B + c + j,  gain = t_whole / t_split, with W the
bytes of the experts one MoE call reads (expected distinct experts under uniform routing), B the HBM
bandwidth of the whole GPU, r how much slower an SM reads the other domain's memory than its own, c the
fixed cost of the call (launches, routing, ramp) and j the fork / join of the split. Prints the gain per
shard and token count, and the r that would give the announcement's 1.2x at each point.
"""

from __future__ import annotations

import argparse

# MiniMax-M2-like experts (E=256, k=8, H=3072, I=1536; rubin_compile/kernels/triton/tune_moe.py SHAPES),
# sharded as the announcement's runs were: TP shards I, EP shards E.
SHARDS = {"TP2": dict(E=256, I=768), "TP4": dict(E=256, I=384), "EP2": dict(E=128, I=1536), "EP4": dict(E=64, I=1536)}
H, K_TOP = 3072, 8


def expert_bytes(E: int, I: int, T: int, elt: float, k: int = K_TOP, experts_total: int = 256) -> float:
    """Bytes of the distinct local experts T tokens route to (uniform routing over all experts; under EP
    only the local E of them are on this GPU)."""
    distinct_total = experts_total * (1 - (1 - k / experts_total) ** T)
    return distinct_total * (E / experts_total) * 3 * H * I * elt


def gain(W: float, B: float, r: float, c: float, j: float) -> float:
    wb = W / B
    return (wb * (1 + r) / 2 + c) / (wb + c + j)


def r_for(g: float, W: float, B: float, c: float, j: float) -> float:
    """The remote-read penalty r at which the model gives gain g."""
    wb = W / B
    return 2 * (g * (wb + c + j) - c) / wb - 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--r", type=float, default=1.4, help="remote / local read time per byte")
    ap.add_argument("--hbm-tbps", type=float, default=19.0, help="Rubin HBM4, about 2.4x GB200's 8 TB/s")
    ap.add_argument("--c-us", type=float, default=3.0, help="fixed cost of one MoE call")
    ap.add_argument("--j-us", type=float, default=1.5, help="fork / join of the split")
    ap.add_argument("--bytes-per-weight", type=float, default=1.0, help="1 = FP8, 0.5625 = NVFP4 with scales, 2 = bf16")
    ap.add_argument("--tokens", default="1,2,4,8,16")
    args = ap.parse_args()
    B = args.hbm_tbps * 1e12
    c, j = args.c_us * 1e-6, args.j_us * 1e-6
    Ts = [int(t) for t in args.tokens.split(",")]
    print(
        f"r={args.r}, HBM {args.hbm_tbps} TB/s, c={args.c_us} us, j={args.j_us} us, "
        f"{args.bytes_per_weight} bytes per weight"
    )
    print("| shard | T | expert MB | W/B us | predicted gain | r for 1.2x |")
    print("|---|---|---|---|---|---|")
    for name, s in SHARDS.items():
        for T in Ts:
            W = expert_bytes(s["E"], s["I"], T, args.bytes_per_weight)
            print(
                f"| {name} | {T} | {W / 1e6:.0f} | {W / B * 1e6:.1f} | {gain(W, B, args.r, c, j):.2f} | "
                f"{r_for(1.2, W, B, c, j):.2f} |"
            )


if __name__ == "__main__":
    main()
