"""What cuBLAS reaches on a prefill MoE's two GEMMs done as one dense GEMM each: the ceiling a grouped GEMM of the
same work is measured against.

At T tokens and top-k, FC1 is [T k, H] x [H, 2I] and FC2 [T k, I] x [I, H], summed over the experts; a dense GEMM of
those sizes does the same FLOPs with none of a grouped GEMM's costs (the row gather, the padding of each expert's
rows to the tile, the tile table, the top-k sum). This times both on one weight matrix with cuBLAS: ``torch.mm`` in
bf16, ``torch._scaled_mm`` in e4m3 with one scale per row and column (what cuBLAS offers on sm_90; 128 x 128 block
scales it has not), CUDA events around 10 back-to-back calls, median of 10 runs, random data.

    python benchmarks/moe_dense_ceiling.py --shapes qwen3-30b-a3b,deepseek-v3-tp8 --tokens 1024,4096 [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rubin_compile.kernels.triton.tune_moe import SHAPES, time_eager  # noqa: E402


def time_us(fn, reps: int = 10, inner: int = 10) -> float:
    """Median over ``reps`` runs of ``inner`` back-to-back calls, per call, in microseconds (CUDA events)."""
    return statistics.median(time_eager(fn, reps=reps, warmup=3, inner=inner))


def gemm_us(M: int, N: int, K: int, fp8: bool) -> float:
    """One [M, K] x [K, N] product on cuBLAS: bf16, or e4m3 with row and column scales, bf16 out."""
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    if not fp8:
        bt = b.t()
        return time_us(lambda: a @ bt)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    sa = torch.rand(M, 1, device="cuda", dtype=torch.float32) + 0.5
    sb = torch.rand(1, N, device="cuda", dtype=torch.float32) + 0.5
    return time_us(lambda: torch._scaled_mm(a8, b8, sa, sb, out_dtype=torch.bfloat16))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3-tp8,mixtral-8x7b")
    p.add_argument("--tokens", default="1024,4096")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    rows = []
    print(f"{torch.cuda.get_device_name()}; cuBLAS through torch {torch.__version__}")
    print("| shape | T | format | FC1 us | FC2 us | FC1 + FC2 us | TFLOP/s |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for name in args.shapes.split(","):
        sh = SHAPES[name]
        H, I, k = sh["H"], sh["I"], sh["k"]
        for T in (int(t) for t in args.tokens.split(",")):
            M = T * k
            for fmt in ("bf16", "fp8"):
                fc1 = gemm_us(M, 2 * I, H, fmt == "fp8")
                fc2 = gemm_us(M, H, I, fmt == "fp8")
                flops = 2 * M * H * 2 * I + 2 * M * I * H
                tflops = flops / (fc1 + fc2) / 1e6
                rows.append(dict(shape=name, T=T, format=fmt, fc1_us=fc1, fc2_us=fc2, tflops=tflops))
                print(f"| {name} | {T} | {fmt} | {fc1:.1f} | {fc2:.1f} | {fc1 + fc2:.1f} | {tflops:.0f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
