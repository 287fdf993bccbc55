"""Issue 12: weight bytes in flight per program against the q/k/v GEMM's time (Qwen3-30B-A3B, N = 5120, K = 2048,
M = 1): tile width, K tile and pipeline depth (Triton's num_stages: num_stages - 1 weight tiles in flight), one
program per N tile, K whole. us per call (CUDA-graph replays of back-to-back calls over weight copies L2 cannot hold,
PDL on); configs whose shared memory does not fit are reported as such.

    PYTHONPATH=. python benchmarks/h200/gemm_inflight_probe.py
"""

import torch

from rubin_compile.kernels.triton import gemm as G
from rubin_compile.kernels.triton import tune_gemm as T

K, N = T.SHAPES["qwen3-30b-a3b.qkv"]
ws = T.make_weights(N, K, "bf16", T.copies_for(N, K, "bf16"))
x = torch.randn((1, K), device="cuda", dtype=torch.bfloat16)
floor = T.floor_us(1, N, K, "bf16", 4200)
print(f"N={N} K={K} M=1, floor {floor:.2f} us at 4.2 TB/s")
print("| block_n | block_k | stages | warps | programs | KB in flight per program | us | % of floor |")
print("|---|---|---|---|---|---|---|---|")
for bn, bk, stages, warps in [
    (64, 128, 4, 4), (64, 128, 6, 4), (64, 128, 8, 4), (64, 128, 10, 4), (64, 128, 6, 8), (64, 128, 8, 8),
    (64, 256, 3, 4), (64, 256, 4, 4), (64, 256, 5, 4), (64, 256, 4, 8),
    (32, 128, 6, 4), (32, 128, 8, 4), (32, 128, 12, 4), (32, 256, 6, 4), (32, 256, 8, 4),
    (128, 128, 4, 4), (128, 128, 6, 8), (16, 256, 8, 4), (16, 512, 6, 4),
]:  # fmt: skip
    cfg = G.GemmConfig(block_n=bn, block_k=bk, split_k=1, num_warps=warps, num_stages=stages)
    inflight = (stages - 1) * bn * bk * 2 / 1024
    try:
        us = T.ours_time(x, ws, cfg, True, 30)
        print(f"| {bn} | {bk} | {stages} | {warps} | {N // bn} | {inflight:.0f} | {us:.2f} | {100 * floor / us:.0f} |",
              flush=True)  # fmt: skip
    except Exception as exc:  # e.g. triton.runtime.errors.OutOfResources (shared memory)
        print(
            f"| {bn} | {bk} | {stages} | {warps} | {N // bn} | {inflight:.0f} | {type(exc).__name__} | - |", flush=True
        )
