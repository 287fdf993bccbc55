"""The canonical mixture-of-experts op, ``torch.ops.rubin.moe``.

Every MoE idiom the matchers recognise (vLLM's CPU and GPU ops, Hugging Face grouped-mm experts, a plain
loop over experts) is rewritten into this one functional op; kernel selection then binds it to a kernel.
Its reference implementation below *is* the semantics.

Schema::

    rubin::moe(Tensor hidden_states,      # [T, H]   bf16 / fp16 / fp32
               Tensor w13,                # [E, 2I, H] gate rows [0, I) then up rows [I, 2I) (vLLM layout)
               Tensor w2,                 # [E, H, I]
               Tensor topk_weights,       # [T, k]   any float dtype; used as float32
               Tensor topk_ids,           # [T, k]   int32 / int64, values in [0, E)
               str activation="silu",     # "silu": silu(gate) * up;  "gelu_tanh": gelu_tanh(gate) * up
               Tensor? w13_bias=None,     # [E, 2I]
               Tensor? w2_bias=None,      # [E, H]
               Tensor? w13_scale=None,    # FP8 (e4m3) weights only, see below
               Tensor? w2_scale=None,
               int[]? block_shape=None,   # [bn, bk] for block-scaled FP8, e.g. [128, 128]
               str impl="reference",      # which kernel runs it; chosen by select_kernels
               str weight_layout="plain", # how w13 / w2 are stored, see below
               bool pdl=False,            # launch with Programmatic Dependent Launch; set by chain_pdl
               str placement="")          # "" or "split_n:<mode>:<domains>:<max_tokens>"; set by place_locality
      -> Tensor                           # [T, H] in hidden_states' dtype

Semantics, for every token t::

    out[t] = sum_j topk_weights[t, j] * FFN_{e}(hidden_states[t]),   e = topk_ids[t, j]
    FFN_e(x) = (act(x @ w13[e, :I].T + b13[e, :I]) * (x @ w13[e, I:].T + b13[e, I:])) @ w2[e].T + b2[e]

The top-k weights are applied after FC2 (as vLLM and Hugging Face do). If an expert id appears twice in
a token's row, both slots contribute. FP8 weights are dequantised before use: with ``block_shape=None`` a
scale is per tensor (shape ``[]``) or per expert (``[E]``, ``[E, 1]`` or ``[E, 1, 1]``); with
``block_shape=[bn, bk]`` ``w13_scale`` is ``[E, ceil(2I/bn), ceil(H/bk)]`` and ``w2_scale`` is
``[E, ceil(H/bn), ceil(I/bk)]`` (the DeepSeek / Qwen FP8 checkpoint layout). The reference keeps
activations in their own dtype; a kernel that quantises activations states its tolerance.

``pdl`` and ``placement`` say how the kernel is launched, never what it computes: PDL results are
bitwise identical, and a split-N placement (passes/place_locality.py: FC1 split over I, FC2 over H, one
locality domain each) changes no reduction order. Kernels that do not take them run without.

Weight layouts (``weight_layout``; the shapes above hold in every layout, only the order of the elements
inside each expert's matrix differs). A kernel declares the layouts it reads (kernels/registry.py), so a
matcher can hand over weights as the model stores them instead of copying them on every call:

* ``"plain"``: row-major ``[E, N, K]`` as written above.
* ``"vllm_cpu:<isa>"``: what vLLM's CPU build stores after ``_C.prepack_moe_weight(w, isa)``: each
  ``[N, K]`` matrix as ``[N / 16, K, 16]`` (16 output rows interleaved along K; ``unpack_cpu_weight``
  undoes it). ``<isa>`` ("vec", "amx", ...) is the one vLLM packed for and its kernel runs with; the
  matchers check, per shape and dtype, that vLLM's packing for that isa is the 16-row one.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu_tanh")
CPU_PACK_ROWS = 16  # vLLM's CPU MoE weight packing: 16 output rows interleaved along K


def pack_cpu_weight(w: torch.Tensor) -> torch.Tensor:
    """Plain ``[E, N, K]`` -> the ``"vllm_cpu:<isa>"`` layout (what ``_C.prepack_moe_weight`` writes)."""
    E, N, K = w.shape
    return w.reshape(E, N // CPU_PACK_ROWS, CPU_PACK_ROWS, K).permute(0, 1, 3, 2).reshape(E, N, K)


def unpack_cpu_weight(w: torch.Tensor) -> torch.Tensor:
    """The ``"vllm_cpu:<isa>"`` layout -> plain ``[E, N, K]`` (a copy)."""
    E, N, K = w.shape
    return w.reshape(E, N // CPU_PACK_ROWS, K, CPU_PACK_ROWS).permute(0, 1, 3, 2).reshape(E, N, K)


def is_cpu_packed(weight_layout: str) -> bool:
    return weight_layout.startswith("vllm_cpu:")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
FP8_DTYPES = (torch.float8_e4m3fn,)


class MoEArgumentError(ValueError):
    """Raised when the arguments of ``rubin.moe`` do not describe a valid MoE call."""


def check_moe_args(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    w13_bias: Optional[torch.Tensor],
    w2_bias: Optional[torch.Tensor],
    w13_scale: Optional[torch.Tensor],
    w2_scale: Optional[torch.Tensor],
    block_shape: Optional[Sequence[int]],
    weight_layout: str = "plain",
) -> tuple[int, int, int, int, int]:
    """Validate the op's arguments; return (T, H, E, I, k). Errors name the argument and the fix."""

    def fail(msg: str) -> None:
        raise MoEArgumentError(f"rubin.moe: {msg}")

    if weight_layout != "plain" and not (is_cpu_packed(weight_layout) and len(weight_layout) > len("vllm_cpu:")):
        fail(f"weight_layout={weight_layout!r} is not 'plain' or 'vllm_cpu:<isa>'")
    if is_cpu_packed(weight_layout):
        if w13.dim() == 3 and w2.dim() == 3 and (w13.shape[1] % CPU_PACK_ROWS or w2.shape[1] % CPU_PACK_ROWS):
            fail(f"weight_layout {weight_layout!r} packs rows in blocks of {CPU_PACK_ROWS}; w13 {tuple(w13.shape)} "
                 f"and w2 {tuple(w2.shape)} must have N divisible by {CPU_PACK_ROWS}")
        if w13.dtype in FP8_DTYPES or w2.dtype in FP8_DTYPES:
            fail(f"weight_layout {weight_layout!r} is for unquantised weights")
    if activation not in ACTIVATIONS:
        fail(f"activation={activation!r} is not supported; use one of {ACTIVATIONS}")
    if hidden_states.dim() != 2:
        fail(f"hidden_states must be [T, H], got shape {tuple(hidden_states.shape)}")
    if hidden_states.dtype not in FLOAT_DTYPES:
        fail(f"hidden_states dtype {hidden_states.dtype} is not one of bf16 / fp16 / fp32 / fp64")
    T, H = hidden_states.shape
    if w13.dim() != 3 or w2.dim() != 3:
        fail(f"w13 must be [E, 2I, H] and w2 [E, H, I]; got {tuple(w13.shape)} and {tuple(w2.shape)}")
    E, two_i, h13 = w13.shape
    if h13 != H or two_i % 2:
        fail(f"w13 shape {tuple(w13.shape)} does not match [E, 2I, H={H}] with an even 2I")
    inter = two_i // 2
    if tuple(w2.shape) != (E, H, inter):
        fail(f"w2 shape {tuple(w2.shape)} does not match [E={E}, H={H}, I={inter}]")
    quantized = w13.dtype in FP8_DTYPES
    if (w2.dtype in FP8_DTYPES) != quantized:
        fail(f"w13 ({w13.dtype}) and w2 ({w2.dtype}) must both be FP8 or both unquantised")
    if quantized:
        if w13_scale is None or w2_scale is None:
            fail("FP8 weights need w13_scale and w2_scale")
        if block_shape is not None:
            if len(block_shape) != 2 or min(block_shape) <= 0:
                fail(f"block_shape must be [bn, bk] with positive entries, got {list(block_shape)}")
            bn, bk = block_shape
            want13 = (E, -(-two_i // bn), -(-H // bk))
            want2 = (E, -(-H // bn), -(-inter // bk))
            if tuple(w13_scale.shape) != want13 or tuple(w2_scale.shape) != want2:
                fail(
                    f"block scales must be w13_scale {want13} and w2_scale {want2} for block_shape "
                    f"{list(block_shape)}; got {tuple(w13_scale.shape)} and {tuple(w2_scale.shape)}"
                )
        else:
            for name, s in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
                if s.numel() not in (1, E):
                    fail(f"{name} must be per-tensor ([]) or per-expert ([E={E}]); got {tuple(s.shape)}")
    else:
        if w13.dtype != hidden_states.dtype or w2.dtype != hidden_states.dtype:
            fail(
                f"weights ({w13.dtype}, {w2.dtype}) must have hidden_states' dtype {hidden_states.dtype} "
                "(or be FP8 with scales); cast them before the call"
            )
        if w13_scale is not None or w2_scale is not None or block_shape is not None:
            fail("w13_scale / w2_scale / block_shape are only for FP8 weights")
    if topk_weights.dim() != 2 or topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape:
        fail(
            f"topk_weights and topk_ids must both be [T, k]; got {tuple(topk_weights.shape)} "
            f"and {tuple(topk_ids.shape)}"
        )
    if topk_ids.shape[0] != T:
        fail(f"topk_ids has {topk_ids.shape[0]} rows but hidden_states has T={T}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        fail(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not topk_weights.dtype.is_floating_point:
        fail(f"topk_weights must be floating point, got {topk_weights.dtype}")
    if w13_bias is not None and tuple(w13_bias.shape) != (E, two_i):
        fail(f"w13_bias must be [E, 2I] = {(E, two_i)}, got {tuple(w13_bias.shape)}")
    if w2_bias is not None and tuple(w2_bias.shape) != (E, H):
        fail(f"w2_bias must be [E, H] = {(E, H)}, got {tuple(w2_bias.shape)}")
    return T, H, E, inter, topk_ids.shape[1]


def dequantize_weight(
    w: torch.Tensor, scale: Optional[torch.Tensor], block_shape: Optional[Sequence[int]], dtype: torch.dtype
) -> torch.Tensor:
    """Return ``w`` [E, N, K] in ``dtype``, applying per-tensor, per-expert or block scales to FP8."""
    if w.dtype not in FP8_DTYPES:
        return w.to(dtype)
    assert scale is not None
    wf = w.to(torch.float32)
    E, N, K = w.shape
    if block_shape is None:
        s = scale.to(torch.float32).reshape(-1)
        s = s.reshape(E if s.numel() == E else 1, 1, 1)
        return (wf * s).to(dtype)
    bn, bk = block_shape
    s = scale.to(torch.float32)
    s = s.repeat_interleave(bn, dim=1)[:, :N].repeat_interleave(bk, dim=2)[:, :, :K]
    return (wf * s).to(dtype)


def _expert_scale(scale: Optional[torch.Tensor], e: int, num_experts: int) -> Optional[torch.Tensor]:
    """The slice of a per-expert or block scale that belongs to expert ``e`` (a per-tensor one as is)."""
    if scale is None or scale.dim() == 0 or scale.shape[0] != num_experts:
        return scale
    return scale[e : e + 1]


def apply_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """Gated activation of a [*, 2I] gate-up product: act(gate) * up."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    raise MoEArgumentError(f"rubin.moe: activation={activation!r} is not supported; use one of {ACTIVATIONS}")


def moe_reference(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    w13_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
    w13_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    block_shape: Optional[Sequence[int]] = None,
    weight_layout: str = "plain",
) -> torch.Tensor:
    """Plain PyTorch semantics of ``rubin.moe`` (see the module docstring); any device.

    Matrix products run in the input dtype, as eager PyTorch would (so a bf16 model matches its eager
    self closely); the top-k weighted sum accumulates in float32 (float64 for float64 inputs). Packed
    weights (``weight_layout`` other than "plain") are unpacked first, a copy per call: the reference
    defines the result, the kernels that read a layout as stored are in kernels/.
    """
    T, H, E, inter, k = check_moe_args(
        hidden_states, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, w13_scale,
        w2_scale, block_shape, weight_layout,
    )
    if is_cpu_packed(weight_layout):
        w13, w2 = unpack_cpu_weight(w13), unpack_cpu_weight(w2)
    dtype = hidden_states.dtype
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.zeros(T, H, dtype=acc_dtype, device=hidden_states.device)
    if T == 0 or k == 0:
        return out.to(dtype)
    flat_ids = topk_ids.reshape(-1).to(torch.int64)
    flat_w = topk_weights.reshape(-1).to(acc_dtype)
    token_of_slot = torch.arange(T, device=hidden_states.device).repeat_interleave(k)
    for e in torch.unique(flat_ids).tolist():
        if not 0 <= e < E:
            raise MoEArgumentError(f"rubin.moe: topk_ids contains expert {e}, outside [0, E={E})")
        slots = (flat_ids == e).nonzero().squeeze(1)
        tokens = token_of_slot[slots]
        x = hidden_states.index_select(0, tokens)
        w13_e = dequantize_weight(w13[e : e + 1], _expert_scale(w13_scale, e, E), block_shape, dtype)[0]
        w2_e = dequantize_weight(w2[e : e + 1], _expert_scale(w2_scale, e, E), block_shape, dtype)[0]
        gate_up = x @ w13_e.t()
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[e].to(dtype)
        y = apply_activation(gate_up, activation) @ w2_e.t()
        if w2_bias is not None:
            y = y + w2_bias[e].to(dtype)
        out.index_add_(0, tokens, y.to(acc_dtype) * flat_w[slots].unsqueeze(1))
    return out.to(dtype)


def run_kernel(impl: str, args: tuple, weight_layout: str = "plain", pdl: bool = False,
               placement: str = "") -> torch.Tensor:
    """Run rubin.moe's kernel ``impl`` on the op's positional ``args`` (hidden_states ... block_shape).
    ``weight_layout``, ``pdl`` and ``placement`` are passed only when they are not their defaults: only
    kernels that declare a layout, PDL or a placement (kernels/registry.py) are ever given one by the
    passes, and the others take no such argument."""
    from rubin_compile.kernels import registry  # lazy: providers may import optional packages

    fn = registry.implementation("moe", impl)
    extra: dict = {}
    if weight_layout != "plain":
        extra["weight_layout"] = weight_layout
    if pdl:
        extra["pdl"] = True
    if placement:
        extra["placement"] = placement
    return fn(*args, **extra)


@torch.library.custom_op("rubin::moe", mutates_args=())
def moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    w13_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
    w13_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    block_shape: Optional[list[int]] = None,
    impl: str = "reference",
    weight_layout: str = "plain",
    pdl: bool = False,
    placement: str = "",
) -> torch.Tensor:
    """Canonical MoE; see the module docstring. ``impl`` names the kernel that runs it (see kernels/registry.py)."""
    return run_kernel(impl, (hidden_states, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias,
                             w13_scale, w2_scale, block_shape), weight_layout, pdl, placement)


@moe.register_fake
def _moe_fake(
    hidden_states, w13, w2, topk_weights, topk_ids, activation="silu", w13_bias=None, w2_bias=None,
    w13_scale=None, w2_scale=None, block_shape=None, impl="reference", weight_layout="plain", pdl=False,
    placement="",
):
    check_moe_args(
        hidden_states, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, w13_scale,
        w2_scale, block_shape, weight_layout,
    )
    return torch.empty_like(hidden_states, memory_format=torch.contiguous_format)
