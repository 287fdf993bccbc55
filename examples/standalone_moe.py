"""A small MoE decoder in plain PyTorch, compiled with ``backend="rubin"``.

Runs on a CPU in well under a minute: builds a 2-layer model (attention + a loop over experts), compiles
it with the rubin backend writing dumps, checks the output (float32: against eager PyTorch; bfloat16: against
Inductor alone, as the tests do, since Inductor's own bf16 roundings already differ from eager's), and prints
the rewrite table (the same as ``python -m rubin_compile explain DIR``).

    python examples/standalone_moe.py [--dump-dir DIR] [--dtype bfloat16]

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
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    # options={...} win over RUBIN_* variables: pass dump_dir only when the environment does not name one.
    dump_dir = args.dump_dir or os.environ.get("RUBIN_DUMP_DIR") or tempfile.mkdtemp(prefix="rubin-dumps-")
    options = {} if dump_dir == os.environ.get("RUBIN_DUMP_DIR") else {"dump_dir": dump_dir}

    torch.manual_seed(0)
    model = TinyMoEModel().to(dtype).eval()
    tokens = torch.randint(0, 512, (2, 16))
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
