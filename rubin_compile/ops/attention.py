"""The canonical attention op, ``torch.ops.rubin.attention``.

Every scaled-dot-product attention the matchers recognise (the ATen SDPA ops of every device, with or
without a mask, with native or repeated GQA heads) is rewritten into this one functional op; kernel
selection then binds it to a kernel. Its reference implementation below *is* the semantics.

Schema::

    rubin::attention(Tensor query,          # [B, Hq,  S,   D ]   bf16 / fp16 / fp32 / fp64
                     Tensor key,            # [B, Hkv, Skv, D ]   same dtype; Hq a multiple of Hkv (GQA / MQA)
                     Tensor value,          # [B, Hkv, Skv, Dv]   same dtype (Dv may differ from D, as in MLA)
                     Tensor? attn_mask=None,  # broadcastable to [B, Hq, S, Skv]: bool (True = attend) or
                                              # additive float in the query's dtype
                     bool is_causal=False,  # query i attends key j <= i (upper-left aligned, as SDPA)
                     float? scale=None,     # None: 1 / sqrt(D)
                     Tensor? k_scale=None,  # FP8 key / value only: per-tensor dequantisation scales (one
                     Tensor? v_scale=None,  #   float32 element each; None = 1)
                     Tensor? sinks=None,    # [Hq]: a logit per query head that joins the softmax's denominator
                                            #   (attention sinks, GPT-OSS); None = none
                     str impl="reference",  # which kernel runs it; chosen by select_kernels
                     bool pdl=False)        # launch with Programmatic Dependent Launch; set by chain_pdl
      -> Tensor                             # [B, Hq, S, Dv] in the query's dtype

Semantics (``torch.nn.functional.scaled_dot_product_attention`` without dropout)::

    n = Hq // Hkv;  K = key.repeat_interleave(n, dim=1);  V = value.repeat_interleave(n, dim=1)
    out = softmax(query @ K.transpose(-2, -1) * scale + M, dim=-1) @ V

where ``M`` is ``attn_mask`` (a bool mask contributes 0 / -inf) or, with ``is_causal``, the upper-left
aligned causal mask ``tril(ones(S, Skv))``. With ``sinks`` (attention sinks, as GPT-OSS writes them), query head
``h``'s softmax has one more logit, ``sinks[h]``, in its denominator and no value for it::

    x = query @ K.transpose(-2, -1) * scale + M
    out = exp(x) @ V / (exp(x).sum(-1, keepdim=True) + exp(sinks[h]))

(``softmax(cat([x, sinks]))[..., :-1] @ V``: the model's own eager code). SDPA has no such argument; the ATen
form computes it as written. Query head ``h`` reads key/value head ``h // n`` -- the grouping
of SDPA's ``enable_gqa``, of Hugging Face's ``repeat_kv`` and of vLLM / FlashInfer (``num_qo_heads`` a multiple
of ``num_kv_heads``). ``attn_mask`` and ``is_causal`` are exclusive, as in SDPA. An FP8 key / value (a
quantised KV cache: ``float8_e4m3fn`` / ``float8_e5m2`` with bf16 / fp16 queries) is first dequantised,
``K = (key.float() * k_scale).to(query.dtype)`` and likewise ``V``. A kernel whose causal mask is
aligned bottom-right (FlashInfer, FlashAttention with ``S < Skv``) must shift it or decline ``S != Skv``.

The result's memory layout is ``[B, S, Hq, Dv]`` seen as ``[B, Hq, S, Dv]`` (``out.transpose(1, 2)`` is
contiguous): the layout every fused attention kernel writes (torch's flash kernels, FlashInfer's
``[tokens, heads, dim]``), so the usual ``out.transpose(1, 2).reshape(B, S, Hq * Dv)`` after attention is
free. The fake implementation promises that layout and the reference keeps it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F

from rubin_compile.errors import RubinError
from rubin_compile.ops.nodes import FLOAT_DTYPES, bound_arguments, known_sizes, tensor_val, val_dtype
from rubin_compile.ops.registry import CanonicalOp, KernelSpec, Launch
from rubin_compile.ops.library import op


# A quantised KV cache: keys / values in FP8 with bf16 / fp16 queries (dequantised by per-tensor scales).
KV_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_HALF = (torch.bfloat16, torch.float16)
# The optional semantics a kernel must declare (``Kernel.features``) to be given a call with ``sinks``.
SINKS = "attention_sinks"


class AttentionArgumentError(RubinError, ValueError):
    """Raised when the arguments of ``rubin.attention`` do not describe a valid attention call."""


def _fail(msg: str) -> None:
    raise AttentionArgumentError(f"rubin.attention: {msg}")


@dataclass(frozen=True)
class AttentionArgs:
    """The data arguments of one ``rubin.attention`` call (the schema's, in its order, without ``impl``),
    validated when built; ``B, Hq, Hkv, S, Skv, D, Dv`` are read off the shapes. Errors name the argument and
    the fix (``AttentionArgumentError``)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: Optional[torch.Tensor] = None
    is_causal: bool = False
    scale: Optional[float] = None
    k_scale: Optional[torch.Tensor] = None
    v_scale: Optional[torch.Tensor] = None
    sinks: Optional[torch.Tensor] = None
    B: Any = field(init=False)
    Hq: Any = field(init=False)
    Hkv: Any = field(init=False)
    S: Any = field(init=False)
    Skv: Any = field(init=False)
    D: Any = field(init=False)
    Dv: Any = field(init=False)

    def __post_init__(self) -> None:
        for name, value in zip(("B", "Hq", "Hkv", "S", "Skv", "D", "Dv"), _validate(self)):
            object.__setattr__(self, name, value)

    @property
    def features(self) -> tuple[str, ...]:
        """The op's optional semantics this call uses (``Kernel.features``): ``"attention_sinks"`` with ``sinks``."""
        return (SINKS,) if self.sinks is not None else ()


def _validate(a: AttentionArgs) -> tuple:
    """(B, Hq, Hkv, S, Skv, D, Dv) of valid arguments; ``AttentionArgumentError`` otherwise."""
    query, key, value, attn_mask = a.query, a.key, a.value, a.attn_mask
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            _fail(f"{name} must be 4-D [B, H, S, D], got shape {tuple(t.shape)}; add a batch dimension")
    if query.dtype not in FLOAT_DTYPES:
        _fail(f"query dtype {query.dtype} is not one of bf16 / fp16 / fp32 / fp64")
    if key.dtype in KV_FP8_DTYPES or value.dtype in KV_FP8_DTYPES:
        if key.dtype != value.dtype or query.dtype not in _HALF:
            _fail(
                f"an FP8 KV cache needs key and value in one FP8 dtype and a bf16 / fp16 query; got query "
                f"{query.dtype}, key {key.dtype}, value {value.dtype}"
            )
    elif key.dtype != query.dtype or value.dtype != query.dtype:
        _fail(f"query, key and value must share one dtype; got {query.dtype}, {key.dtype}, {value.dtype}")
    for name in ("k_scale", "v_scale"):
        t = getattr(a, name)
        if t is None:
            continue
        if key.dtype not in KV_FP8_DTYPES:
            _fail(f"{name} is for an FP8 key / value; key is {key.dtype}: pass {name}=None")
        if t.dtype != torch.float32 or (known_sizes(t.numel()) and t.numel() != 1):
            _fail(f"{name} must be one float32 element (a per-tensor scale), got {t.dtype} {tuple(t.shape)}")
    B, Hq, S, D = query.shape
    Bk, Hkv, Skv, Dk = key.shape
    Bv, Hv, Sv, Dv = value.shape
    if known_sizes(B, Bk, Bv) and not B == Bk == Bv:
        _fail(f"batch sizes differ: query {B}, key {Bk}, value {Bv}")
    if known_sizes(Hkv, Hv) and Hkv != Hv:
        _fail(f"key has {Hkv} heads but value has {Hv}")
    if known_sizes(Skv, Sv) and Skv != Sv:
        _fail(f"key has {Skv} positions but value has {Sv}")
    if known_sizes(D, Dk) and D != Dk:
        _fail(f"query head dim {D} differs from key head dim {Dk}")
    if known_sizes(Hq, Hkv) and (Hkv == 0 or Hq % Hkv):
        _fail(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    if attn_mask is not None:
        if a.is_causal:
            _fail("attn_mask and is_causal=True are exclusive (as in SDPA); fold the causal mask into attn_mask")
        if attn_mask.dtype != torch.bool and attn_mask.dtype != query.dtype:
            _fail(f"attn_mask must be bool or the query's dtype {query.dtype}, got {attn_mask.dtype}")
        if attn_mask.dim() > 4:
            _fail(f"attn_mask must broadcast to [B, Hq, S, Skv]; got shape {tuple(attn_mask.shape)}")
        full = (B, Hq, S, Skv)[4 - attn_mask.dim() :]
        for have, want in zip(attn_mask.shape, full):
            if known_sizes(have, want) and have not in (1, want):
                _fail(
                    f"attn_mask shape {tuple(attn_mask.shape)} does not broadcast to [B, Hq, S, Skv] = "
                    f"{(B, Hq, S, Skv)}"
                )
    if a.sinks is not None:
        sinks = a.sinks
        if sinks.dim() != 1 or (known_sizes(sinks.shape[0], Hq) and sinks.shape[0] != Hq):
            _fail(f"sinks must be 1-D with a logit per query head ([Hq] = [{Hq}]), got shape {tuple(sinks.shape)}")
        if sinks.dtype not in FLOAT_DTYPES:
            _fail(f"sinks must be a float tensor (bf16 / fp16 / fp32 / fp64), got {sinks.dtype}")
    if a.scale is not None and not (isinstance(a.scale, (int, float)) and math.isfinite(a.scale)):
        _fail(f"scale must be a finite float or None, got {a.scale!r}")
    return B, Hq, Hkv, S, Skv, D, Dv


def _output_like(query: torch.Tensor, dv) -> torch.Tensor:
    """An empty [B, Hq, S, Dv] tensor laid out as [B, S, Hq, Dv] (see the module docstring)."""
    B, Hq, S, _ = query.shape
    return query.new_empty((B, S, Hq, dv)).transpose(1, 2)


# ------------------------------------------------------------------------------------------------
# the ATen form, and the semantics
# ------------------------------------------------------------------------------------------------


def dequantized(t: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """An FP8 key / value in the query's ``dtype``: ``(t.float() * scale).to(dtype)``; other tensors as they are."""
    if t.dtype not in KV_FP8_DTYPES:
        return t
    t = t.to(torch.float32)
    return (t if scale is None else t * scale.reshape(())).to(dtype)


def aten(args: AttentionArgs, launch: Launch = Launch()) -> torch.Tensor:
    """``rubin.attention`` as ATen ops: an FP8 key / value dequantised, key / value heads repeated as Hugging
    Face's ``repeat_kv`` does (expand + reshape), then SDPA. select_kernels lowers a node bound to ``torch`` or ``reference`` into
    these, so Inductor lowers the attention itself -- its SDPA backend choice, its mask padding for the
    memory-efficient kernel, its fusion of the repeat -- as it does without rubin (as an extern call it
    ran ATen's math-backend and copy kernels where Inductor alone runs fused ones: docs/pdl_locality.md).
    The result has SDPA's own layout, not the op's promised one; the graph's users are re-lowered with it."""
    query = args.query
    key = dequantized(args.key, args.k_scale, query.dtype)
    value = dequantized(args.value, args.v_scale, query.dtype)
    B, Hq, Hkv, Skv, D, Dv = args.B, args.Hq, args.Hkv, args.Skv, args.D, args.Dv
    if Hq != Hkv:
        n = Hq // Hkv
        key = key[:, :, None].expand(B, Hkv, n, Skv, D).reshape(B, Hq, Skv, D)
        value = value[:, :, None].expand(B, Hkv, n, Skv, Dv).reshape(B, Hq, Skv, Dv)
    if args.sinks is not None:
        return _with_sinks(query, key, value, args)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=args.attn_mask, dropout_p=0.0, is_causal=args.is_causal, scale=args.scale
    )


def _with_sinks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args: AttentionArgs) -> torch.Tensor:
    """An attention with sinks as the models' eager code writes it, in the query's dtype (SDPA takes no sinks): the
    scaled scores plus the mask, each head's sink logit concatenated as one more column, the row maximum
    subtracted, the softmax, that column dropped, times the values. A row whose every position is masked gives zeros (its sink takes all the weight)."""
    scale = args.scale if args.scale is not None else 1.0 / math.sqrt(args.D)
    x = torch.matmul(query, key.transpose(-2, -1)) * scale
    mask = args.attn_mask
    if mask is None and args.is_causal:
        mask = torch.ones(args.S, args.Skv, dtype=torch.bool, device=query.device).tril()
    if mask is not None:
        x = x.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else x + mask
    sinks = args.sinks.to(x.dtype).reshape(1, -1, 1, 1).expand(x.shape[0], -1, x.shape[2], 1)
    c = torch.cat([x, sinks], dim=-1)
    c = c - c.max(dim=-1, keepdim=True).values  # as GPT-OSS's eager code: the same roundings in bf16 / fp16
    probs = torch.softmax(c, dim=-1, dtype=c.dtype)[..., :-1]
    return torch.matmul(probs, value)


def attention_aten(*args, pdl: bool = False, **kwargs) -> torch.Tensor:
    """``aten`` called like the op: the op's ATen form, which select_kernels traces into the graph."""
    return aten(AttentionArgs(*args, **kwargs))


def reference(args: AttentionArgs, launch: Launch = Launch()) -> torch.Tensor:
    """Plain PyTorch semantics of ``rubin.attention`` (see the module docstring); any device: the ATen form
    (heads repeated explicitly, which every SDPA backend accepts; on the CPU SDPA then runs the same flash
    kernel eager PyTorch runs for the source graph, so a rewrite keeps eager numerics), written into the op's
    promised layout."""
    result = _output_like(args.query, args.Dv)
    result.copy_(aten(args))
    return result


def attention_reference(*args, pdl: bool = False, **kwargs) -> torch.Tensor:
    """``reference`` called like the op (its data arguments, positionally or by name)."""
    return reference(AttentionArgs(*args, **kwargs))


# ------------------------------------------------------------------------------------------------
# the op
# ------------------------------------------------------------------------------------------------


@op("attention")
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    impl: str = "reference",
    pdl: bool = False,
) -> torch.Tensor:
    """Canonical attention; see the module docstring. ``impl`` names the kernel (ops/registry.py); ``pdl`` says
    how it is launched, never what it computes."""
    args = AttentionArgs(query, key, value, attn_mask, is_causal, scale, k_scale, v_scale, sinks)
    return ATTENTION.run(impl, args, Launch(pdl=pdl))


@attention.register_fake
def _attention_fake(
    query,
    key,
    value,
    attn_mask=None,
    is_causal=False,
    scale=None,
    k_scale=None,
    v_scale=None,
    sinks=None,
    impl="reference",
    pdl=False,
):
    args = AttentionArgs(query, key, value, attn_mask, is_causal, scale, k_scale, v_scale, sinks)
    return _output_like(query, args.Dv)


# ------------------------------------------------------------------------------------------------
# what kernel selection knows of a rubin.attention node
# ------------------------------------------------------------------------------------------------


def masking(node: torch.fx.Node) -> str:
    """``"causal"``, ``"mask"`` (an explicit bool or additive mask) or ``"none"`` for a ``rubin.attention`` node."""
    args = bound_arguments(node)
    if args.get("attn_mask") is not None:
        return "mask"
    return "causal" if args.get("is_causal") else "none"


def attention_spec(node: torch.fx.Node) -> KernelSpec:
    """The ``KernelSpec`` of a ``rubin.attention`` node.

    ``quant`` is ``"fp8_tensor"`` for an FP8 key / value (a quantised KV cache), else ``"none"``; ``act_dtype`` is the
    query's dtype and ``weight_dtype`` the key/value dtype (the "KV cache" of the registry's attention rows);
    ``shape`` holds ``D`` (the head dim the registry checks) and, when static, ``Dv``, ``Hq``, ``Hkv``, ``S``,
    ``Skv`` and ``B``; ``activation`` carries the masking (``"causal"``, ``"mask"``, or ``None`` for none), so a
    kernel without arbitrary masks (trtllm-gen) can decline ``"mask"``; ``features`` holds ``"attention_sinks"``
    for a node with ``sinks``, which only kernels declaring it are given.
    """
    args = bound_arguments(node)
    q, k, v = (tensor_val(args[n]) for n in ("query", "key", "value"))
    sizes = {}
    if q is not None and k is not None and v is not None:
        sizes = {
            "D": q.shape[3],
            "Dv": v.shape[3],
            "Hq": q.shape[1],
            "Hkv": k.shape[1],
            "S": q.shape[2],
            "Skv": k.shape[2],
            "B": q.shape[0],
        }
    kind = masking(node)
    return KernelSpec(
        op="attention",
        quant="fp8_tensor" if k is not None and k.dtype in KV_FP8_DTYPES else "none",
        act_dtype=val_dtype(args["query"]),
        weight_dtype=val_dtype(args["key"]),
        shape=tuple((n, s) for n, s in sizes.items() if isinstance(s, int)),
        activation=None if kind == "none" else kind,
        node=node.name,
        features=(SINKS,) if args.get("sinks") is not None else (),
    )


ATTENTION = CanonicalOp(
    "attention",
    attention_spec,
    reference,
    aten_form=attention_aten,
    aten_label="repeat_kv + SDPA",
    example_shape=(("D", 128),),
)
