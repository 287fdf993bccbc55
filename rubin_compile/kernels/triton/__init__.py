"""The ``triton`` kernels: our fused MoE Triton kernels (moe.py; design in docs/kernels/triton_moe.md).

This module only registers them onto ``rubin.moe``: Triton is imported when a kernel runs, so the package
imports (and plans for any target) without Triton or a GPU. On a machine without CUDA the kernel is
"cannot run here" with the reason; with ``TRITON_INTERPRET=1`` the kernels run (slowly) on CPU tensors
through Triton's interpreter, which the CPU tests use to check indexing.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

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
        return "the Triton MoE kernels need the 'triton' package, which is not installed"
    # The kernels run on the device itself, whatever target this machine is taken for.
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return (
            "the Triton MoE kernels need a CUDA GPU and torch.cuda.is_available() is False "
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
