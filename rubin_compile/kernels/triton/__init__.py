"""The ``triton`` kernels: our fused MoE Triton kernels (moe.py; design in docs/kernels/triton_moe.md) and the
split-KV decode attention (attention.py; design and measurements in docs/kernels/decode_attention.md).

This module only registers them onto ``rubin.moe`` and ``rubin.attention``: Triton is imported when a kernel runs, so the package
imports (and plans for any target) without Triton or a GPU. On a machine without CUDA the kernel is
"cannot run here" with the reason; with ``TRITON_INTERPRET=1`` the kernels run (slowly) on CPU tensors
through Triton's interpreter, which the CPU tests use to check indexing.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

from rubin_compile.ops.attention import ATTENTION, AttentionArgs, reference
from rubin_compile.ops.moe import MOE, MoEArgs
from rubin_compile.ops.registry import QUANT_LABELS, KernelSpec, Launch
from rubin_compile.target import Target

_MOE_ACTS = ("bfloat16", "float16")


def _moe_supports(target: Target, spec: KernelSpec) -> Optional[str]:
    """Our fused Triton MoE: BF16 / FP16 activations; unquantised, FP8 per-tensor (or per-expert) and FP8
    block-scaled weights; sm_90 and newer (PDL, TMA-era tensor cores)."""
    if not target.is_cuda:
        return f"target {target.name} has no CUDA GPU"
    if target.cc < 90:
        return f"the Triton MoE kernels are built for sm_90 and newer; {target.name} is cc {target.cc}"
    if spec.quant not in ("none", "fp8_tensor", "fp8_block"):
        return f"{QUANT_LABELS[spec.quant]} weights are not supported (bf16 / fp16, FP8 per-tensor or block)"
    if spec.act_dtype not in _MOE_ACTS:
        return f"activations in {spec.act_dtype} are not supported (bf16 / fp16)"
    if importlib.util.find_spec("triton") is None:
        return "package triton is not installed"
    return None


def _runnable(here: Target) -> Optional[str]:
    if importlib.util.find_spec("triton") is None:
        return "the Triton kernels need the 'triton' package, which is not installed"
    # The kernels run on the device itself, whatever target this machine is taken for.
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return (
            "the Triton kernels need a CUDA GPU and torch.cuda.is_available() is False "
            "(set TRITON_INTERPRET=1 only to run them slowly on the CPU for tests)"
        )
    return None


# Priorities mirror vLLM's MoE backend order (vllm/model_executor/layers/fused_moe/oracle/): on Blackwell
# FlashInfer first and Triton after it; on Hopper Triton first (docs/kernels/selection.md).
@MOE.register_kernel(
    "triton",
    supports=_moe_supports,
    priority={"*": 10, "sm90": 30},
    runnable=_runnable,
    entry=lambda spec: "rubin_compile.kernels.triton.moe.fused_moe",
    pdl=lambda spec: None,
    placements=("split_n",),
)
def triton_moe(args: MoEArgs, launch: Launch) -> torch.Tensor:
    """The fused Triton MoE (kernels/triton/moe.py: ``run``)."""
    # Imported here, not at the top: registering the kernel must need neither Triton nor a GPU.
    from rubin_compile.kernels.triton import moe

    return moe.run(args, launch)


# ------------------------------------------------------------------------------------------------
# decode attention
# ------------------------------------------------------------------------------------------------

_ATTN_ACTS = ("bfloat16", "float16", "float32")
DECODE_MAX_ROWS = 64  # attention.MAX_ROWS (not imported: that would import Triton)
DECODE_MAX_QUERIES = (
    4  # attention.MAX_QUERIES: decode and short verification, what benchmarks/decode_attention.py measures
)
_ATTN_REGISTERS = 64 * 128  # rows x head dim of the fp32 accumulator one program holds


def _attention_supports(target: Target, spec: KernelSpec) -> Optional[str]:
    """The split-KV decode kernel: up to 4 query positions (and ``S * Hq / Hkv <= 64`` rows per KV head) over any
    key length; bf16 / fp16 / fp32, or an FP8 KV cache with bf16 / fp16 queries; head dims up to 256."""
    if not target.is_cuda:
        return f"target {target.name} has no CUDA GPU"
    if target.cc < 90:
        return f"the Triton decode attention is built and measured for sm_90 and newer; {target.name} is cc {target.cc}"
    if spec.quant not in ("none", "fp8_tensor"):
        return f"a {QUANT_LABELS[spec.quant]} KV cache is not supported (the query's dtype, or FP8 per-tensor)"
    if spec.act_dtype not in _ATTN_ACTS:
        return f"queries in {spec.act_dtype} are not supported ({', '.join(_ATTN_ACTS)})"
    S, Hq, Hkv = spec.dim("S"), spec.dim("Hq"), spec.dim("Hkv")
    if Hq is None or Hkv is None:
        return "the head counts are not static"
    D, Dv = spec.dim("D") or 0, spec.dim("Dv") or spec.dim("D") or 0
    if not 0 < max(D, Dv) <= 256:
        return f"head dim {max(D, Dv)} is not in 1..256"
    if S is None:
        return None  # symbolic query length: the adapter checks each call (prefill-sized calls run SDPA)
    if S > DECODE_MAX_QUERIES:
        return f"{S} query positions: prefill, not decode (the kernel takes up to {DECODE_MAX_QUERIES}; SDPA runs it)"
    rows = S * (Hq // Hkv)
    if rows > DECODE_MAX_ROWS:
        return (
            f"{S} query positions x {Hq // Hkv} query heads per KV head = {rows} rows > {DECODE_MAX_ROWS}: "
            "prefill, not decode (SDPA runs it)"
        )
    padded = max(16, 1 << (rows - 1).bit_length())
    width = max(16, 1 << (max(D, Dv) - 1).bit_length())
    if padded * width > _ATTN_REGISTERS:
        return f"{rows} rows x head dim {max(D, Dv)} exceed one program's accumulator ({_ATTN_REGISTERS} fp32)"
    return None


@ATTENTION.register_kernel(
    "triton",
    supports=_attention_supports,
    priority={"*": 10, "sm90": 32},
    runnable=_runnable,
    entry=lambda spec: "rubin_compile.kernels.triton.attention.run (split-KV decode)",
)
def triton_attention(args: AttentionArgs, launch: Launch) -> torch.Tensor:
    """The split-KV decode attention (kernels/triton/attention.py: ``run``); a call with more query rows than
    the kernel holds (a graph compiled with a symbolic query length, run at prefill) runs the op's ATen form."""
    from rubin_compile.kernels.triton import attention

    if args.S > attention.MAX_QUERIES or args.S * (args.Hq // args.Hkv) > attention.MAX_ROWS:
        return reference(args)
    return attention.run(args, launch)
