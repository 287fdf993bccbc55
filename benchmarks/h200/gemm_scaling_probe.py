"""Issue 12: what holds a decode GEMM at 63% of copy bandwidth -- the fixed cost of a call or the rate of each
program. Qwen3-30B-A3B's q/k/v config (64-column tiles, K tiles of 128, 6 stages, the early tile; one program per N
tile, K = 2048 whole) at M = 1 over N = 640 .. 20480 (10 .. 320 programs on 132 SMs), against cuBLAS: us per call
(CUDA-graph replays of back-to-back calls over weight copies L2 cannot hold, PDL on), GB/s, and per program
(weight bytes of one program / time).

    PYTHONPATH=. python benchmarks/h200/gemm_scaling_probe.py
"""

import torch

from rubin_compile.kernels.triton import gemm as G
from rubin_compile.kernels.triton import tune_gemm as T

K = 2048
cfg = G.GemmConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=6, early=True)
print(f"config {cfg.describe()}, K = {K}, M = 1")
print("| N | programs | MB | ours us | GB/s | per program GB/s | cuBLAS us | cuBLAS GB/s |")
print("|---|---|---|---|---|---|---|---|")
for N in (640, 1280, 2560, 5120, 10240, 20480):
    ws = T.make_weights(N, K, "bf16", T.copies_for(N, K, "bf16"))
    x = torch.randn((1, K), device="cuda", dtype=torch.bfloat16)
    ours = T.ours_time(x, ws, cfg, True, 30)
    cub = T.cublas_time(x, ws, "bf16", 30)
    mb = N * K * 2 / 1e6
    progs = N // 64
    print(
        f"| {N} | {progs} | {mb:.1f} | {ours:.2f} | {mb * 1e3 / ours:.0f} | {mb * 1e3 / ours / progs:.1f} | "
        f"{cub:.2f} | {mb * 1e3 / cub:.0f} |",
        flush=True,
    )
    del ws
