"""A small MoE decoder in plain PyTorch, compiled with ``backend="rubin"``.

Runs on a CPU in well under a minute: builds a 2-layer model (attention + a loop over experts), compiles
it with the rubin backend writing dumps, checks the output (float32: against eager PyTorch; bfloat16: against
Inductor alone, as the tests do, since Inductor's own bf16 roundings already differ from eager's), and prints
the rewrite table (the same as ``python -m rubin_compile explain DIR``).

    python examples/standalone_moe.py [--dump-dir DIR] [--dtype bfloat16] [--weights nvfp4]

``--weights fp8_block | fp8_tensor | nvfp4 | mxfp4`` stores the experts and the attention projections quantised,
as a quantised checkpoint does (the values and their scales, calibrated static input scales), dequantised in the
forward by ``rubin_compile.dequantize``: rubin folds that into ``rubin.gemm`` / ``rubin.moe`` with the quantised
weights, so a plan for a GPU (``RUBIN_TARGET=sm107``) shows the FP8 / NVFP4 / MXFP4 kernels it would run. On the
CPU the comparison is against the same quantised model run eagerly.

Dumps go to ``--dump-dir``, else to ``RUBIN_DUMP_DIR`` when it is set, else to a temporary folder.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

import rubin_compile  # noqa: F401  (only needed for explain below; backend="rubin" works without it)
from rubin_compile.debug.explain import explain
from rubin_compile import KernelUnavailableError
from rubin_compile.ops.quantized import quantize_weight, shared_global_scale

FORMATS = ("fp8_block", "fp8_tensor", "nvfp4", "mxfp4")
_INPUT_RANGE = {"fp8_tensor": 448.0, "nvfp4": 448.0 * 6.0}  # static input scale = amax / this (ModelOpt)


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, inter, bias=False)
        self.up = nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class SparseMoE(nn.Module):
    """Softmax router, top-k, renormalised; every expert evaluated densely and masked (compile-friendly)."""

    def __init__(self, hidden: int, inter: int, experts: int, k: int) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, inter) for _ in range(experts))
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, ids = torch.topk(self.router(x).softmax(-1, dtype=torch.float32), self.k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + (w * (ids == e)).sum(-1, keepdim=True) * expert(x)
        return out.reshape(shape)


class QuantLinear(nn.Module):
    """A bias-free linear layer whose weight is stored quantised (``quantize_weight``'s buffers) and dequantised
    in the forward with ``torch.ops.rubin.dequantize``; the quantised tensors may be shared with a sibling (an
    expert's gate and up share one NVFP4 global / FP8 per-tensor scale and one input scale)."""

    def __init__(self, parts: dict, fmt: str, dtype: torch.dtype, input_scale=None) -> None:
        super().__init__()
        self.fmt, self.dtype = fmt, dtype
        self.register_buffer("weight", parts["weight"])
        self.register_buffer("scale", parts["scale"])
        self.register_buffer("scale_2", parts.get("scale_2"))
        self.register_buffer("input_scale", input_scale)

    def dequantized(self) -> torch.Tensor:
        return torch.ops.rubin.dequantize(
            self.weight, self.scale, self.scale_2, self.input_scale, format=self.fmt, dtype=self.dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized())


class QuantExpert(nn.Module):
    """An expert with quantised gate / up / down. Gate and up share their per-tensor or global scale and their input
    scale (``scale`` / ``scale_2`` / ``input_scale`` held here, once): rubin.moe has one of each per expert for
    its fused gate-up weight."""

    def __init__(self, expert: Expert, fmt: str, amax_in: dict) -> None:
        super().__init__()
        self.fmt, dtype = fmt, expert.gate.weight.dtype
        self.dtype = dtype
        g, u = expert.gate.weight.detach(), expert.up.weight.detach()
        shared = None
        if fmt == "nvfp4":
            shared = shared_global_scale(g, u)
        if fmt == "fp8_tensor":  # one scale over both
            both = quantize_weight(torch.cat([g, u]), fmt)
            gate = {"weight": both["weight"][: g.shape[0]].contiguous(), "scale": both["scale"]}
            up = {"weight": both["weight"][g.shape[0] :].contiguous(), "scale": both["scale"]}
        else:
            gate, up = quantize_weight(g, fmt, shared), quantize_weight(u, fmt, shared)
        for name, parts in (("gate", gate), ("up", up)):
            self.register_buffer(f"{name}_w", parts["weight"])
            self.register_buffer(f"{name}_s", parts["scale"] if fmt not in ("fp8_tensor",) or name == "gate" else None)
        self.register_buffer("scale_2", shared)
        rng = _INPUT_RANGE.get(fmt)
        self.register_buffer("input_scale", (amax_in["gate"] / rng).reshape(()) if rng else None)
        down_scale = (amax_in["down"] / rng).reshape(()) if rng else None
        self.down = QuantLinear(quantize_weight(expert.down.weight.detach(), fmt), fmt, dtype, down_scale)

    def _w(self, name: str) -> torch.Tensor:
        scale = self.gate_s if self.fmt == "fp8_tensor" else getattr(self, f"{name}_s")
        return torch.ops.rubin.dequantize(
            getattr(self, f"{name}_w"), scale, self.scale_2, self.input_scale, format=self.fmt, dtype=self.dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(F.linear(x, self._w("gate"))) * F.linear(x, self._w("up")))


def quantize_model(model: nn.Module, fmt: str, tokens: torch.Tensor) -> nn.Module:
    """Replace the experts and the attention projections with quantised ones, as a quantised checkpoint holds them;
    the static input scales are calibrated on ``tokens`` (each layer's input amax), as ModelOpt does."""
    amax: dict[nn.Module, torch.Tensor] = {}
    hooks = []
    for m in model.modules():
        if isinstance(m, nn.Linear):
            hooks.append(
                m.register_forward_pre_hook(lambda mod, inp: amax.__setitem__(mod, inp[0].float().abs().amax()))
            )
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    rng = _INPUT_RANGE.get(fmt)
    with torch.no_grad():
        for layer in model.layers:
            for name in ("qkv", "o"):
                lin = getattr(layer, name)
                scale = (amax[lin] / rng).reshape(()) if rng else None
                setattr(
                    layer, name, QuantLinear(quantize_weight(lin.weight.detach(), fmt), fmt, lin.weight.dtype, scale)
                )
            experts = layer.moe.experts
            for e, ex in enumerate(experts):
                experts[e] = QuantExpert(ex, fmt, {"gate": amax[ex.gate], "down": amax[ex.down]})
    return model


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, inter: int, experts: int, k: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.moe = SparseMoE(hidden, inter, experts, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.o(attn)
        return x + self.moe(self.norm2(x))


class TinyMoEModel(nn.Module):
    def __init__(self, vocab=512, hidden=128, heads=4, inter=96, experts=8, k=2, layers=2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(hidden, heads, inter, experts, k) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dump-dir", default=None, help="where to write dumps (default: RUBIN_DUMP_DIR, else a temporary folder)"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--weights",
        default="unquantized",
        choices=["unquantized", *FORMATS],
        help="store the experts and attention projections quantised (see the module docstring)",
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    # options={...} win over RUBIN_* variables: pass dump_dir only when the environment does not name one.
    dump_dir = args.dump_dir or os.environ.get("RUBIN_DUMP_DIR") or tempfile.mkdtemp(prefix="rubin-dumps-")
    options = {} if dump_dir == os.environ.get("RUBIN_DUMP_DIR") else {"dump_dir": dump_dir}

    torch.manual_seed(0)
    # Quantised weights: an intermediate size that FP8 128 x 128 blocks and the Blackwell / Rubin MoE kernels
    # (I a multiple of 128) take.
    model = TinyMoEModel(inter=96 if args.weights == "unquantized" else 128).to(dtype).eval()
    tokens = torch.randint(0, 512, (2, 16))
    if args.weights != "unquantized":
        model = quantize_model(model, args.weights, tokens)
    compiled = torch.compile(model, backend="rubin", options=options)
    try:
        with torch.no_grad():
            got = compiled(tokens)
            if dtype == torch.float32:
                what, want = "eager", model(tokens)
            else:
                what, want = "Inductor alone", torch.compile(model, backend="inductor")(tokens)
        err = (got.float() - want.float()).abs().max().item()
        scale = want.float().abs().max().item()
        print(
            f"compiled with rubin vs {what} ({args.dtype}): max |diff| = {err:.3g} = {err / scale:.2g} of the "
            f"logits' scale {scale:.3g}"
        )
    except KernelUnavailableError as exc:  # a plan for another GPU (RUBIN_TARGET=sm107): shown, not run
        print(f"the plan cannot run on this machine:\n  {exc}")
    print(f"dumps written to {dump_dir}\n")
    explain(dump_dir, sys.stdout, only_changed=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
