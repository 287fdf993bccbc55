"""The ``triton`` kernels: our fused MoE Triton kernels (moe.py; design in docs/kernels/triton_moe.md), the
split-KV decode attention (attention.py; design and measurements in docs/kernels/decode_attention.md), the
small-M weight-streaming GEMM (gemm.py; docs/kernels/gemm.md) and the fused MoE routing at decode (route.py;
docs/kernels/routing.md).

This module only registers them onto ``rubin.moe``, ``rubin.attention``, ``rubin.gemm`` and ``rubin.route``: Triton is imported when a kernel runs, so the package
imports (and plans for any target) without Triton or a GPU. On a machine without CUDA the kernel is
"cannot run here" with the reason; with ``TRITON_INTERPRET=1`` the kernels run (slowly) on CPU tensors
through Triton's interpreter, which the CPU tests use to check indexing.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch
import torch._inductor.config  # noqa: F401  (read by the GEMM's selection: max-autotune changes the rival)

from rubin_compile.ops.attention import ATTENTION, SINKS, AttentionArgs, reference
from rubin_compile.ops.gemm import GEMM, GemmArgs
from rubin_compile.kernels.triton import moe_choice
from rubin_compile.ops.moe import MOE, MoEArgs, aten, aten_unsupported
from rubin_compile.ops.registry import QUANT_LABELS, KernelSpec, Launch
from rubin_compile.ops.route import ROUTE, RouteArgs
from rubin_compile import target as target_mod
from rubin_compile.target import Target

_MOE_ACTS = ("bfloat16", "float16")
MOE_ACTIVATIONS = ("silu", "gelu_tanh")  # the FC1 epilogues of kernels/triton/moe.py (its ACT 0 and 1)


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
    if spec.quant == "fp8_block" and spec.block_shape and int(spec.block_shape[-1]) % 16:
        return f"FP8 scale blocks {spec.block_shape[-1]} wide along K: the kernels' K tiles are multiples of 16"
    if spec.activation not in (None,) + MOE_ACTIVATIONS:
        return f"activation {spec.activation} is not implemented in the Triton MoE ({', '.join(MOE_ACTIVATIONS)})"
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


def _plan_device_name(target: Target) -> str:
    """The name of this machine's GPU when a plan is made for it (its measured tables apply), else "" (a plan
    for a GPU this machine lacks follows the rules off the tables)."""
    here = target_mod.detect()
    if here.name == target.name and torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).name
    return ""


def _moe_entry(spec: KernelSpec) -> str:
    """What runs a node bound to our MoE kernels, with the per-call-size choice against its baseline (what runs
    the node without rubin; moe_choice.py): for a static T the decision and its source, else the policy."""
    base = "rubin_compile.kernels.triton.moe.fused_moe"
    weight_dtype = getattr(torch, spec.weight_dtype, None)
    if not spec.baseline or None in (spec.dim("E"), spec.dim("H"), spec.dim("I"), spec.dim("k"), weight_dtype):
        return base
    E, H, I, k, T = (spec.dim(n) for n in ("E", "H", "I", "k", "T"))
    wfmt = moe_choice.weight_format(weight_dtype, spec.quant == "fp8_block")
    name = _plan_device_name(target_mod.resolve("sm90"))
    if T is None:
        return (
            f"{base}; per call by T against {spec.baseline}: {moe_choice.policy(E, H, I, k, wfmt, name, spec.baseline)}"
        )
    choice = moe_choice.choose(T, E, H, I, k, wfmt, name, spec.baseline)
    runs = base if choice.kernel == "triton" else moe_choice.BASELINES[spec.baseline]
    return f"{runs}; T={T} against {spec.baseline}: {choice.describe()}"


# Priorities mirror vLLM's MoE backend order (vllm/model_executor/layers/fused_moe/oracle/): on Blackwell
# FlashInfer first and Triton after it; on Hopper Triton first (docs/kernels/selection.md).
@MOE.register_kernel(
    "triton",
    supports=_moe_supports,
    priority={"*": 10, "sm90": 30},
    runnable=_runnable,
    entry=_moe_entry,
    pdl=lambda spec: None,
    placements=("split_n",),
    in_graph=True,
)
def triton_moe(args: MoEArgs, launch: Launch) -> torch.Tensor:
    """The fused Triton MoE (kernels/triton/moe.py: ``run``), or, for a call of a size at which rubin.moe's ATen form
    measured faster on this GPU (moe_choice.py), that form."""
    if aten_unsupported(args) is None:
        name = moe_choice.device_name(args.hidden_states.device)
        wfmt = moe_choice.weight_format(args.w13.dtype, args.block_shape is not None)
        if moe_choice.choose(args.T, args.E, args.H, args.I, args.k, wfmt, name, "aten").kernel == "aten":
            return aten(args)
    # Imported here, not at the top: registering the kernel must need neither Triton nor a GPU.
    from rubin_compile.kernels.triton import moe

    return moe.run(args, launch)


# ------------------------------------------------------------------------------------------------
# MoE routing at decode
# ------------------------------------------------------------------------------------------------

# route.MAX_T / MAX_E / MAX_H / MAX_K (not imported: that would import Triton)
ROUTE_MAX_T, ROUTE_MAX_E, ROUTE_MAX_H, ROUTE_MAX_K = 64, 512, 8192, 16
_ROUTE_DTYPES = ("bfloat16", "float16", "float32")


def _route_supports(target: Target, spec: KernelSpec) -> Optional[str]:
    """The fused routing (kernels/triton/route.py): router GEMM, scoring, (group-limited) top-k, renormalisation
    and scaling in two PDL-chained kernels, for up to 64 tokens a call; bf16 / fp16 / fp32 router weights."""
    if not target.is_cuda:
        return f"target {target.name} has no CUDA GPU (Inductor compiles the routing as written)"
    if target.cc < 90:
        return f"the Triton routing is built and measured for sm_90 and newer; {target.name} is cc {target.cc}"
    if spec.quant != "none":
        return f"router weights in {QUANT_LABELS[spec.quant]}: checkpoints keep the router unquantised (bf16 / fp32)"
    for name, dtype in (("hidden states", spec.act_dtype), ("router weight", spec.weight_dtype)):
        if dtype not in _ROUTE_DTYPES:
            return f"{name} in {dtype} are not supported ({', '.join(_ROUTE_DTYPES)})"
    T, E, H, k = spec.dim("T"), spec.dim("E"), spec.dim("H"), spec.dim("k")
    if T is not None and T > ROUTE_MAX_T:
        return f"T={T} tokens: not decode-sized (the kernel takes up to {ROUTE_MAX_T}); Inductor's routing is kept"
    for name, v, limit in (("E", E, ROUTE_MAX_E), ("H", H, ROUTE_MAX_H), ("k", k, ROUTE_MAX_K)):
        if v is not None and v > limit:
            return f"{name}={v} exceeds the kernel's limit of {limit}"
    if importlib.util.find_spec("triton") is None:
        return "package triton is not installed"
    return None


@ROUTE.register_kernel(
    "triton",
    supports=_route_supports,
    priority={"*": 10, "sm90": 30},
    runnable=_runnable,
    entry=lambda spec: "rubin_compile.kernels.triton.route.run (router GEMM + top-k, two kernels)",
    pdl=lambda spec: None,
    in_graph=True,
)
def triton_route(args: RouteArgs, launch: Launch) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused routing (kernels/triton/route.py: ``run``); a call of more than 64 tokens (a graph compiled with a
    symbolic T, run at prefill) runs the op's reference."""
    from rubin_compile.kernels.triton import route

    return route.run(args, pdl=launch.pdl)


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


# The split-KV kernels are PDL-safe (attention.run(args, Launch(pdl=True)): the split kernel waits before it reads
# the query, the mask or anything an earlier kernel writes, and before it writes; tests/gpu/test_decode_attention.py
# checks PDL bitwise equal under graph replay), but selection does not launch them so: in the decode step it did not
# pay (docs/kernels/decode_attention.md "PDL"). Inside the call the combine is still PDL-chained to the split kernel
# (attention.Config.pdl_combine).
ATTENTION_PDL_DECLINED = (
    "measured on the H200, the decode attention launched with PDL was no faster in a decode step (Qwen3-30B-A3B "
    "dims, 8 layers, one CUDA graph: 565 vs 561 us at 4k) and slower at 16k (671 vs 641 us): launched without it"
)


@ATTENTION.register_kernel(
    "triton",
    supports=_attention_supports,
    priority={"*": 10, "sm90": 32},
    runnable=_runnable,
    entry=lambda spec: "rubin_compile.kernels.triton.attention.run (split-KV decode)",
    pdl=lambda spec: ATTENTION_PDL_DECLINED,
    in_graph=True,
    features=(SINKS,),
)
def triton_attention(args: AttentionArgs, launch: Launch) -> torch.Tensor:
    """The split-KV decode attention (kernels/triton/attention.py: ``run``); a call with more query rows than
    the kernel holds (a graph compiled with a symbolic query length, run at prefill) runs the op's ATen form."""
    from rubin_compile.kernels.triton import attention

    if args.S > attention.MAX_QUERIES or args.S * (args.Hq // args.Hkv) > attention.MAX_ROWS:
        return reference(args)
    return attention.run(args, launch)


# ------------------------------------------------------------------------------------------------
# small-M GEMM
# ------------------------------------------------------------------------------------------------

GEMM_MAX_M = 64  # gemm.MAX_M (not imported: that would import Triton)
_GEMM_QUANTS = ("none", "fp8_tensor", "fp8_rowwise", "fp8_block")
_GEMM_ACTS = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")


def _gemm_wfmt(spec: KernelSpec) -> str:
    """The tuned table's weight-format word for ``spec`` (gemm.weight_format for a call)."""
    if spec.quant == "none":
        return {"bfloat16": "bf16", "float16": "fp16"}.get(spec.act_dtype, spec.act_dtype)
    kind = {"fp8_tensor": "tensor", "fp8_rowwise": "column", "fp8_block": "block"}[spec.quant]
    return f"fp8_{kind}" + ("_a8" if spec.act_dtype.startswith("float8") else "")


def _gemm_choice(target: Target, spec: KernelSpec):
    """gemm.choose for a static-M spec, with the tuned table of this machine's GPU when the plan is for it."""
    from rubin_compile.kernels.triton import gemm

    M, N, K = spec.dim("M"), spec.dim("N"), spec.dim("K")
    here = target_mod.detect()
    name, sms = ("", 132)
    if here.name == target.name and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        name, sms = props.name, props.multi_processor_count
    inductor = torch._inductor.config  # a max-autotune compile gives the lowered node Inductor's own GEMMs
    max_autotune = bool(inductor.max_autotune or inductor.max_autotune_gemm)
    return gemm.choose(M, N, K, _gemm_wfmt(spec), name, sms, max_autotune=max_autotune)


def _gemm_supports(target: Target, spec: KernelSpec) -> Optional[str]:
    """Our weight-streaming GEMM: ``M <= 64`` (any M for weight-only FP8, whose alternative is the float32
    dequantise-and-multiply), bf16 / fp16 (or FP8 W8A8) activations, bf16 / fp16 or FP8 per-tensor / per-column /
    128 x 128 block weights; measured on sm_90 only, so offered there alone, and only where the tuned table
    (or, off the table, ``gemm.choose``'s rule) says it beats cuBLAS at this M."""
    if not target.is_cuda:
        return f"target {target.name} has no CUDA GPU"
    if target.cc != 90:
        return f"the Triton GEMM is tuned and measured on sm_90 only; on {target.name} cuBLAS runs it"
    if spec.quant not in _GEMM_QUANTS:
        return f"{QUANT_LABELS[spec.quant]} weights are not supported (bf16 / fp16, FP8 per-tensor, column, block)"
    if spec.act_dtype not in _GEMM_ACTS:
        return f"activations in {spec.act_dtype} are not supported ({', '.join(_GEMM_ACTS)})"
    N, K, M = spec.dim("N"), spec.dim("K"), spec.dim("M")
    if N is None or K is None:
        return "N and K are not static (the weight's shape)"
    if M is None:
        return None  # symbolic M: the adapter decides per call (ours where the table says it wins)
    if M > GEMM_MAX_M and not (spec.quant != "none" and spec.act_dtype in ("bfloat16", "float16")):
        return f"M={M} > {GEMM_MAX_M}: not a decode-sized GEMM (cuBLAS runs it)"
    if importlib.util.find_spec("triton") is None:
        return "package triton is not installed"
    choice = _gemm_choice(target, spec)
    if choice.kernel == "triton":
        return None
    if choice.source == "heuristic":
        return (
            f"no tuned entry for N={N}, K={K}, {_gemm_wfmt(spec)} in this GPU's table (or no GPU here to read it "
            "from): off the table, bf16 / fp16 GEMMs stay on cuBLAS (docs/kernels/gemm.md)"
        )
    return f"cuBLAS is faster here: {choice.describe()}"


def _gemm_entry(spec: KernelSpec) -> str:
    base = "rubin_compile.kernels.triton.gemm.run"
    M = spec.dim("M")
    if M is None:
        return f"{base} (symbolic M: ours or cuBLAS per call, by the tuned table)"
    try:
        choice = _gemm_choice(target_mod.resolve("sm90"), spec)
    except Exception as exc:  # the entry is informative only: never fail selection over it
        return f"{base} ({type(exc).__name__})"
    margin = f", {choice.margin:.2f}x cuBLAS" if choice.margin else ""
    return f"{base} {choice.describe()}{margin}"


def _gemm_graphs_only(spec: KernelSpec) -> Optional[str]:
    """bf16 / fp16 and W8A8 GEMMs take ours only under CUDA graphs: per call our adapter costs an estimated few tens of
    microseconds of Python (the op's dispatch, the argument checks, the table lookup, Triton's launcher) where
    Inductor's call of cuBLAS costs a few, and a decode GEMM saves 0.1-4 us on the GPU (docs/kernels/gemm.md). Weight-only FP8 takes ours anyway:
    its alternative dequantises the whole weight in float32 on every call."""
    if spec.quant != "none" and spec.act_dtype in ("bfloat16", "float16"):
        return None
    return "the Triton GEMM's host cost per call exceeds what it saves on the GPU without them (cuBLAS runs it)"


@GEMM.register_kernel(
    "triton",
    supports=_gemm_supports,
    priority={"*": 10, "sm90": 35},
    runnable=_runnable,
    entry=_gemm_entry,
    pdl=lambda spec: None,
    graphs_only=_gemm_graphs_only,
)
def triton_gemm(args: GemmArgs, launch: Launch) -> torch.Tensor:
    """The weight-streaming GEMM (kernels/triton/gemm.py: ``run``): ours or cuBLAS per call, by the table."""
    from rubin_compile.kernels.triton import gemm

    return gemm.run(args, launch)
