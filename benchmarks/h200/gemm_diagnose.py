"""Issue 12 diagnosis on the H200: why a decode GEMM of ours costs ~2x its floor. Per shape at M = 1: cuBLAS and
a set of our configs (tensor-core tiles vs FMA, prefetch budget, PDL on / off), timed as benchmarks/gemm.py
times them, plus the kernels' own durations from torch.profiler (graph replays), to split the time into
kernel duration and the launch gap between kernels."""

import statistics
import torch
from rubin_compile.kernels.triton import gemm as G, tune_gemm as T
from rubin_compile.ops.gemm import GemmArgs

bw = T.copy_bandwidth_gbs()
print(f"copy bandwidth {bw:.0f} GB/s")
C = G.GemmConfig
CONFIGS = {
    "mma n32 k128 st4": C(32, 128, 1, 4, 4, False),
    "mma n32 k128 st4 +pf": C(32, 128, 1, 4, 4, True),
    "mma n64 k128 st4": C(64, 128, 1, 4, 4, False),
    "mma n128 k64 s8 st3": C(128, 64, 8, 4, 3, False),
    "fma n32 k128 st4": C(32, 128, 1, 4, 4, False, False),
    "fma n16 k256 st4": C(16, 256, 1, 4, 4, False, False),
    "fma n64 k128 st3": C(64, 128, 1, 4, 3, False, False),
    "fma n32 k256 st3 w8": C(32, 256, 1, 8, 3, False, False),
    "fma n16 k512 st3 w4": C(16, 512, 1, 4, 3, False, False),
    "fma n32 k128 st6": C(32, 128, 1, 4, 6, False, False),
    "fma n8 k512 st4": C(8, 512, 1, 4, 4, False, False),
}
SHAPES = {
    "qwen3.qkv": (2048, 5120),
    "llama.gate_up": (4096, 28672),
    "qwen3.o": (4096, 2048),
    "qwen3.router": (2048, 128),
}


def kernel_us(calls):
    from torch.profiler import ProfilerActivity, profile

    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
    ev = [e for e in p.events() if e.device_type.name == "CUDA"]
    by = {}
    for e in ev:
        by.setdefault(e.name[:40], []).append(e.device_time if hasattr(e, "device_time") else e.cuda_time)
    return {k: (statistics.median(v), len(v) // 3) for k, v in by.items()}


for name, (K, N) in SHAPES.items():
    for wfmt in ("bf16", "fp8_block") if name == "qwen3.qkv" else ("bf16",):
        ws = T.make_weights(N, K, wfmt, T.copies_for(N, K, wfmt))
        x = torch.randn((1, K), device="cuda", dtype=torch.bfloat16)
        floor = T.floor_us(1, N, K, wfmt, bw)
        cb = T.cublas_time(x, ws if wfmt == "bf16" else T.make_weights(N, K, "bf16", 4), "bf16", 10)
        print(f"\n{name} {wfmt} M=1 floor {floor:.2f} us; cuBLAS(bf16) {cb:.2f} us ({100 * floor / cb:.0f}%)")
        if wfmt == "bf16":
            print(
                "   cuBLAS kernels:",
                {k: round(v[0], 2) for k, v in kernel_us([lambda w=w: torch.mm(x, w["b"]) for w in ws]).items()},
            )
        best = None
        for label, cfg in CONFIGS.items():
            try:
                t_on = T.ours_time(x, ws, cfg, True, 10)
                t_off = T.ours_time(x, ws, cfg, False, 10)
            except Exception as e:
                print(f"   {label:24s} FAILED {type(e).__name__}: {str(e)[:150]}")
                continue
            print(f"   {label:24s} PDL {t_on:7.2f} ({100 * floor / t_on:3.0f}%)  no PDL {t_off:7.2f}")
            if best is None or t_on < best[1]:
                best = (cfg, t_on, label)
        for budget in (1 << 20, 4 << 20, 24 << 20):
            G.PREFETCH_BUDGET = budget
            cfg = G.GemmConfig(**{**best[0].to_json(), "prefetch": True})
            print(
                f"   best ({best[2]}) +prefetch budget {budget >> 20} MB: PDL {T.ours_time(x, ws, cfg, True, 10):.2f}"
            )
        G.PREFETCH_BUDGET = 24 << 20
        kk = kernel_us([lambda w=w: G.launch(GemmArgs(x, **w), best[0], pdl=True) for w in ws])
        print("   ours best kernels (PDL):", {k: round(v[0], 2) for k, v in kk.items()})
        del ws
        torch.cuda.empty_cache()
