"""The canonical mixture-of-experts op, ``torch.ops.rubin.moe``.

Every MoE idiom the matchers recognise (vLLM's CPU and GPU ops, Hugging Face grouped-mm experts, a plain
loop over experts) is rewritten into this one functional op; kernel selection then binds it to a kernel
(``MOE``, the op's entry in ops/registry.py; kernels register onto it from kernels/). Its reference
implementation below *is* the semantics.

Schema::

    rubin::moe(Tensor hidden_states,      # [T, H]   bf16 / fp16 / fp32
               Tensor w13,                # [E, N, H]: N = 2I for a gated activation (gate rows [0, I) then up
                                          # rows [I, 2I), vLLM's layout), N = I for a _no_mul one
               Tensor w2,                 # [E, H, I]
               Tensor topk_weights,       # [T, k]   any float dtype; used as float32
               Tensor topk_ids,           # [T, k]   int32 / int64, values in [0, E)
               str activation="silu",     # see "Activations" below: silu / gelu / gelu_tanh (gate, then up rows),
                                          # swigluoai (GPT-OSS: clamped, rows interleaved), clamped SwiGLUs, _no_mul
               Tensor? w13_bias=None,     # [E, N]
               Tensor? w2_bias=None,      # [E, H]
               Tensor? w13_scale=None,    # FP8 (e4m3) weights only, see below
               Tensor? w2_scale=None,
               int[]? block_shape=None,   # [bn, bk] for block-scaled FP8, e.g. [128, 128]
               str impl="reference",      # which kernel runs it; chosen by select_kernels
               str weight_layout="plain", # how w13 / w2 are stored, see below (WeightLayout)
               bool pdl=False,            # launch with Programmatic Dependent Launch; set by chain_pdl
               str placement="",          # "" or "split_n:<mode>:<domains>:<max_tokens>" (Placement); set by
                                          # place_locality
               bool apply_router_weight_on_input=False,  # scale each expert's input, not its output (Llama 4)
               Tensor? activation_constants=None,         # the activation's constants as run-time values
               Tensor? w13_scale_2=None,  # NVFP4 only: the global scales of w13 / w2, float32 [E]
               Tensor? w2_scale_2=None,   #   (ModelOpt's weight_scale_2)
               Tensor? a13_scale=None,    # optional static scales of FC1's / FC2's inputs, float32 [] (ModelOpt's
               Tensor? a2_scale=None)     #   input_scale), for kernels that quantise activations; see below
      -> Tensor                           # [T, H] in hidden_states' dtype

Semantics, for every token t::

    out[t] = sum_j topk_weights[t, j] * FFN_{e}(hidden_states[t]),   e = topk_ids[t, j]
    FFN_e(x) = act(x @ w13[e].T + b13[e]) @ w2[e].T + b2[e]

with ``apply_router_weight_on_input=True`` (vLLM's flag; Llama 4 scales each expert's input by its router score)::

    out[t] = sum_j FFN_{e}(topk_weights[t, j] * hidden_states[t])   (the product in hidden_states' dtype)

Activations (``act`` of the ``[*, N]`` gate-up product ``g``; vLLM's names, ``MoEActivation``). A **gated**
activation reads N = 2I columns, a gate and an up part, and returns I; a ``_no_mul`` one reads N = I:

* ``"silu"``, ``"gelu"`` (exact, erf), ``"gelu_tanh"``: ``act(gate) * up`` with ``gate = g[..., :I]`` and
  ``up = g[..., I:]`` (w13's gate rows, then its up rows: vLLM's layout).
* ``"swigluoai"``: GPT-OSS's clamped SwiGLU over **interleaved** rows (``gate = g[..., 0::2]``,
  ``up = g[..., 1::2]``, as GPT-OSS checkpoints store ``gate_up_proj`` and vLLM's ``swigluoai`` reads it)::

      gate = gate.clamp(max=limit);  up = up.clamp(-limit, limit)
      act = (up + 1) * (gate * sigmoid(alpha * gate))

  with ``alpha = 1.702`` and ``limit = 7.0`` (GPT-OSS's ``swiglu_alpha`` / ``swiglu_limit``, vLLM's constants);
  other values are written ``"swigluoai:<alpha>:<limit>"`` (``swigluoai_activation``). w13 and its bias keep
  the interleaved order: the rewrite never reorders weights.
* ``"swigluoai_uninterleave[:<alpha>:<limit>]"``: the same over gate rows then up rows (MiniMax-M3; vLLM's
  ``swigluoai_uninterleave`` with ``swiglu_beta = 1``).
* ``"silu_clamp:<limit>"``: ``silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)`` over halves (DeepSeek-V4,
  GLM-5-Next, Hunyuan-V4; vLLM's ``silu`` with a ``swiglu_limit``).
* ``"swiglustep[:<limit>]"``: ``silu(gate).clamp(max=limit) * up.clamp(-limit, limit)`` over halves, limit 7.0 by
  default (Step-3.5 / 3.7; vLLM's ``swiglustep``).
* not gated, w13 ``[E, I, H]``: ``"silu_no_mul"``, ``"gelu_no_mul"``, ``"gelu_tanh_no_mul"``, ``"relu2_no_mul"``
  (``relu(g) ** 2``, Nemotron-H), ``"relu_no_mul"`` (``relu(g)``).

``activation_constants``: when the activation's constants are values the graph computes or receives (Dynamo
makes a module's float attribute a graph input under ``dynamic=True``), a 1-D float tensor of them in the order
of the string form (``[alpha, limit]``, ``[limit]``); they replace the string's, and the string may then be the
kind alone (``"silu_clamp"``, whose limit has no default otherwise). None: the string's.

The top-k weights are applied after FC2 (as vLLM and Hugging Face do) unless ``apply_router_weight_on_input``.
If an expert id appears twice in a token's row, both slots contribute. FP8 weights are dequantised before use: with ``block_shape=None`` a
scale is per tensor (shape ``[]``) or per expert (``[E]``, ``[E, 1]`` or ``[E, 1, 1]``); with
``block_shape=[bn, bk]`` ``w13_scale`` is ``[E, ceil(2I/bn), ceil(H/bk)]`` and ``w2_scale`` is
``[E, ceil(H/bn), ceil(I/bk)]`` (the DeepSeek / Qwen FP8 checkpoint layout). The reference keeps
activations in their own dtype; a kernel that quantises activations states its tolerance.

FP4 weights (NVFP4, MXFP4; ops/fp4.py says how they are packed) are ``torch.uint8``, two e2m1 values per byte
along the reduction dim: w13 ``[E, N, H / 2]``, w2 ``[E, H, I / 2]``. NVFP4: ``w13_scale`` ``[E, N, H / 16]`` and
``w2_scale`` ``[E, H, I / 16]`` in ``float8_e4m3fn``, with ``w13_scale_2`` / ``w2_scale_2`` ``[E]`` float32;
MXFP4: ``w13_scale`` ``[E, N, H / 32]`` and ``w2_scale`` ``[E, H, I / 32]`` as uint8 E8M0 exponents, no
``*_scale_2``. They are dequantised (``fp4.dequantize``) before use, like FP8. ``a13_scale`` / ``a2_scale``
(FP8 per-tensor and FP4 weights) are the static activation scales a checkpoint calibrated (amax / 448 for FP8,
amax / (448 * 6) for NVFP4): the reference ignores them (activations stay in their dtype); kernels that quantise
activations with static scales (W8A8 / W4A4) read them, and selection rejects those kernels for a call without
them (``KernelSpec.static_input_scales``).

A kernel implements ``apply_router_weight_on_input`` and ``activation_constants`` only where it declares the
feature (``MoEArgs.features``, ``KernelSpec.features``, ``Kernel.features``); selection rejects the others with
that reason, so a kernel never computes a different op silently.

``pdl`` and ``placement`` say how the kernel is launched, never what it computes: PDL results are
bitwise identical, and a split-N placement (passes/place_locality.py: FC1 split over I, FC2 over H, one
locality domain each) changes no reduction order. Kernels that do not take them run without.

Weight layouts (``weight_layout``; the shapes above hold in every layout, only the order of the elements
inside each expert's matrix differs). A kernel declares the layouts it reads, so a matcher can hand over
weights as the model stores them instead of copying them on every call:

* ``"plain"``: row-major ``[E, N, K]`` as written above.
* ``"vllm_cpu:<isa>"``: what vLLM's CPU build stores after ``_C.prepack_moe_weight(w, isa)``: each
  ``[N, K]`` matrix as ``[N / 16, K, 16]`` (16 output rows interleaved along K; ``unpack_cpu_weight``
  undoes it). ``<isa>`` ("vec", "amx", ...) is the one vLLM packed for and its kernel runs with.
* ``"vllm_cpu:<isa>:vnni"``: the same with K in pairs, ``[N / 16, K / 2, 16, 2]``: what vLLM writes for isa
  "amx" with bf16 / fp16 weights on a CPU that has AMX (its tiles take 16-bit values in pairs).

  Which of the two vLLM wrote depends on the isa, the dtype and the machine; the matchers find it out per shape
  and dtype by running vLLM's packing once (integrations/vllm/layer_ops.py) and name it in the layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from rubin_compile.errors import RubinError
from rubin_compile.ops import fp4
from rubin_compile.ops.nodes import FLOAT_DTYPES, bound_arguments, node_val, static_size, val_dtype
from rubin_compile.ops.registry import CanonicalOp, KernelSpec, Launch
from rubin_compile.ops.library import op
from rubin_compile.target import Target

SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT = 1.702, 7.0  # GPT-OSS's (and vLLM's) clamped-SwiGLU constants
SWIGLUSTEP_LIMIT = 7.0  # vLLM's swiglustep default


@dataclass(frozen=True)
class Activation:
    """One kind of ``activation`` (see "Activations" in the module docstring): whether it is gated (reads a gate
    and an up part, N = 2I) and how the two lie (``interleaved``: even / odd columns; else halves), and the names
    and defaults of its constants, in the order its string form writes them (``"<kind>:<c1>:<c2>"``).
    ``defaults=None``: the constants must be written."""

    kind: str
    gated: bool = True
    interleaved: bool = False
    constants: tuple[str, ...] = ()
    defaults: Optional[tuple[float, ...]] = ()


ACTIVATION_KINDS: dict[str, Activation] = {
    a.kind: a
    for a in (
        Activation("silu"),
        Activation("gelu_tanh"),
        Activation("gelu"),
        Activation("swigluoai", interleaved=True, constants=("alpha", "limit"), defaults=(1.702, 7.0)),
        Activation("swigluoai_uninterleave", constants=("alpha", "limit"), defaults=(1.702, 7.0)),
        Activation("silu_clamp", constants=("limit",), defaults=None),
        Activation("swiglustep", constants=("limit",), defaults=(SWIGLUSTEP_LIMIT,)),
        Activation("silu_no_mul", gated=False),
        Activation("gelu_no_mul", gated=False),
        Activation("gelu_tanh_no_mul", gated=False),
        Activation("relu2_no_mul", gated=False),
        Activation("relu_no_mul", gated=False),
    )
}
ACTIVATIONS = tuple(ACTIVATION_KINDS)  # the kinds; those with constants may carry them ("swigluoai:<a>:<l>")
WEIGHT_FP4_DTYPE = torch.uint8  # FP4 weights, two e2m1 values per byte (ops/fp4.py)
WEIGHT_FP8_DTYPES = (torch.float8_e4m3fn,)  # rubin.moe's FP8 weights: e4m3, as the checkpoints store them
CPU_PACK_ROWS = 16  # vLLM's CPU MoE weight packing: 16 output rows interleaved along K


class MoEArgumentError(RubinError, ValueError):
    """Raised when the arguments of ``rubin.moe`` do not describe a valid MoE call."""


def _fail(msg: str) -> None:
    raise MoEArgumentError(f"rubin.moe: {msg}")


# ------------------------------------------------------------------------------------------------
# weight layouts
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightLayout:
    """How ``w13`` / ``w2`` are stored (see the module docstring): ``family`` "plain" or "vllm_cpu" (with the
    ``isa`` vLLM packed for, and ``vnni`` when K is in pairs). The op schema keeps the string form, ``encode()``."""

    family: str = "plain"
    isa: Optional[str] = None
    vnni: bool = False

    @staticmethod
    def decode(text: str) -> "WeightLayout":
        if text == "plain":
            return PLAIN
        parts = text.split(":")
        if parts[0] != "vllm_cpu" or len(parts) not in (2, 3) or not parts[1] or parts[2:] not in ([], ["vnni"]):
            _fail(f"weight_layout={text!r} is not 'plain', 'vllm_cpu:<isa>' or 'vllm_cpu:<isa>:vnni'")
        return WeightLayout(parts[0], parts[1], len(parts) == 3)

    def encode(self) -> str:
        if self.isa is None:
            return self.family
        return f"{self.family}:{self.isa}" + (":vnni" if self.vnni else "")

    def describe(self) -> str:
        """What the layout is, for reports: "16-row blocks", "16-row blocks, K in pairs (VNNI)"."""
        return f"{CPU_PACK_ROWS}-row blocks" + (", K in pairs (VNNI)" if self.vnni else "")

    @property
    def cpu_packed(self) -> bool:
        return self.family == "vllm_cpu"


PLAIN = WeightLayout()


def pack_cpu_weight(w: torch.Tensor, vnni: bool = False) -> torch.Tensor:
    """Plain ``[E, N, K]`` -> the ``"vllm_cpu:<isa>"`` layout (``vnni``: ``"vllm_cpu:<isa>:vnni"``), what
    ``_C.prepack_moe_weight`` writes."""
    E, N, K = w.shape
    if vnni:
        return w.reshape(E, N // CPU_PACK_ROWS, CPU_PACK_ROWS, K // 2, 2).permute(0, 1, 3, 2, 4).reshape(E, N, K)
    return w.reshape(E, N // CPU_PACK_ROWS, CPU_PACK_ROWS, K).permute(0, 1, 3, 2).reshape(E, N, K)


def unpack_cpu_weight(w: torch.Tensor, vnni: bool = False) -> torch.Tensor:
    """The ``"vllm_cpu:<isa>"`` layout (``vnni``: with K in pairs) -> plain ``[E, N, K]`` (a copy)."""
    E, N, K = w.shape
    if vnni:
        return w.reshape(E, N // CPU_PACK_ROWS, K // 2, CPU_PACK_ROWS, 2).permute(0, 1, 3, 2, 4).reshape(E, N, K)
    return w.reshape(E, N // CPU_PACK_ROWS, K, CPU_PACK_ROWS).permute(0, 1, 3, 2).reshape(E, N, K)


# ------------------------------------------------------------------------------------------------
# the arguments
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEArgs:
    """The data arguments of one ``rubin.moe`` call (the schema's, in its order, without ``impl`` and the
    launch settings), validated when built; ``T, H, E, I, k`` are read off the shapes. Errors name the
    argument and the fix (``MoEArgumentError``). Works on fake tensors too (the op's fake implementation)."""

    hidden_states: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    activation: str = "silu"
    w13_bias: Optional[torch.Tensor] = None
    w2_bias: Optional[torch.Tensor] = None
    w13_scale: Optional[torch.Tensor] = None
    w2_scale: Optional[torch.Tensor] = None
    block_shape: Optional[Sequence[int]] = None
    weight_layout: WeightLayout = PLAIN
    apply_router_weight_on_input: bool = False
    activation_constants: Optional[torch.Tensor] = None
    w13_scale_2: Optional[torch.Tensor] = None
    w2_scale_2: Optional[torch.Tensor] = None
    a13_scale: Optional[torch.Tensor] = None
    a2_scale: Optional[torch.Tensor] = None
    T: int = field(init=False)
    H: int = field(init=False)
    E: int = field(init=False)
    I: int = field(init=False)  # noqa: E741  (the intermediate size, as every MoE paper names it)
    k: int = field(init=False)

    def __post_init__(self) -> None:
        if isinstance(self.weight_layout, str):
            object.__setattr__(self, "weight_layout", WeightLayout.decode(self.weight_layout))
        if self.block_shape is not None:
            object.__setattr__(self, "block_shape", tuple(self.block_shape))
        T, H, E, inter, k = _validate(self)
        for name, value in (("T", T), ("H", H), ("E", E), ("I", inter), ("k", k)):
            object.__setattr__(self, name, value)

    def flat_routing(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_ids, topk_weights)`` as contiguous [T k] vectors in slot order (token-major), the kernels' layout."""
        return self.topk_ids.reshape(-1).contiguous(), self.topk_weights.reshape(-1).contiguous()

    @property
    def fp8(self) -> bool:
        return self.w13.dtype in WEIGHT_FP8_DTYPES

    @property
    def fp4(self) -> Optional[str]:
        """``"nvfp4"`` / ``"mxfp4"`` for FP4 weights, else ``None``."""
        return fp4.kind_of(self.w13_scale) if self.w13.dtype == WEIGHT_FP4_DTYPE else None

    @property
    def features(self) -> tuple[str, ...]:
        """The optional semantics this call uses, which only kernels declaring them implement (``FEATURES``)."""
        return call_features(self.apply_router_weight_on_input, self.activation_constants is not None)


# Optional semantics of rubin.moe that a kernel implements only where it says so (Kernel.features).
ROUTER_WEIGHT_ON_INPUT = "router_weight_on_input"
RUNTIME_ACTIVATION_CONSTANTS = "runtime_activation_constants"
FEATURES = (ROUTER_WEIGHT_ON_INPUT, RUNTIME_ACTIVATION_CONSTANTS)


def call_features(on_input: bool, runtime_constants: bool) -> tuple[str, ...]:
    return tuple(f for f, used in zip(FEATURES, (on_input, runtime_constants)) if used)


def _validate(a: MoEArgs) -> tuple:
    """(T, H, E, I, k) of valid arguments; ``MoEArgumentError`` naming the argument and the fix otherwise."""
    x, w13, w2 = a.hidden_states, a.w13, a.w2
    layout = a.weight_layout
    if layout.cpu_packed:
        if w13.dim() == 3 and w2.dim() == 3 and (w13.shape[1] % CPU_PACK_ROWS or w2.shape[1] % CPU_PACK_ROWS):
            _fail(
                f"weight_layout {layout.encode()!r} packs rows in blocks of {CPU_PACK_ROWS}; w13 {tuple(w13.shape)} "
                f"and w2 {tuple(w2.shape)} must have N divisible by {CPU_PACK_ROWS}"
            )
        if w13.dtype in WEIGHT_FP8_DTYPES or w2.dtype in WEIGHT_FP8_DTYPES:
            _fail(f"weight_layout {layout.encode()!r} is for unquantised weights")
    # names the activations rubin.moe implements when it is not one
    act, _ = activation_info(a.activation, runtime_constants=a.activation_constants is not None)
    _validate_constants(a, act)
    if x.dim() != 2:
        _fail(f"hidden_states must be [T, H], got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        _fail(f"hidden_states dtype {x.dtype} is not one of bf16 / fp16 / fp32 / fp64")
    T, H = x.shape
    if w13.dim() != 3 or w2.dim() != 3:
        _fail(f"w13 must be [E, N, H] and w2 [E, H, I]; got {tuple(w13.shape)} and {tuple(w2.shape)}")
    E, two_i, h13 = w13.shape  # two_i: N, 2I for a gated activation, I for a _no_mul one
    packed = w13.dtype == WEIGHT_FP4_DTYPE  # FP4: two values per byte along H (w13) and I (w2)
    if packed:
        h13 *= 2
    if h13 != H or (act.gated and two_i % 2):
        _fail(f"w13 shape {tuple(w13.shape)} does not match [E, 2I, H={H}] with an even 2I ({a.activation} is gated)")
    inter = two_i // 2 if act.gated else two_i
    if tuple(w2.shape[:2]) != (E, H):
        _fail(f"w2 shape {tuple(w2.shape)} does not match [E={E}, H={H}, I]")
    if w2.shape[2] * (2 if packed else 1) != inter:
        rows = (
            f"2I={2 * w2.shape[2]}, H={H}] (gate rows, then up rows)"
            if act.gated
            else f"I={w2.shape[2]}, H={H}] ({a.activation} is not gated)"
        )
        _fail(
            f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} disagree on I: w2 has I={w2.shape[2]}, so w13 must "
            f"be [E={E}, {rows}; w13 has {two_i} rows"
        )
    quantized = w13.dtype in WEIGHT_FP8_DTYPES
    if (w2.dtype in WEIGHT_FP8_DTYPES) != quantized or (w2.dtype == WEIGHT_FP4_DTYPE) != packed:
        _fail(f"w13 ({w13.dtype}) and w2 ({w2.dtype}) must both be FP8, both FP4 (uint8) or both unquantised")
    if packed:
        _validate_fp4(a, E, H, two_i, inter)
    elif quantized:
        _validate_scales(a, E, H, two_i, inter)
    if not packed and (a.w13_scale_2 is not None or a.w2_scale_2 is not None):
        _fail("w13_scale_2 / w2_scale_2 are the global scales of NVFP4 weights; these weights are not FP4")
    _validate_input_scales(a, quantized or packed)
    if not (quantized or packed):
        if w13.dtype != x.dtype or w2.dtype != x.dtype:
            _fail(
                f"weights ({w13.dtype}, {w2.dtype}) must have hidden_states' dtype {x.dtype} "
                "(or be FP8 with scales); cast them before the call"
            )
        if a.w13_scale is not None or a.w2_scale is not None or a.block_shape is not None:
            _fail("w13_scale / w2_scale / block_shape are only for FP8 weights")
    tw, ids = a.topk_weights, a.topk_ids
    if tw.dim() != 2 or ids.dim() != 2 or tw.shape != ids.shape:
        _fail(f"topk_weights and topk_ids must both be [T, k]; got {tuple(tw.shape)} and {tuple(ids.shape)}")
    if ids.shape[0] != T:
        _fail(f"topk_ids has {ids.shape[0]} rows but hidden_states has T={T}")
    if ids.dtype not in (torch.int32, torch.int64):
        _fail(f"topk_ids must be int32 or int64, got {ids.dtype}")
    if not tw.dtype.is_floating_point:
        _fail(f"topk_weights must be floating point, got {tw.dtype}")
    if a.w13_bias is not None and tuple(a.w13_bias.shape) != (E, two_i):
        _fail(f"w13_bias must be [E, N] = {(E, two_i)}, got {tuple(a.w13_bias.shape)}")
    if a.w2_bias is not None and tuple(a.w2_bias.shape) != (E, H):
        _fail(f"w2_bias must be [E, H] = {(E, H)}, got {tuple(a.w2_bias.shape)}")
    return T, H, E, inter, ids.shape[1]


def _validate_constants(a: MoEArgs, act: Activation) -> None:
    c = a.activation_constants
    if c is None:
        return
    if not act.constants:
        _fail(f"activation_constants given, but activation {a.activation!r} has no constants")
    if c.dim() != 1 or c.shape[0] != len(act.constants) or not c.dtype.is_floating_point:
        _fail(
            f"activation_constants must be a 1-D float tensor of {len(act.constants)} values "
            f"({', '.join(act.constants)}) for {act.kind}; got {c.dtype} of shape {tuple(c.shape)}"
        )


def _validate_fp4(a: MoEArgs, E: int, H: int, two_i: int, inter: int) -> None:
    kind = fp4.kind_of(a.w13_scale)
    if kind is None or fp4.kind_of(a.w2_scale) != kind:
        _fail(
            "FP4 (uint8) weights need w13_scale and w2_scale in one format: float8_e4m3fn per 16 elements (NVFP4) or "
            f"uint8 E8M0 per 32 (MXFP4); got {getattr(a.w13_scale, 'dtype', None)} and {getattr(a.w2_scale, 'dtype', None)}"
        )
    if a.block_shape is not None:
        _fail("block_shape is for FP8 block scales; FP4 weights have their format's blocks (16 or 32)")
    block = fp4.block_size(kind)
    for name, s, rows, cols in (("w13_scale", a.w13_scale, two_i, H), ("w2_scale", a.w2_scale, H, inter)):
        if cols % block:
            _fail(f"{kind.upper()} needs the reduction dim of {name[:-6]} ({cols}) to be a multiple of {block}")
        if tuple(s.shape) != (E, rows, cols // block):
            _fail(f"{name} must be [E, {rows}, {cols} / {block}] = {(E, rows, cols // block)}, got {tuple(s.shape)}")
    for name in ("w13_scale_2", "w2_scale_2"):
        g = getattr(a, name)
        if kind == "mxfp4" and g is not None:
            _fail(f"{name} is for NVFP4; MXFP4 has no global scale")
        if kind == "nvfp4" and (g is None or g.dtype != torch.float32 or g.numel() not in (1, E)):
            _fail(f"NVFP4 weights need {name}, float32 [E={E}] (ModelOpt's weight_scale_2); got {_describe(g)}")


def _describe(t: Optional[torch.Tensor]) -> str:
    return "None" if t is None else f"{t.dtype} {tuple(t.shape)}"


def _validate_input_scales(a: MoEArgs, quantized: bool) -> None:
    for name in ("a13_scale", "a2_scale"):
        s = getattr(a, name)
        if s is None:
            continue
        if not quantized or a.block_shape is not None:
            _fail(f"{name} (a static activation scale) is for FP8 per-tensor and FP4 weights; drop it")
        if s.dtype != torch.float32 or s.numel() != 1:
            _fail(f"{name} must be one float32 element (a per-tensor scale), got {_describe(s)}")


def _validate_scales(a: MoEArgs, E: int, H: int, two_i: int, inter: int) -> None:
    if a.w13_scale is None or a.w2_scale is None:
        _fail("FP8 weights need w13_scale and w2_scale")
    if a.block_shape is not None:
        if len(a.block_shape) != 2 or min(a.block_shape) <= 0:
            _fail(f"block_shape must be [bn, bk] with positive entries, got {list(a.block_shape)}")
        bn, bk = a.block_shape
        want13 = (E, -(-two_i // bn), -(-H // bk))
        want2 = (E, -(-H // bn), -(-inter // bk))
        if tuple(a.w13_scale.shape) != want13 or tuple(a.w2_scale.shape) != want2:
            _fail(
                f"block scales must be w13_scale {want13} and w2_scale {want2} for block_shape "
                f"{list(a.block_shape)}; got {tuple(a.w13_scale.shape)} and {tuple(a.w2_scale.shape)}"
            )
    else:
        for name, s in (("w13_scale", a.w13_scale), ("w2_scale", a.w2_scale)):
            if s.numel() not in (1, E):
                _fail(f"{name} must be per-tensor ([]) or per-expert ([E={E}]); got {tuple(s.shape)}")


# ------------------------------------------------------------------------------------------------
# the semantics
# ------------------------------------------------------------------------------------------------


def dequantize_weight(
    w: torch.Tensor, scale: Optional[torch.Tensor], block_shape: Optional[Sequence[int]], dtype: torch.dtype
) -> torch.Tensor:
    """Return ``w`` [E, N, K] in ``dtype``, applying per-tensor, per-expert or block scales to FP8."""
    if w.dtype not in WEIGHT_FP8_DTYPES:
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


def swigluoai_activation(
    alpha: float = SWIGLUOAI_ALPHA, limit: float = SWIGLUOAI_LIMIT, kind: str = "swigluoai"
) -> str:
    """The ``activation`` string of GPT-OSS's clamped SwiGLU with these constants (``"swigluoai"`` for
    GPT-OSS's own); ``kind="swigluoai_uninterleave"`` for the same over gate rows then up rows."""
    return activation_string(kind, (alpha, limit))


def activation_string(kind: str, constants: Sequence[float] = ()) -> str:
    """The ``activation`` string of ``kind`` with ``constants`` (the kind alone when they are its defaults)."""
    act = ACTIVATION_KINDS[kind]
    values = tuple(float(v) for v in constants)
    if len(values) != len(act.constants):
        raise MoEArgumentError(f"rubin.moe: activation {kind} takes constants {act.constants}, got {values}")
    if not values or (act.defaults is not None and values == tuple(float(d) for d in act.defaults)):
        return kind
    return ":".join([kind] + [repr(v) for v in values])


def activation_info(activation: str, runtime_constants: bool = False) -> tuple[Activation, tuple[float, ...]]:
    """``(Activation, constants)`` of an ``activation`` string; ``MoEArgumentError`` naming the supported ones
    otherwise. ``runtime_constants``: the call passes ``activation_constants``, so a kind without defaults may be
    written alone (its constants are then ``()``: they come at run time)."""
    kind, *parts = activation.split(":") if isinstance(activation, str) else [None]
    act = ACTIVATION_KINDS.get(kind)
    if act is not None:
        if not parts and act.defaults is not None:
            return act, tuple(act.defaults)
        if not parts and act.constants and runtime_constants:
            return act, ()
        try:
            values = tuple(float(v) for v in parts)
        except ValueError:
            values = ()
        if len(values) == len(act.constants) and values:
            if "limit" not in act.constants or values[act.constants.index("limit")] > 0:
                return act, values
    raise MoEArgumentError(
        f"rubin.moe: activation={activation!r} is not supported; use one of {ACTIVATIONS} (with constants: "
        "'swigluoai[_uninterleave]:<alpha>:<limit>', 'silu_clamp:<limit>', 'swiglustep:<limit>', limit > 0; the kind "
        "alone with activation_constants)"
    )


def parse_activation(activation: str) -> tuple[str, tuple[float, ...]]:
    """``(kind, constants)`` of an ``activation`` string: ``("silu", ())``, ``("swigluoai", (alpha, limit))``;
    ``MoEArgumentError`` naming the supported ones otherwise."""
    act, constants = activation_info(activation)
    return act.kind, constants


def apply_activation(gate_up: torch.Tensor, activation: str, constants: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The activation of a ``[*, N]`` gate-up product (see "Activations" in the module docstring). ``constants``:
    the run-time values of its constants (``activation_constants``), which replace the string's."""
    act, values = activation_info(activation, runtime_constants=constants is not None)
    c: Sequence[Any] = values
    if constants is not None:
        c = [constants[i].to(gate_up.dtype) for i in range(len(act.constants))]
    named = dict(zip(act.constants, c))
    if not act.gated:
        if act.kind == "relu2_no_mul":
            return torch.square(F.relu(gate_up))
        return _UNGATED[act.kind](gate_up)
    if act.interleaved:
        gate, up = gate_up[..., 0::2], gate_up[..., 1::2]  # interleaved rows, as GPT-OSS stores them
    else:
        inter = gate_up.shape[-1] // 2
        gate, up = gate_up[..., :inter], gate_up[..., inter:]
    if act.kind in ("swigluoai", "swigluoai_uninterleave"):
        alpha, limit = named["alpha"], named["limit"]
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    if act.kind == "silu_clamp":
        limit = named["limit"]
        return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
    if act.kind == "swiglustep":
        limit = named["limit"]
        return F.silu(gate).clamp(max=limit) * up.clamp(min=-limit, max=limit)
    return _UNGATED[act.kind](gate) * up


_UNGATED = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"),
    "silu_no_mul": F.silu,
    "gelu_no_mul": F.gelu,
    "gelu_tanh_no_mul": lambda v: F.gelu(v, approximate="tanh"),
    "relu_no_mul": F.relu,
}


def reference(args: MoEArgs, launch: Launch = Launch()) -> torch.Tensor:
    """Plain PyTorch semantics of ``rubin.moe`` (see the module docstring); any device.

    Matrix products run in the input dtype, as eager PyTorch would (so a bf16 model matches its eager
    self closely); the top-k weighted sum accumulates in float32 (float64 for float64 inputs). Packed
    weights (``weight_layout`` other than "plain") are unpacked first, a copy per call: the reference
    defines the result, the kernels that read a layout as stored are in kernels/. ``launch`` changes
    nothing (the reference has no launch settings).
    """
    T, H, E, k = args.T, args.H, args.E, args.k
    x = args.hidden_states
    w13, w2 = args.w13, args.w2
    if args.weight_layout.cpu_packed:
        vnni = args.weight_layout.vnni
        w13, w2 = unpack_cpu_weight(w13, vnni), unpack_cpu_weight(w2, vnni)
    dtype = x.dtype
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.zeros(T, H, dtype=acc_dtype, device=x.device)
    if T == 0 or k == 0:
        return out.to(dtype)
    flat_ids = args.topk_ids.reshape(-1).to(torch.int64)
    flat_w = args.topk_weights.reshape(-1).to(acc_dtype)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return _reference_in_capture(args, w13, w2, out).to(dtype)
    token_of_slot = torch.arange(T, device=x.device).repeat_interleave(k)
    on_input = args.apply_router_weight_on_input
    for e in torch.unique(flat_ids).tolist():
        if not 0 <= e < E:
            raise MoEArgumentError(f"rubin.moe: topk_ids contains expert {e}, outside [0, E={E})")
        slots = (flat_ids == e).nonzero().squeeze(1)
        tokens = token_of_slot[slots]
        xe = x.index_select(0, tokens)
        if on_input:  # the routed weight scales the expert's input, in the input dtype (vLLM, Llama 4)
            y = _expert(args, w13, w2, e, xe * args.topk_weights.reshape(-1)[slots].to(dtype).unsqueeze(1))
            out.index_add_(0, tokens, y.to(acc_dtype))
        else:
            y = _expert(args, w13, w2, e, xe)
            out.index_add_(0, tokens, y.to(acc_dtype) * flat_w[slots].unsqueeze(1))
    return out.to(dtype)


def _reference_in_capture(args: MoEArgs, w13: torch.Tensor, w2: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The reference while a CUDA graph is being captured (a compiled graph under CUDA graphs whose MoE runs the
    reference: an fp32 model on a GPU): no host synchronisation, so no ``unique`` / ``nonzero`` over the routing.
    Every expert runs on every token and its output is weighted by the token's routing weight for it (zero when
    not routed): the same sum, E times the work, fine for what the reference is for. Expert ids outside [0, E)
    cannot be reported here (that would need a synchronisation); they contribute nothing. With
    ``apply_router_weight_on_input`` each (slot, expert) pair runs on its scaled input and is masked after FC2
    (an expert of an unrouted slot contributes nothing, biases included)."""
    x = args.hidden_states
    for e in range(args.E):
        if args.apply_router_weight_on_input:
            for j in range(args.k):
                routed = (args.topk_ids[:, j : j + 1] == e).to(out.dtype)  # [T, 1]
                xe = x * args.topk_weights[:, j : j + 1].to(x.dtype)
                out += _expert(args, w13, w2, e, xe).to(out.dtype) * routed
            continue
        coef = (args.topk_weights.to(out.dtype) * (args.topk_ids == e)).sum(dim=1, keepdim=True)  # [T, 1]
        out += _expert(args, w13, w2, e, x).to(out.dtype) * coef
    return out


def _expert(args: MoEArgs, w13: torch.Tensor, w2: torch.Tensor, e: int, xe: torch.Tensor) -> torch.Tensor:
    """Expert ``e``'s FFN on the rows ``xe``, in the input dtype: ``act(xe @ w13[e].T + b13[e]) @ w2[e].T + b2[e]``."""
    dtype, E = xe.dtype, args.E
    if args.fp4:
        w13_e = fp4.dequantize(w13[e], args.w13_scale[e], _global(args.w13_scale_2, e), dtype)
        w2_e = fp4.dequantize(w2[e], args.w2_scale[e], _global(args.w2_scale_2, e), dtype)
    else:
        w13_e = dequantize_weight(w13[e : e + 1], _expert_scale(args.w13_scale, e, E), args.block_shape, dtype)[0]
        w2_e = dequantize_weight(w2[e : e + 1], _expert_scale(args.w2_scale, e, E), args.block_shape, dtype)[0]
    gate_up = xe @ w13_e.t()
    if args.w13_bias is not None:
        gate_up = gate_up + args.w13_bias[e].to(dtype)
    y = apply_activation(gate_up, args.activation, args.activation_constants) @ w2_e.t()
    if args.w2_bias is not None:
        y = y + args.w2_bias[e].to(dtype)
    return y


def _global(scale_2: Optional[torch.Tensor], e: int) -> Optional[torch.Tensor]:
    if scale_2 is None:
        return None
    return scale_2.reshape(-1)[e if scale_2.numel() > 1 else 0]


# ------------------------------------------------------------------------------------------------
# the ATen form (select_kernels lowers a node bound to the reference into it, where it can express the call)
# ------------------------------------------------------------------------------------------------


def aten_declines(args: MoEArgs, target_cc: Optional[int] = None) -> Optional[str]:
    """Why ``aten`` does not express this call for the target (``None`` when it does); ``target_cc`` is a GPU
    target's compute capability (90 for sm_90), ``None`` the CPU target. ``aten`` is the form Hugging Face's
    default (grouped-mm) experts compile to, for what Inductor supports of it: bf16 or float32, unquantised, plain
    weights, on the CPU. On a GPU target a node is bound to the reference only where no kernel takes the call (an
    activation or weight format the kernels lack, in a rubin.moe written by hand: match_moe leaves such a Hugging
    Face block as written there, passes/match_moe/emit.py): the reference there loops over
    the routed experts with a host synchronisation, and inside a CUDA graph (mode="reduce-overhead", generate()'s
    compile_config) runs every expert on every token, E / k times the weight bytes. So a bf16 call of plain layout
    takes the ATen form there too: torch's grouped GEMM, bf16 from sm_90, which reads only the routed experts'
    weights. Below sm_90, or what the grouped GEMM cannot take (fp16, fp32, quantised or packed weights), the node
    stays the op. (The Triton kernel's adapter runs ``aten`` itself, per call, at the sizes where it measured
    faster: kernels/triton/moe_choice.py.)"""
    if target_cc is not None:
        if target_cc < 90:
            return f"torch's grouped GEMM on a GPU needs sm_90 or newer (the target is cc {target_cc})"
        return aten_unsupported(args, gpu=True)
    if args.hidden_states.device.type != "cpu":
        return f"the CPU target's ATen form, with the hidden states on {args.hidden_states.device}"
    return aten_unsupported(args)


def aten_unsupported(args: MoEArgs, gpu: bool = False) -> Optional[str]:
    """Why ``aten`` cannot compute this call on its device (``None`` when it can), or on a GPU with ``gpu`` (a plan
    for one made anywhere): torch's grouped GEMM takes bf16 operands of plain layout with rows of whole 16 bytes;
    float32 ones on the CPU take ``grouped_mm_rows`` instead."""
    dtypes = {args.hidden_states.dtype, args.w13.dtype, args.w2.dtype}
    if args.weight_layout != PLAIN:
        return f"weights in the {args.weight_layout.describe()} layout"
    if dtypes == {torch.float32} and args.hidden_states.device.type == "cpu" and not gpu:
        return None  # grouped_mm_rows: any row size
    if _grouped_mm is None:
        return f"torch {torch.__version__} has neither torch.nn.functional.grouped_mm nor torch._grouped_mm"
    if dtypes != {torch.bfloat16}:
        given = f"{args.hidden_states.dtype} activations / {args.w13.dtype} weights"
        if gpu:
            return f"{given}: torch's grouped GEMM on a GPU takes bfloat16"
        return (
            f"{given}: Inductor compiles torch's grouped GEMM for bfloat16 only (float32 on the CPU takes a loop of "
            "GEMMs)"
        )
    rows = {"H": args.H, "N": args.w13.shape[1], "I": args.I}
    odd = {name: n for name, n in rows.items() if n % 8}
    if odd:
        return f"torch's grouped GEMM takes rows of whole 16 bytes (multiples of 8 bf16 values); here {odd}"
    return None


_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@op("grouped_mm_rows")
def grouped_mm_rows(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(x, w, offs=offs)`` for the float32 CPU calls Inductor cannot compile it for (its fake
    kernel takes bf16 only): one ``torch.mm`` per expert's run of rows, the run ends read once (``offs``); rows past
    the last run are zero. It is what transformers' ``grouped_mm_fallback`` does for the same reason, and, like it,
    an opaque call in the compiled graph around which Inductor compiles the sort, gathers and sums."""
    out = x.new_zeros(x.shape[0], w.shape[2])
    start = 0
    for expert, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(x[start:end], w[expert], out=out[start:end])
        start = end
    return out


@grouped_mm_rows.register_fake
def _grouped_mm_rows_fake(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[2])


def aten(args: MoEArgs) -> torch.Tensor:
    """``rubin.moe`` as ATen ops of static shapes, for a call ``aten_declines`` accepts: the ``T * k`` (token,
    expert) slots sorted by expert (a stable sort: within an expert, slots keep their order), each slot's token
    gathered, FC1 and FC2 as grouped GEMMs over the experts' runs of slots, the activation, then the weighted
    slots summed into their tokens in float32 -- in the order the reference sums them (expert by expert, slots in
    order), so on the CPU its result equals the reference's up to the GEMM's own blocking. In bf16, no host
    synchronisation: Inductor compiles it as it compiles Hugging Face's grouped-mm experts. In float32 on the CPU
    the two grouped GEMMs are ``grouped_mm_rows`` calls (a GEMM per expert's run, its ends read on the host), as
    transformers' own float32 experts call its ``grouped_mm_fallback``. An expert id outside [0, E) cannot be
    reported without one: its slot is sorted after every expert's run, outside the grouped GEMMs (whose rows past the
    last run are not written), and contributes nothing (the reference raises)."""
    return aten_tensors(
        args.hidden_states,
        args.w13,
        args.w2,
        args.topk_weights,
        args.topk_ids,
        args.activation,
        args.w13_bias,
        args.w2_bias,
        args.apply_router_weight_on_input,
        args.activation_constants,
    )


def aten_tensors(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    w13_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
    apply_router_weight_on_input: bool = False,
    activation_constants: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``aten`` on the tensors themselves (no argument checks; sizes read off the shapes), so Dynamo can trace it
    (benchmarks/moe.py compiles it as its Inductor baseline)."""
    T, H = x.shape
    E, k = w13.shape[0], topk_ids.shape[1]
    acc_dtype = torch.float32
    ids = topk_ids.reshape(-1).to(torch.int64)
    ids = torch.where((ids >= 0) & (ids < E), ids, E)  # an id outside [0, E): "expert E", after all the others
    order = torch.argsort(ids, stable=True)
    expert_of_slot = ids.index_select(0, order)
    token_of_slot = torch.div(order, k, rounding_mode="floor")
    slot_weight = topk_weights.reshape(-1).index_select(0, order)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=x.device)
    counts = counts.index_add_(0, expert_of_slot, torch.ones_like(expert_of_slot))[:E]
    offs = counts.cumsum(0).to(torch.int32)
    routed = (expert_of_slot < E).unsqueeze(1)
    expert_or_last = expert_of_slot.clamp(max=E - 1)  # for the bias gathers; the unrouted slots are masked below
    xs = x.index_select(0, token_of_slot)
    if apply_router_weight_on_input:
        xs = xs * slot_weight.to(x.dtype).unsqueeze(1)
    gmm = _grouped_mm if x.dtype == torch.bfloat16 else grouped_mm_rows
    gate_up = gmm(xs, w13.transpose(1, 2), offs=offs)
    if w13_bias is not None:
        gate_up = gate_up + w13_bias.to(x.dtype).index_select(0, expert_or_last)
    y = gmm(apply_activation(gate_up, activation, activation_constants), w2.transpose(1, 2), offs=offs)
    if w2_bias is not None:
        y = y + w2_bias.to(x.dtype).index_select(0, expert_or_last)
    y = torch.where(routed, y.to(acc_dtype), 0.0)  # what the GEMMs left unwritten, NaN included, is dropped
    if not apply_router_weight_on_input:
        y = y * slot_weight.to(acc_dtype).unsqueeze(1)
    out = torch.zeros(T, H, dtype=acc_dtype, device=x.device).index_add_(0, token_of_slot, y)
    return out.to(x.dtype)


def moe_aten(*args, pdl: bool = False, placement: str = "", **kwargs) -> torch.Tensor:
    """``aten`` called like the op (its data arguments): the op's ATen form, which select_kernels traces into the
    graph."""
    return aten(MoEArgs(*args, **kwargs))


def moe_aten_declines(target: Target, *args, pdl: bool = False, placement: str = "", **kwargs) -> Optional[str]:
    """``aten_declines`` for ``target`` called like the op (its data arguments, on the node's fake values)."""
    return aten_declines(MoEArgs(*args, **kwargs), target.cc if target.is_cuda else None)


def moe_reference(*args, **kwargs) -> torch.Tensor:
    """``reference`` called like the op (its data arguments, positionally or by name)."""
    return reference(MoEArgs(*args, **kwargs))


# ------------------------------------------------------------------------------------------------
# the op
# ------------------------------------------------------------------------------------------------


@op("moe")
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
    apply_router_weight_on_input: bool = False,
    activation_constants: Optional[torch.Tensor] = None,
    w13_scale_2: Optional[torch.Tensor] = None,
    w2_scale_2: Optional[torch.Tensor] = None,
    a13_scale: Optional[torch.Tensor] = None,
    a2_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Canonical MoE; see the module docstring. ``impl`` names the kernel that runs it (ops/registry.py)."""
    args = MoEArgs(
        hidden_states,
        w13,
        w2,
        topk_weights,
        topk_ids,
        activation,
        w13_bias,
        w2_bias,
        w13_scale,
        w2_scale,
        block_shape,
        WeightLayout.decode(weight_layout),
        apply_router_weight_on_input,
        activation_constants,
        w13_scale_2,
        w2_scale_2,
        a13_scale,
        a2_scale,
    )
    return MOE.run(impl, args, Launch.decode(pdl, placement))


@moe.register_fake
def _moe_fake(
    hidden_states,
    w13,
    w2,
    topk_weights,
    topk_ids,
    activation="silu",
    w13_bias=None,
    w2_bias=None,
    w13_scale=None,
    w2_scale=None,
    block_shape=None,
    impl="reference",
    weight_layout="plain",
    pdl=False,
    placement="",
    apply_router_weight_on_input=False,
    activation_constants=None,
    w13_scale_2=None,
    w2_scale_2=None,
    a13_scale=None,
    a2_scale=None,
):
    MoEArgs(
        hidden_states,
        w13,
        w2,
        topk_weights,
        topk_ids,
        activation,
        w13_bias,
        w2_bias,
        w13_scale,
        w2_scale,
        block_shape,
        WeightLayout.decode(weight_layout),
        apply_router_weight_on_input,
        activation_constants,
        w13_scale_2,
        w2_scale_2,
        a13_scale,
        a2_scale,
    )
    return torch.empty_like(hidden_states, memory_format=torch.contiguous_format)


# ------------------------------------------------------------------------------------------------
# what kernel selection knows of a rubin.moe node
# ------------------------------------------------------------------------------------------------


def moe_spec(node: torch.fx.Node) -> KernelSpec:
    """The ``KernelSpec`` of a ``rubin.moe`` node: quantisation, dtypes, E / H / I / k (and T when static),
    the activation and the weight layout."""
    args = bound_arguments(node)
    hidden, w13, ids = (node_val(args[n]) for n in ("hidden_states", "w13", "topk_ids"))
    weight_dtype = val_dtype(args["w13"])
    block = args.get("block_shape")
    if weight_dtype.startswith("float8"):
        quant = "fp8_block" if block else "fp8_tensor"
    elif weight_dtype == "uint8":  # FP4, two values per byte; the scales' dtype says which format
        quant = fp4.kind_of(node_val(args.get("w13_scale"))) or "nvfp4"
        weight_dtype = "float4_e2m1fn_x2"
    else:
        quant = "none"
    two_i = static_size(w13, 1)
    runtime = args.get("activation_constants") is not None
    gated = activation_info(args.get("activation", "silu"), runtime_constants=runtime)[0].gated
    sizes = {
        "T": static_size(hidden, 0),
        "E": static_size(w13, 0),
        "H": static_size(hidden, 1),
        "I": (two_i // 2 if gated else two_i) if two_i is not None else None,
        "k": static_size(ids, 1),
    }
    return KernelSpec(
        op="moe",
        quant=quant,
        act_dtype=val_dtype(args["hidden_states"]),
        weight_dtype=weight_dtype,
        block_shape=tuple(block) if block else None,
        shape=tuple((k, v) for k, v in sizes.items() if v is not None),
        activation=args.get("activation"),
        node=node.name,
        weight_layout=args.get("weight_layout") or "plain",
        features=call_features(
            bool(args.get("apply_router_weight_on_input")), args.get("activation_constants") is not None
        ),
        static_input_scales=args.get("a13_scale") is not None and args.get("a2_scale") is not None,
        has_bias=args.get("w13_bias") is not None or args.get("w2_bias") is not None,
        baseline="aten",
    )


MOE = CanonicalOp(
    "moe",
    moe_spec,
    reference,
    aten_form=moe_aten,
    aten_declines=moe_aten_declines,
    aten_label="grouped GEMMs over the slots sorted by expert",
    example_shape=(("E", 128), ("H", 4096), ("I", 1536), ("k", 8)),
    example_activation="silu",
)
