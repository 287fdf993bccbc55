"""Time versions of the fused-MoE kernel file side by side (to find a regression).

    git show 3eda66a~1:rubin_compile/kernels/triton/moe.py > /tmp/moe_a.py     # on a machine with the repo
    PYTHONPATH=. python benchmarks/moe_bisect.py /tmp/moe_a.py rubin_compile/kernels/triton/moe.py

Each file is loaded as its own module (they import rubin_compile.ops.moe for the argument checks) and runs
the same Qwen3-30B-A3B decode call (T = 1, E = 128, k = 8, H = 2048, I = 768, bf16): one CUDA graph of 8
calls on 4 rotating random weight copies (cold weights), timed by tune_moe.time_graph (the tuner's
method), median per call, with PDL on. benchmarks/results/moe-regression-bisect-h200.log was made the same
way with a local copy of that timing loop (median of replays 4-30, no separate warm-up).
"""

import importlib.util
import statistics
import sys

import torch

from rubin_compile.kernels.triton.tune_moe import time_graph


def load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    files = sys.argv[1:]
    if not files:
        sys.exit(__doc__)
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = [
        (
            (torch.randn((128, 1536, 2048), device="cuda", generator=g) / 45).bfloat16(),
            (torch.randn((128, 2048, 768), device="cuda", generator=g) / 28).bfloat16(),
        )
        for _ in range(4)
    ]
    x = torch.randn((1, 2048), device="cuda", dtype=torch.bfloat16, generator=g)
    ids = [torch.randperm(128, device="cuda", generator=g)[:8].view(1, 8) for _ in range(8)]
    tw = torch.full((1, 8), 0.125, device="cuda")
    for n, path in enumerate(files):
        mod = load(path, f"moe_version_{n}")
        calls = [lambda w=weights[j % 4], i=i: mod.fused_moe(x, w[0], w[1], tw, i, pdl=True) for j, i in enumerate(ids)]
        print(f"{path}: {statistics.median(time_graph(calls)):.1f} us per call", flush=True)


if __name__ == "__main__":
    main()
