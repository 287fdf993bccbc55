"""The gated activations the MoE kernels apply in their FC1 epilogue (``act(gate) * up``), shared by the decode
kernels (moe.py) and the persistent prefill path (moe_prefill.py), so both round alike: plain exp-based forms, no
libdevice call, so they also run under Triton's interpreter."""

from __future__ import annotations

import triton
import triton.language as tl

CODES = {"silu": 0, "gelu_tanh": 1}  # rubin.moe activation -> the kernels' ACT (kernels/triton/__init__.py)


@triton.jit
def silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def gelu_tanh(x):
    # tanh(u) = 2 * sigmoid(2u) - 1
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * u)) - 1.0))


@triton.jit
def gated(x, ACT: tl.constexpr):
    """The activation ``ACT`` (a ``CODES`` value) of ``x``."""
    if ACT == 0:
        return silu(x)
    return gelu_tanh(x)
