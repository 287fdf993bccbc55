"""Probe: is rubin.moe's Triton kernel slower on a Hugging Face model's own expert parameters than on other
tensors? 8 Qwen3-30B-A3B layers' experts, T = 1, one CUDA graph of 8 calls (one per layer, so the weights
are cold), timed by tune_moe.time_graph (median per call; the logged runs used a local copy of that loop):
the model's parameters; with hidden states strided as Inductor passes them
at T = 1 (stride (0, 1)); fresh copies; 2 layers' or 1 layer's parameters in turn; with PDL; with float32
top-k weights; random weights as the kernel benchmark draws them. (Run on the H200 on 2026-11-29: every
case took 70-74 us, so the tensors were not the cause; the kernel was -- a regression, found by bisecting,
benchmarks/results/moe-regression-bisect-h200.log.)

    PYTHONPATH=. python benchmarks/moe_in_model_probe.py
"""

import statistics
import sys

import torch

sys.path.insert(0, "benchmarks")
from decode_step import build_model  # noqa: E402

from rubin_compile.kernels.triton import moe as tmoe  # noqa: E402
from rubin_compile.kernels.triton.tune_moe import time_graph  # noqa: E402


model, cfg = build_model(8, 4096)
experts = [layer.mlp.experts for layer in model.model.layers]
print(
    "param",
    tuple(experts[0].gate_up_proj.shape),
    experts[0].gate_up_proj.stride(),
    experts[0].gate_up_proj.dtype,
    experts[0].gate_up_proj.data_ptr() % 256,
    flush=True,
)
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn((1, 2048), device="cuda", dtype=torch.bfloat16, generator=g)
x_strided = x[0].as_strided((1, 2048), (0, 1))
ids = [torch.randperm(128, device="cuda", generator=g)[:8].view(1, 8) for _ in experts]
tw = torch.full((1, 8), 0.125, device="cuda", dtype=torch.bfloat16)
fresh = [(e.gate_up_proj.detach().clone(), e.down_proj.detach().clone()) for e in experts]
rnd = [
    (
        (torch.randn((128, 1536, 2048), device="cuda") / 2048**0.5).bfloat16(),
        (torch.randn((128, 2048, 768), device="cuda") / 768**0.5).bfloat16(),
    )
    for _ in range(2)
]
cases = {
    "model params": [
        lambda e=e, i=i: tmoe.fused_moe(x, e.gate_up_proj, e.down_proj, tw, i) for e, i in zip(experts, ids)
    ],
    "model params, x stride (0,1)": [
        lambda e=e, i=i: tmoe.fused_moe(x_strided, e.gate_up_proj, e.down_proj, tw, i) for e, i in zip(experts, ids)
    ],
    "fresh copies": [lambda w=w, i=i: tmoe.fused_moe(x, w[0], w[1], tw, i) for w, i in zip(fresh, ids)],
    "2 layers' params in turn (the kernel benchmark's footprint)": [
        lambda e=experts[n % 2], i=i: tmoe.fused_moe(x, e.gate_up_proj, e.down_proj, tw, i) for n, i in enumerate(ids)
    ],
    "1 layer's params": [lambda e=experts[0], i=i: tmoe.fused_moe(x, e.gate_up_proj, e.down_proj, tw, i) for i in ids],
    "model params, pdl=True": [
        lambda e=e, i=i: tmoe.fused_moe(x, e.gate_up_proj, e.down_proj, tw, i, pdl=True) for e, i in zip(experts, ids)
    ],
    "model params, float32 top-k weights": [
        lambda e=e, i=i: tmoe.fused_moe(x, e.gate_up_proj, e.down_proj, tw.float(), i) for e, i in zip(experts, ids)
    ],
    "randn weights (the kernel benchmark's)": [
        lambda w=w, i=i: tmoe.fused_moe(x, w[0], w[1], tw, i) for w, i in zip(rnd, ids)
    ],
}
with torch.no_grad():
    for name, calls in cases.items():
        us = statistics.median(time_graph(calls))
        print(f"{name}: {us:.1f} us per MoE call (T=1, 8 experts, 75.5 MB; 18 us at 4.2 TB/s)", flush=True)
