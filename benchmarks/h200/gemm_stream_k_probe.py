"""Issue 12: the stream-K form against the tuned config on a few decode shapes at M = 1 and 16 (us per call,
CUDA-graph replays of back-to-back calls over weight copies, PDL on), to see why the tuner chose it nowhere."""

import torch

from rubin_compile.kernels.triton import gemm as G
from rubin_compile.kernels.triton import tune_gemm as T

for name in ("qwen3-30b-a3b.qkv", "qwen3-30b-a3b.o", "llama-3.1-8b.o", "deepseek-v3-tp8.mlp_gate_up"):
    K, N = T.SHAPES[name]
    ws = T.make_weights(N, K, "bf16", T.copies_for(N, K, "bf16"))
    for M in (1, 16):
        x = torch.randn((M, K), device="cuda", dtype=torch.bfloat16)
        best = G.choose(M, N, K, "bf16", torch.cuda.get_device_name(), 132).config
        rows = [("table " + best.describe(), T.ours_time(x, ws, best, True, 20))]
        for bn in (16, 32, 64):
            for sk in (1, 2, 4):
                for st in (4, 6):
                    cfg = G.GemmConfig(bn, 128, 1, 4, st, False, stream_k=sk)
                    rows.append((cfg.describe(), T.ours_time(x, ws, cfg, True, 20)))
        rows.sort(key=lambda r: r[1])
        floor = T.floor_us(M, N, K, "bf16", 4200)
        print(f"{name} M={M} floor {floor:.2f} us: " + "; ".join(f"{d} {t:.2f}" for d, t in rows[:6]), flush=True)
        print(
            f"   table {rows[[r[0] for r in rows].index('table ' + best.describe())][1]:.2f}; worst {rows[-1][0]} {rows[-1][1]:.2f}",
            flush=True,
        )
    del ws
