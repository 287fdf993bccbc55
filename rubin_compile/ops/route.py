"""The canonical routing op, ``torch.ops.rubin.route``: an MoE router, from the hidden states to the
``(topk_weights, topk_ids)`` a ``rubin.moe`` reads.

passes/match_routing.py rewrites the routing idioms that passes/match_moe/routing.py describes (router projection,
softmax or sigmoid, a score-correction bias, group-limited top-k, renormalisation, a routed scaling factor) into
this op where a routing kernel takes it (kernels/triton/route.py at decode); its reference below *is* the
semantics.

Schema::

    rubin::route(Tensor hidden_states,          # [T, H]  bf16 / fp16 / fp32
                 Tensor router_weight,          # [E, H]  bf16 / fp16 / fp32 (mixed dtypes multiply in float32)
                 int top_k,
                 str scoring="softmax",         # "softmax" | "sigmoid"
                 str order="score_then_topk",   # | "topk_then_softmax" (GPT-OSS)
                 bool renormalize=False,
                 float renorm_eps=0.0,          # w / (sum + eps), or with renorm_floor w / max(sum, eps)
                 bool renorm_floor=False,
                 Tensor? router_bias=None,      # [E]  added to the logits
                 Tensor? correction_bias=None,  # [E]  added to the scores for the choice only (DeepSeek-V3)
                 int n_group=1,                 # group-limited top-k: E / n_group experts per group,
                 int topk_group=1,              #   the topk_group best groups kept
                 str group_fill="-inf",         # what the dropped groups' experts are set to: "-inf" | "0"
                 float scale=1.0,               # routed scaling factor
                 Tensor? scale_tensor=None,     # or a 0-d tensor (a run-time value under dynamic=True: Dynamo
                                                #   passes a float attribute as a 0-d CPU tensor, read on the host)
                 ScalarType? logits_dtype=None, # the logits rounded to this dtype (the source graph's router
                                                #   output dtype: bf16 for a bf16 nn.Linear) before scoring
                 ScalarType weights_dtype=float32,
                 bool pdl=False,                # set by chain_pdl
                 str impl="reference")          # set by select_kernels
      -> (Tensor topk_weights [T, k] weights_dtype, Tensor topk_ids [T, k] int32)

Semantics::

    logits = x.float() @ W.float().T (+ router_bias)     [.to(logits_dtype).float()]
    order "score_then_topk":
        scores = softmax(logits) | sigmoid(logits);   sel = scores (+ correction_bias)
        n_group > 1: a group's score is the sum of its two largest sel values; the topk_group best groups are
            kept; the other groups' experts get sel = group_fill
        ids = top-k of sel;   w = scores[ids]                      (the unbiased scores)
    order "topk_then_softmax":  ids = top-k of logits;   w = softmax(logits[ids])
    renormalize:  w = w / (w.sum(-1) + renorm_eps)   or   w / max(w.sum(-1), renorm_eps)   (renorm_floor)
    w = (w * scale_tensor or scale).to(weights_dtype)

Tie rule: equal values are resolved towards the **lower id**, for experts and groups alike, and a token's k ids
are listed in descending value order (equal values: lower id first). ``torch.topk`` promises neither, so the
source graph and this op can differ where two selection values are equal (docs/kernels/routing.md); everything
else agrees within float32 rounding (the logits are summed in another order than cuBLAS sums them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from rubin_compile.errors import RubinError
from rubin_compile.ops.nodes import bound_arguments, tensor_val, val_dtype
from rubin_compile.ops.registry import CanonicalOp, KernelSpec, Launch
from rubin_compile.ops.library import op

SCORINGS = ("softmax", "sigmoid")
ORDERS = ("score_then_topk", "topk_then_softmax")
GROUP_FILLS = ("-inf", "0")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class RouteArgumentError(RubinError, ValueError):
    """Raised when the arguments of a routing call are not valid (or exceed a kernel's limits)."""


def _fail(msg: str) -> None:
    raise RouteArgumentError(f"rubin.route: {msg}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class RouteArgs:
    """The data arguments of one ``rubin.route`` call (the schema's, without ``pdl`` / ``impl``), validated when
    built; ``T, H, E`` are read off the shapes. Errors name the argument and the fix (``RouteArgumentError``).
    Works on fake tensors with a symbolic T."""

    hidden_states: torch.Tensor
    router_weight: torch.Tensor
    top_k: int
    scoring: str = "softmax"
    order: str = "score_then_topk"
    renormalize: bool = False
    renorm_eps: float = 0.0
    renorm_floor: bool = False
    router_bias: Optional[torch.Tensor] = None
    correction_bias: Optional[torch.Tensor] = None
    n_group: int = 1
    topk_group: int = 1
    group_fill: str = "-inf"
    scale: float = 1.0
    scale_tensor: Optional[torch.Tensor] = None
    logits_dtype: Optional[torch.dtype] = None
    weights_dtype: torch.dtype = torch.float32
    T: Any = field(init=False)
    H: int = field(init=False)
    E: int = field(init=False)

    def __post_init__(self) -> None:
        for name, value in zip(("T", "H", "E"), _validate(self)):
            object.__setattr__(self, name, value)


def _validate(a: RouteArgs) -> tuple[Any, int, int]:
    x, w = a.hidden_states, a.router_weight
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        _fail(f"hidden_states must be a 2-D [T, H] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        _fail(f"router_weight must be a 2-D [E, H] tensor, got {getattr(w, 'shape', type(w).__name__)}")
    T, H = x.shape
    E = w.shape[0]
    if w.shape[1] != H:
        _fail(f"router_weight is {tuple(w.shape)} but hidden_states has H={H} (router_weight must be [E, H])")
    for name, t in (("hidden_states", x), ("router_weight", w)):
        if t.dtype not in DTYPES:
            _fail(f"{name} dtype {t.dtype} is not supported (bfloat16, float16 or float32)")
    for name, b in (("router_bias", a.router_bias), ("correction_bias", a.correction_bias)):
        if b is None:
            continue
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != (E,):
            _fail(f"{name} must be a [E] = [{E}] tensor, got {getattr(b, 'shape', type(b).__name__)}")
        if b.dtype not in DTYPES:
            _fail(f"{name} dtype {b.dtype} is not supported (bfloat16, float16 or float32)")
        if b.device != x.device:
            _fail(f"{name} is on {b.device}, hidden_states on {x.device}")
    if w.device != x.device:
        _fail(f"router_weight is on {w.device}, hidden_states on {x.device}")
    if a.scoring not in SCORINGS:
        _fail(f"scoring={a.scoring!r} is not one of {SCORINGS}")
    if a.order not in ORDERS:
        _fail(f"order={a.order!r} is not one of {ORDERS}")
    if a.group_fill not in GROUP_FILLS:
        _fail(f"group_fill={a.group_fill!r} is not one of {GROUP_FILLS}")
    k, n_group, topk_group = a.top_k, a.n_group, a.topk_group
    if not _is_int(k) or k < 1:
        _fail(f"top_k must be a positive int, got {k!r}")
    if k > E:
        _fail(f"top_k={k} is larger than the number of experts E={E}")
    if not _is_int(n_group) or n_group < 1:
        _fail(f"n_group must be a positive int, got {n_group!r}")
    if E % n_group:
        _fail(f"n_group={n_group} does not divide the number of experts E={E}")
    if n_group > 1:
        if E // n_group < 2:
            _fail(f"n_group={n_group} leaves {E // n_group} expert per group; group scores sum the top 2 of each")
        if not _is_int(topk_group) or not 1 <= topk_group <= n_group:
            _fail(f"topk_group={topk_group!r} must be an int in [1, n_group={n_group}]")
        if k > topk_group * (E // n_group):
            _fail(f"top_k={k} is larger than the {topk_group * (E // n_group)} experts of the {topk_group} groups kept")
    if a.order == "topk_then_softmax":
        if a.scoring != "softmax":
            _fail("order='topk_then_softmax' takes scoring='softmax' (the softmax over the k selected logits)")
        if a.correction_bias is not None or n_group > 1:
            _fail("order='topk_then_softmax' takes no correction_bias and n_group=1 (GPT-OSS's routing)")
    if isinstance(a.renorm_eps, bool) or not isinstance(a.renorm_eps, (int, float)) or a.renorm_eps < 0:
        _fail(f"renorm_eps must be a float >= 0, got {a.renorm_eps!r}")
    if isinstance(a.scale, bool) or not isinstance(a.scale, (int, float)):
        _fail(f"scale must be a float (or pass a 0-d tensor as scale_tensor), got {type(a.scale).__name__}")
    s = a.scale_tensor
    if s is not None:
        if not isinstance(s, torch.Tensor) or s.dim() != 0 or not s.is_floating_point():
            _fail(f"scale_tensor must be a 0-d float tensor, got {getattr(s, 'shape', type(s).__name__)}")
        if s.device != x.device and s.device.type != "cpu":  # a CPU scalar (Dynamo's wrapped float) is read on the host
            _fail(f"scale_tensor is on {s.device}, hidden_states on {x.device}")
        if a.scale != 1.0:
            _fail(f"give scale ({a.scale}) or scale_tensor, not both")
    for name in ("logits_dtype", "weights_dtype"):
        d = getattr(a, name)
        if d is not None and d not in DTYPES:
            _fail(f"{name}={d} is not one of bfloat16, float16, float32")
    if a.weights_dtype is None:
        _fail("weights_dtype must be a dtype (bfloat16, float16 or float32)")
    return T, H, E


# ------------------------------------------------------------------------------------------------
# the semantics
# ------------------------------------------------------------------------------------------------


def topk_lower_id(v: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values along the last dim and their indices, descending; equal values: lower index first
    (a stable sort keeps equal elements in index order, descending or not)."""
    vals, idx = torch.sort(v, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


def logits_of(a: RouteArgs) -> torch.Tensor:
    """The router's float32 logits [T, E] (rounded through ``logits_dtype`` when given)."""
    logits = a.hidden_states.float() @ a.router_weight.float().t()
    if a.router_bias is not None:
        logits = logits + a.router_bias.float()
    if a.logits_dtype is not None:
        logits = logits.to(a.logits_dtype).float()
    return logits


def reference(a: RouteArgs, launch: Launch = Launch()) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch semantics of ``rubin.route`` (the module docstring), any T / E / H / k, any device:
    ``(topk_weights [T, k] weights_dtype, topk_ids [T, k] int32)``."""
    T, E, k = a.T, a.E, a.top_k
    logits = logits_of(a)
    if a.order == "topk_then_softmax":
        top, ids = topk_lower_id(logits, k)
        w = torch.softmax(top, dim=-1)
    else:
        scores = torch.softmax(logits, dim=-1) if a.scoring == "softmax" else torch.sigmoid(logits)
        sel = scores if a.correction_bias is None else scores + a.correction_bias.float()
        if a.n_group > 1:
            per = E // a.n_group
            group_scores = topk_lower_id(sel.view(T, a.n_group, per), 2)[0].sum(-1)
            kept = topk_lower_id(group_scores, a.topk_group)[1]
            keep = torch.zeros((T, a.n_group), dtype=torch.bool, device=sel.device).scatter_(1, kept, True)
            fill = float("-inf") if a.group_fill == "-inf" else 0.0
            sel = sel.masked_fill(~keep.repeat_interleave(per, dim=1), fill)
        ids = topk_lower_id(sel, k)[1]
        w = scores.gather(1, ids)
    if a.renormalize:
        s = w.sum(-1, keepdim=True)
        w = w / (s.clamp_min(a.renorm_eps) if a.renorm_floor else s + a.renorm_eps)
    w = w * (a.scale_tensor.float() if a.scale_tensor is not None else float(a.scale))
    return w.to(a.weights_dtype).contiguous(), ids.to(torch.int32).contiguous()


# ------------------------------------------------------------------------------------------------
# the op
# ------------------------------------------------------------------------------------------------


@op("route")
def route(
    hidden_states: torch.Tensor,
    router_weight: torch.Tensor,
    top_k: int,
    scoring: str = "softmax",
    order: str = "score_then_topk",
    renormalize: bool = False,
    renorm_eps: float = 0.0,
    renorm_floor: bool = False,
    router_bias: Optional[torch.Tensor] = None,
    correction_bias: Optional[torch.Tensor] = None,
    n_group: int = 1,
    topk_group: int = 1,
    group_fill: str = "-inf",
    scale: float = 1.0,
    scale_tensor: Optional[torch.Tensor] = None,
    logits_dtype: Optional[torch.dtype] = None,
    weights_dtype: torch.dtype = torch.float32,
    pdl: bool = False,
    impl: str = "reference",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical MoE routing; see the module docstring. ``impl`` names the kernel (ops/registry.py)."""
    args = RouteArgs(
        hidden_states, router_weight, top_k, scoring, order, renormalize, renorm_eps, renorm_floor, router_bias,
        correction_bias, n_group, topk_group, group_fill, scale, scale_tensor, logits_dtype, weights_dtype,
    )  # fmt: skip
    return ROUTE.run(impl, args, Launch(bool(pdl)))


@route.register_fake
def _route_fake(
    hidden_states,
    router_weight,
    top_k,
    scoring="softmax",
    order="score_then_topk",
    renormalize=False,
    renorm_eps=0.0,
    renorm_floor=False,
    router_bias=None,
    correction_bias=None,
    n_group=1,
    topk_group=1,
    group_fill="-inf",
    scale=1.0,
    scale_tensor=None,
    logits_dtype=None,
    weights_dtype=torch.float32,
    pdl=False,
    impl="reference",
):
    a = RouteArgs(
        hidden_states, router_weight, top_k, scoring, order, renormalize, renorm_eps, renorm_floor, router_bias,
        correction_bias, n_group, topk_group, group_fill, scale, scale_tensor, logits_dtype, weights_dtype,
    )  # fmt: skip
    x = a.hidden_states
    return x.new_empty((a.T, a.top_k), dtype=a.weights_dtype), x.new_empty((a.T, a.top_k), dtype=torch.int32)


# ------------------------------------------------------------------------------------------------
# what kernel selection knows of a rubin.route node
# ------------------------------------------------------------------------------------------------


def idiom_label(args: dict[str, Any]) -> str:
    """``"softmax_then_topk"``, ``"sigmoid_then_topk, 8 groups keep 4"``, ``"topk_then_softmax"``: the routing a
    node computes, for plans and reports."""
    label = "topk_then_softmax" if args.get("order") == "topk_then_softmax" else f"{args.get('scoring')}_then_topk"
    if (args.get("n_group") or 1) > 1:
        label += f", {args['n_group']} groups keep {args.get('topk_group')}"
    return label


def route_spec(node: torch.fx.Node) -> KernelSpec:
    """The ``KernelSpec`` of a ``rubin.route`` node: ``act_dtype`` the hidden states', ``weight_dtype`` the router
    weight's; ``shape`` ``E, H, k`` (and ``T`` when static); ``activation`` the routing idiom (``idiom_label``)."""
    args = bound_arguments(node)
    x, w = tensor_val(args["hidden_states"]), tensor_val(args["router_weight"])
    sizes: dict[str, Any] = {"k": args["top_k"]}
    if x is not None and w is not None:
        sizes.update(E=w.shape[0], H=w.shape[1], T=x.shape[0])
    return KernelSpec(
        op="route",
        quant="none",
        act_dtype=val_dtype(args["hidden_states"]),
        weight_dtype=val_dtype(args["router_weight"]),
        shape=tuple((n, s) for n, s in sizes.items() if isinstance(s, int)),
        activation=idiom_label(args),
        node=node.name,
    )


ROUTE = CanonicalOp(
    "route",
    route_spec,
    reference,
    example_shape=(("E", 128), ("H", 2048), ("k", 8)),
    example_activation="softmax_then_topk",
)
