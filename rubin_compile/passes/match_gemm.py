"""match_gemm: rewrite linear layers, with their epilogues, into ``rubin.gemm``.

Idioms rewritten, as post-grad ATen gives them (torch 2.13; ``W`` is a weight, a graph input)::

    # nn.Linear / F.linear (plain PyTorch; every Hugging Face projection; vLLM's unquantised linear on GPUs)
    y = aten.mm(x, aten.permute(W, [1, 0]))                           # no bias
    y = aten.addmm(bias, x, aten.permute(W, [1, 0]))                  # with bias
    y = aten.add(aten.mm(x, aten.permute(W, [1, 0])), bias)           # Inductor's unfuse_bias_add_to_pointwise
    # FP8 (vLLM's per-tensor / per-token FP8 linear on GPUs; torchao float8 inference)
    y = aten._scaled_mm(x_fp8, aten.permute(W_fp8, [1, 0]), scale_a, scale_b, bias, out_dtype=bf16)

each optionally followed -- through the ``reshape`` back to ``[B, S, N]`` that a 3-D input adds -- by one
epilogue:

    # SiLU-and-mul of a merged gate_up projection: vLLM's MergedColumnParallelLinear + SiluAndMul
    # (forward_native: silu(x[..., :d]) * x[..., d:]); HF Phi-3 / GLM fused gate_up_proj with chunk(2)
    g, u = aten.split(y, N // 2, -1)  (or aten.slice(y, -1, 0, N // 2), aten.slice(y, -1, N // 2))
    out = aten.mul(div(g, add(exp(neg(g)), 1)), u)        # SiLU as Inductor decomposes it (bf16: upcast)
    out = aten.mul(u, ...)                                # either order (Phi-3 writes up * act(gate))
    # GELU-tanh-and-mul (vLLM GeluAndMul("tanh"), Gemma's gated MLP) in the same two forms
    # residual add: every decoder layer's ``hidden = residual + o_proj(attn)`` / ``+ down_proj(mlp)``
    out = aten.add(residual, aten.reshape(y, [B, S, N]))  # or an addmm whose "bias" is [M, N]

The epilogues are recognised with Inductor's pattern matcher, from patterns traced out of the plain
functions (``silu(gate) * up`` and so on) with Inductor's own decompositions, so they follow whatever form
the decomposition gives; the products themselves are single nodes, read by hand, because each needs checks
with a reason (which operand is a weight, which epilogue follows, what else reads the product).

Which matrix products are rewritten, and why (every rewritten product becomes one extern kernel call, as
``aten.mm`` already is under Inductor's default lowering; on the CPU target it runs the reference, i.e.
``torch.mm`` / ``torch.addmm``, so numerics stay eager's):

- **Linear layers** -- ``b`` is a weight (a graph input, seen through ``permute`` / ``t`` / ``reshape``):
  rewritten. These are where the target's kernels differ (cuBLAS, FlashInfer CUTLASS / cuDNN / CuTe-DSL,
  FP8 and FP4 GEMMs) and where PDL and locality placement apply.
- **Epilogues** fold into the op only where nothing else reads what they consume; otherwise the product is
  rewritten alone, the epilogue stays ATen (Inductor fuses it) and the report says why it was not folded
  (that entry is "left unchanged": strict mode fails on it).
- **The MoE router** (``N = E``, its output feeding ``topk`` / ``softmax`` or an MoE op's ``router_logits``):
  left to Inductor. It is a tiny GEMM whose consumer is routing, which stays as ATen ops that Inductor fuses
  (match_moe only describes it); a fused-routing MoE kernel, not a GEMM kernel, is what would absorb it.
- **Products of two activations** (attention written by hand, ``x @ y``), and weights computed in the graph
  (dequantised in-graph, where Inductor fuses the dequantisation into its GEMM prologue): left to Inductor.
- **MoE experts** that match_moe rewrote are inside opaque ``rubin.moe`` / ``rubin.vllm_moe_layer`` nodes:
  there is no ``mm`` left to count twice. ``bmm`` / grouped mms are not linear layers and are not touched.
- **vLLM's CPU linear** (``_C.onednn_mm``: the weight prepacked into a oneDNN handle and removed from the
  layer) and vLLM's GPU FP8 ``_C.cutlass_scaled_mm``: kept, with a note -- the weight is not a graph tensor
  rubin could pass on (onednn) or the kernel is vLLM's own choice.

These policy skips are notes, not "left unchanged": leaving them to Inductor is the decision, not a miss.
Left unchanged, with the reason: ``addmm`` with ``alpha`` / ``beta``, ``_scaled_mm`` with an FP8 output,
``scale_result`` or scales other than per tensor / per row / per column, an epilogue some other node also reads.
"""

from __future__ import annotations

import collections
import functools
import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F

from rubin_compile.ops.gemm import FP8_OUT_DTYPES, GATED, GemmArgs, GemmArgumentError, scale_kind
from rubin_compile.ops.nodes import bound_arguments
from rubin_compile.passes.base import Pass, PassContext, PassResult, Rewrite, Unchanged
from rubin_compile.passes.fx import (
    FLOAT_DTYPES,
    FP8_DTYPES,
    RESHAPES,
    call,
    called_op,
    decode_mutating_call,
    dtype_name,
    inherit_source,
    is_call,
    report_value,
    same_shape,
    schema_name,
    single_user,
    tensor_val,
)

NAME = "match_gemm"
IDIOM = "linear"

aten = torch.ops.aten
prims = torch.ops.prims

CORES: dict[Any, str] = {
    aten.mm.default: "aten.mm",
    aten.addmm.default: "aten.addmm",
    aten._scaled_mm.default: "aten._scaled_mm",
}
_WEIGHT_VIEWS = (aten.permute.default, aten.t.default, aten.transpose.int) + RESHAPES
# Ops a router's logits pass through on their way to top-k (routing.py's idioms): anything else ends the search.
_MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten._scaled_mm.default, aten.baddbmm.default)

# vLLM linear ops kept as they are (vllm/_custom_ops.py, vLLM 0.32), and why.
VLLM_LINEAR_OPS: dict[str, str] = {
    "_C::onednn_mm": "vLLM's CPU linear: the weight is prepacked into a oneDNN handle and removed from the layer, "
    "so there is no weight tensor in the graph to pass to rubin.gemm",
    "_C::onednn_scaled_mm": "vLLM's CPU int8 linear through a oneDNN handle (no weight tensor in the graph)",
    "_C::weight_packed_linear": "vLLM's CPU small-GEMM (sgl) linear on a prepacked weight",
    "_C::cutlass_scaled_mm": "vLLM's CUTLASS FP8 / int8 linear (vLLM's own kernel choice)",
}


# --------------------------------------------------------------------------------------------------
# epilogue patterns
# --------------------------------------------------------------------------------------------------


def _act(name: str):
    return F.silu if name == "silu" else functools.partial(F.gelu, approximate="tanh")


def _gated(name: str, split: str, up_first: bool):
    """``act(gate) * up`` over the two halves of ``x``'s last dim; traced into a pattern below."""

    def fn(x):
        if split == "split":
            gate, up = x.chunk(2, -1)
        else:
            half = x.shape[-1] // 2
            gate, up = x[..., :half], x[..., half:]
        return up * _act(name)(gate) if up_first else _act(name)(gate) * up

    return fn


def _constants(nodes) -> list[float]:
    """The non-integer Python numbers among the arguments of ``nodes``, sorted: generated patterns ignore
    scalars, so a match is checked against the pattern's own (the GELU-tanh coefficients, SiLU's 1)."""
    out = []
    for n in nodes:
        if (
            n.op != "call_function"
            or n.target is operator.getitem
            or n.target in (aten.split.Tensor, aten.slice.Tensor)
        ):
            continue  # split sizes and slice bounds depend on N; they are checked by _half
        for a in list(n.args) + list(n.kwargs.values()):
            if isinstance(a, (int, float)) and not isinstance(a, bool):
                out.append(float(a))
    return sorted(out)


@functools.lru_cache(maxsize=None)
def _gated_patterns(low_precision: bool) -> tuple:
    """(epilogue, pattern, constants) for every form of the gated epilogues: SiLU / GELU-tanh, split or
    slice halves, either operand order; bf16 / fp16 add upcasts around the activation (low_precision)."""
    from torch._inductor.pattern_matcher import fwd_only, gen_pattern_and_search_gm

    dtype = torch.bfloat16 if low_precision else torch.float32
    out = []
    for epilogue, act in GATED.items():
        for split in ("split", "slice"):
            for up_first in (False, True):
                pattern, gm = gen_pattern_and_search_gm(
                    _gated(act, split, up_first), [torch.empty(4, 8, dtype=dtype)], fwd_only
                )
                out.append((epilogue, pattern, _constants(gm.graph.nodes)))
    return tuple(out)


# --------------------------------------------------------------------------------------------------
# reading one product
# --------------------------------------------------------------------------------------------------


class _NoMatch(Exception):
    """The product cannot become rubin.gemm; the message says why."""


class _Policy(Exception):
    """The product is left to Inductor by policy; the message says which kind (for the notes)."""


@dataclass
class _Gemm:
    core: torch.fx.Node
    form: str
    a: torch.fx.Node
    b: torch.fx.Node
    bias: Optional[torch.fx.Node] = None
    residual: Optional[torch.fx.Node] = None
    a_scale: Optional[torch.fx.Node] = None
    b_scale: Optional[torch.fx.Node] = None
    out_dtype: Optional[torch.dtype] = None
    epilogue: str = "none"
    weight: Optional[torch.fx.Node] = None
    b_layout: str = ""
    final: Optional[torch.fx.Node] = None  # the node the rewrite replaces (the product or its epilogue)
    view: Optional[torch.fx.Node] = None  # reshape of the product to [..., N] before the epilogue
    flow: list = field(default_factory=list)  # nodes the rewrite replaces
    extras: dict = field(default_factory=dict)
    missed: Optional[str] = None  # an epilogue seen but not folded, and why


def _dequantized_weight(b: torch.fx.Node) -> Optional[dict]:
    """For ``b = rubin.dequantize(W, ...).t()`` with ``W`` a graph input (a quantised nn.Linear weight, ops/quantized.py):
    the dequantise call's arguments by name; None otherwise."""
    if not (is_call(b, aten.permute.default) and list(b.args[1]) == [1, 0]) and not is_call(b, aten.t.default):
        return None
    dq = b.args[0]
    if not is_call(dq, torch.ops.rubin.dequantize.default):
        return None
    args = bound_arguments(dq)
    w = args["weight"]
    if not isinstance(w, torch.fx.Node) or w.op not in ("placeholder", "get_attr"):
        return None
    return args


def _weight_of(b: torch.fx.Node) -> tuple[Optional[torch.fx.Node], str]:
    """The graph input ``b`` reads (through views), and how ``b`` lays it out; (None, "") if none."""
    dq = _dequantized_weight(b)
    if dq is not None:
        return dq["weight"], f"rubin.dequantize({dq['format']} weight).t(): read as stored"
    node, views = b, []
    while is_call(node, *_WEIGHT_VIEWS):
        views.append(node)
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or node.op not in ("placeholder", "get_attr"):
        return None, ""
    wv = tensor_val(node)
    if (
        len(views) == 1
        and wv is not None
        and wv.dim() == 2
        and (
            (is_call(views[0], aten.permute.default) and list(views[0].args[1]) == [1, 0])
            or is_call(views[0], aten.t.default)
        )
    ):
        return node, "weight.t() (an nn.Linear weight stored [N, K])"
    if not views:
        return node, "[K, N] as stored"
    return node, "a view of a stored weight: " + " -> ".join(str(v.target).split(".")[-2] for v in views)


def _feeds_routing(node: torch.fx.Node, depth: int = 12) -> Optional[str]:
    """Whether ``node`` (a product's output) is a router's logits: it reaches ``aten.topk`` without
    passing another matmul or an opaque op, or it is an MoE op's ``router_logits``. Returns what it feeds."""
    frontier, seen = [(node, 0)], {node}
    while frontier:
        n, d = frontier.pop()
        for user in n.users:
            if user in seen:
                continue
            seen.add(user)
            if is_call(user, aten.topk.default):
                return "top-k"
            mc = decode_mutating_call(user)
            target = mc.op if mc is not None else user.target
            if isinstance(target, torch._ops.OpOverload) and target.namespace not in ("aten", "prims"):
                args = (
                    mc.args
                    if mc is not None
                    else dict(zip((a.name for a in target._schema.arguments), user.args), **user.kwargs)
                )
                if any(args.get(k) is n for k in ("router_logits", "gating_output")):
                    return schema_name(target)
                continue
            if user.op != "call_function" or user.target in _MATMULS or d + 1 >= depth:
                continue
            if isinstance(user.target, torch._ops.HigherOrderOperator):
                continue
            frontier.append((user, d + 1))
    return None


def _read_core(node: torch.fx.Node) -> _Gemm:
    """The product itself: operands, bias, scales; raise _NoMatch / _Policy."""
    form = CORES[node.target]
    if node.target is aten.mm.default:
        g = _Gemm(node, form, node.args[0], node.args[1])
    elif node.target is aten.addmm.default:
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            raise _NoMatch(
                f"addmm with beta={node.kwargs.get('beta', 1)}, alpha={node.kwargs.get('alpha', 1)}; "
                "rubin.gemm adds the bias as it is"
            )
        g = _Gemm(node, form, node.args[1], node.args[2])
        c, cv, ov = node.args[0], tensor_val(node.args[0]), tensor_val(node)
        if cv is None or ov is None:
            raise _NoMatch("no fake tensor recorded on its inputs")
        if cv.dim() == 1 or (cv.dim() == 2 and cv.shape[0] == 1):
            g.bias = c
            if cv.dim() == 2:
                g.extras["bias_view"] = True
        elif same_shape(cv, ov):
            g.residual, g.epilogue = c, "residual_add"  # addmm(residual, x, W.t()): the add is already fused
        else:
            raise _NoMatch(f"addmm's input of shape {tuple(cv.shape)} is neither a bias [N] nor a residual [M, N]")
    else:
        a, b, sa, sb = node.args[:4]
        rest = dict(zip(("bias", "scale_result", "out_dtype", "use_fast_accum"), node.args[4:]), **node.kwargs)
        if rest.get("scale_result") is not None:
            raise _NoMatch("_scaled_mm with scale_result (an FP8 output scale); rubin.gemm has none")
        av, bv = tensor_val(a), tensor_val(b)
        if av is None or bv is None or tensor_val(sa) is None or tensor_val(sb) is None:
            raise _NoMatch("no fake tensor recorded on its inputs")
        out_dtype = rest.get("out_dtype") or av.dtype
        if out_dtype not in FP8_OUT_DTYPES:
            raise _NoMatch(f"_scaled_mm writes {out_dtype}; rubin.gemm's FP8 products return bf16 / fp16 / fp32")
        if av.dtype not in FP8_DTYPES or bv.dtype not in FP8_DTYPES:
            raise _NoMatch(f"_scaled_mm of {av.dtype} x {bv.dtype}; rubin.gemm takes FP8 e4m3 / e5m2 operands")
        if scale_kind(tensor_val(sa), av.shape[0], "a") is None or scale_kind(tensor_val(sb), bv.shape[1], "b") is None:
            raise _NoMatch(
                f"_scaled_mm scales {tuple(tensor_val(sa).shape)} / {tuple(tensor_val(sb).shape)} are not "
                "per tensor, per row of a or per column of b (block scales are not rubin.gemm's yet)"
            )
        g = _Gemm(node, form, a, b, bias=rest.get("bias"), a_scale=sa, b_scale=sb, out_dtype=out_dtype)
        if rest.get("use_fast_accum"):
            g.extras["use_fast_accum"] = True
    av, bv = tensor_val(g.a), tensor_val(g.b)
    if av is None or bv is None:
        raise _NoMatch("no fake tensor recorded on its inputs")
    if av.dtype not in FLOAT_DTYPES + FP8_DTYPES:
        raise _Policy("non-float")
    g.weight, g.b_layout = _weight_of(g.b)
    if g.weight is None:
        raise _Policy("activations")
    dq = _dequantized_weight(g.b)
    if dq is not None:
        fp4_weight = dq["format"] in ("nvfp4", "mxfp4")
        takes = (torch.bfloat16, torch.float16) + ((torch.float32,) if fp4_weight else ())
        if g.form == "aten._scaled_mm" or av.dtype not in takes:
            raise _NoMatch(
                f"a dequantised {dq['format']} weight times {av.dtype} activations (rubin.gemm takes "
                f"{' / '.join(str(t).removeprefix('torch.') for t in takes)} for it)"
            )
        g.extras["dequantize"] = dq
        g.flow += [g.b, g.b.args[0]]  # the transpose and the dequantise, erased when nothing else reads them
    routing = _feeds_routing(node)
    if routing is not None:
        raise _Policy(f"router:{routing}")
    g.final = node
    g.flow = [node] + g.flow
    return g


def _other(add: torch.fx.Node, node: torch.fx.Node) -> Any:
    a, b = add.args[0], add.args[1]
    return b if a is node else a


def _read_epilogue(g: _Gemm) -> None:
    """Fold a bias add, then one of the gated / residual epilogues, into ``g`` where nothing else reads
    what they consume; record in ``g.missed`` an epilogue that is there but cannot be folded."""
    N = tensor_val(g.b).shape[1]
    out_dtype = g.out_dtype or tensor_val(g.a).dtype
    cur = g.core
    # reshape back to [B, S, N] of a 3-D input
    user = single_user(cur)
    if is_call(user, *RESHAPES) and tensor_val(user) is not None and tensor_val(user).shape[-1] == N:
        g.view, cur = user, user
    if g.epilogue == "residual_add":  # addmm(residual, ...): nothing more to fold
        return
    # an unfused bias add
    user = single_user(cur)
    if g.bias is None and g.form == "aten.mm" and is_call(user, aten.add.Tensor) and not user.kwargs:
        bias = _other(user, cur)
        bv = tensor_val(bias)
        if bv is not None and bv.dim() == 1 and bv.shape[0] == N and bv.dtype == out_dtype:
            g.bias, g.extras["bias_add"] = bias, user.name
            g.flow.append(user)
            g.final = cur = user  # the rewrite replaces the add: left in place, it would add the bias twice
    # SiLU / GELU-tanh and mul
    gated = _match_gated(g, cur, N)
    if gated is not None:
        return
    # residual add
    adds = [
        u
        for u in cur.users
        if is_call(u, aten.add.Tensor)
        and not u.kwargs
        and tensor_val(_other(u, cur)) is not None
        and _other(u, cur) is not cur
        and same_shape(tensor_val(_other(u, cur)), tensor_val(cur))
    ]
    if not adds:
        return
    add = adds[0]
    rv = tensor_val(_other(add, cur))
    if len(cur.users) > 1:
        g.missed = (
            f"residual add {add.name} not folded: the product ({cur.name}) is also read by "
            f"{', '.join(u.name for u in cur.users if u is not add)}"
        )
        return
    if rv.dtype != out_dtype:
        g.missed = (
            f"residual add {add.name} not folded: the residual is {rv.dtype}, the product {out_dtype} "
            "(the add promotes)"
        )
        return
    g.residual, g.epilogue = _other(add, cur), "residual_add"
    g.flow.append(add)
    g.final = add


def _half(n: Any, cur: torch.fx.Node, N: int) -> Optional[int]:
    """0 if ``n`` is ``cur[..., :N/2]``, 1 if ``cur[..., N/2:]`` (a slice, or a getitem of a split at N/2);
    else None."""
    last = tensor_val(cur).dim() - 1
    half = N // 2
    if N % 2:
        return None
    if is_call(n, operator.getitem) and is_call(n.args[0], aten.split.Tensor) and n.args[0].args[0] is cur:
        s = n.args[0]
        dim = s.args[2] if len(s.args) > 2 else s.kwargs.get("dim", 0)
        if s.args[1] == half and dim in (-1, last) and n.args[1] in (0, 1):
            return n.args[1]
        return None
    if is_call(n, aten.slice.Tensor) and n.args[0] is cur:
        a = list(n.args) + [0, None, None, 1][len(n.args) - 1 :]
        dim, start, end, step = a[1], a[2], a[3], a[4]
        if dim in (-1, last) and step == 1:
            if start in (0, None) and end == half:
                return 0
            if start == half and (end is None or end >= N):
                return 1
    return None


def _match_gated(g: _Gemm, cur: torch.fx.Node, N: int) -> Optional[str]:
    """Fold ``act(y[..., :N/2]) * y[..., N/2:]`` after ``cur``; return the epilogue (or "missed" with
    ``g.missed`` set), or None when there is no such epilogue."""
    from torch._inductor.pattern_matcher import Match

    halves = []
    for u in cur.users:
        halves += list(u.users) if is_call(u, aten.split.Tensor) else [u]
    halves = [h for h in halves if _half(h, cur, N) is not None]
    if {_half(h, cur, N) for h in halves} != {0, 1}:
        return None
    # The final mul reads the up half directly; the activation in between is decomposed.
    muls = [m for h in halves if _half(h, cur, N) == 1 for m in h.users if is_call(m, aten.mul.Tensor)]
    low = tensor_val(cur).dtype in (torch.bfloat16, torch.float16)
    extra_user = None
    for mul in muls:
        for epilogue, pattern, constants in _gated_patterns(low):
            m = pattern.match(mul)
            if not isinstance(m, Match):
                if str(m).startswith("multiple_users"):
                    extra_user = mul
                continue
            if m.kwargs.get("x") is not cur or _constants(m.nodes) != constants:
                continue
            parts = {_half(n, cur, N) for n in m.nodes if is_call(n, aten.slice.Tensor, operator.getitem)}
            ups = [_half(a, cur, N) for a in mul.args]
            if parts != {0, 1} or 1 not in ups or 0 in ups:
                continue  # act(up) * gate: the halves the other way round
            outside = [u for u in cur.users if u not in m.nodes]
            if outside:
                g.missed = (
                    f"{epilogue} epilogue ({mul.name}) not folded: the gate_up product ({cur.name}) is also "
                    f"read by {', '.join(u.name for u in outside)}"
                )
                return "missed"
            g.epilogue = epilogue
            g.flow += [n for n in m.nodes if n is not cur]
            g.final = mul
            return epilogue
    if extra_user is not None:
        g.missed = (
            f"gated epilogue ({extra_user.name}) not folded: an intermediate of act(gate) * up has a user outside it"
        )
        return "missed"
    return None


# --------------------------------------------------------------------------------------------------
# the rewrite
# --------------------------------------------------------------------------------------------------


def _rewrite(graph: torch.fx.Graph, g: _Gemm) -> Rewrite:
    av, bv = tensor_val(g.a), tensor_val(g.b)
    N = bv.shape[1]
    kwargs: dict[str, Any] = {}
    dq = g.extras.pop("dequantize", None)
    with graph.inserting_before(g.final):
        if dq is not None:  # the quantised weight as stored, its scales in rubin.gemm's [K, N] orientation
            g.b = call(graph, aten.permute.default, (dq["weight"], [1, 0]))
            scale = dq["scale"]
            g.b_scale = scale if dq["format"] == "fp8_tensor" else call(graph, aten.permute.default, (scale, [1, 0]))
            if dq["scale_2"] is not None:
                kwargs["b_scale_2"] = dq["scale_2"]
            if dq["format"] in ("nvfp4", "mxfp4") and dq["input_scale"] is not None:
                kwargs["a_scale"] = dq["input_scale"]  # FP4: the static input scale (W4A4 kernels read it)
            g.extras["weights"] = f"{dq['format']} read as stored (rubin.dequantize folded)"
        bias = g.bias
        if bias is not None and g.extras.get("bias_view"):
            bias = call(graph, aten.reshape.default, (bias, [N]))
        residual = g.residual
        if residual is not None and tensor_val(residual).dim() != 2:
            residual = call(graph, aten.reshape.default, (residual, [-1, N]))
        for name, value in (("bias", bias), ("residual", residual), ("a_scale", g.a_scale), ("b_scale", g.b_scale)):
            if value is not None:
                kwargs[name] = value
        if g.epilogue != "none":
            kwargs["epilogue"] = g.epilogue
        if g.a_scale is not None:
            kwargs["out_dtype"] = g.out_dtype
        new = call(graph, torch.ops.rubin.gemm.default, (g.a, g.b), kwargs)
        out = new
        if g.view is not None and g.final is not g.core:
            shape = list(g.view.args[1])
            shape[-1] = tensor_val(new).shape[-1]
            out = call(graph, aten.reshape.default, (new, shape))
    added = [
        n
        for n in (bias, residual, new, out)
        if isinstance(n, torch.fx.Node) and n.name not in {getattr(x, "name", None) for x in (g.bias, g.residual)}
    ]
    inherit_source(added, g.core)
    g.final.replace_all_uses_with(out)
    replaced = []
    doomed = set(g.flow) | ({g.view} if g.view is not None else set())
    for n in reversed(list(graph.nodes)):  # users before producers
        if n in doomed and not n.users:
            replaced.append(n.name)
            graph.erase_node(n)
    M = av.shape[0]
    details: dict[str, Any] = {
        "form": g.form,
        "M": report_value(M),
        "N": N,
        "K": bv.shape[0],
        "dtype": dtype_name(av.dtype),
        "out_dtype": dtype_name(tensor_val(new).dtype),
        "bias": g.bias is not None,
        "epilogue": g.epilogue,
        "weight": g.weight.name,
        "b_layout": g.b_layout,
    }
    if g.a_scale is not None:
        details["scales"] = (
            f"a {scale_kind(tensor_val(g.a_scale), M, 'a')}, b {scale_kind(tensor_val(g.b_scale), N, 'b')}"
        )
    details.update({k: v for k, v in g.extras.items() if k != "bias_view"})
    idiom = IDIOM if g.form != "aten._scaled_mm" else "fp8 linear"
    return Rewrite(
        node=new.name,
        canonical_op="rubin.gemm",
        source_idiom=f"{idiom} ({g.form})",
        replaced=sorted(replaced),
        details=details,
    )


def run(graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
    result = PassResult(NAME)
    policy: dict[str, list[str]] = collections.defaultdict(list)
    kept: dict[str, list[str]] = collections.defaultdict(list)
    for node in list(graph.nodes):
        if node._erased or node.op != "call_function":
            continue
        if node.target not in CORES:
            name = schema_name(called_op(node))
            if name in VLLM_LINEAR_OPS:
                kept[name].append(node.name)
            continue
        try:
            g = _read_core(node)
            _read_epilogue(g)
            av, bv = tensor_val(g.a), tensor_val(g.b)
            try:  # what rubin.gemm's fake implementation will check, before the graph is touched
                bias = tensor_val(g.bias)
                GemmArgs(
                    av,
                    bv,
                    bias.reshape(-1) if bias is not None else None,
                    g.epilogue,
                    tensor_val(g.residual).reshape(-1, bv.shape[1]) if g.residual is not None else None,
                    tensor_val(g.a_scale),
                    tensor_val(g.b_scale),
                    g.out_dtype,
                )
            except GemmArgumentError as e:
                raise _NoMatch(f"its operands do not fit rubin.gemm: {e}") from None
        except _Policy as p:
            policy[str(p)].append(node.name)
            continue
        except _NoMatch as e:
            result.unchanged.append(Unchanged(node.name, IDIOM, str(e)))
            continue
        if g.missed:
            result.unchanged.append(Unchanged(node.name, f"{IDIOM} epilogue", g.missed))
        result.rewrites.append(_rewrite(graph, g))
    result.notes += _policy_notes(policy) + [
        f"kept vLLM's linear: {len(nodes)} call(s) of {name} ({_names(nodes)}): {VLLM_LINEAR_OPS[name]}"
        for name, nodes in kept.items()
    ]
    result.changed = bool(result.rewrites)
    if result.changed:
        graph.lint()
    return result


PASS = Pass(NAME, run)


def _names(nodes: list[str]) -> str:
    return ", ".join(nodes[:4]) + (", ..." if len(nodes) > 4 else "")


def _policy_notes(policy: dict[str, list[str]]) -> list[str]:
    names = _names
    notes = []
    routers = [n for k, v in policy.items() if k.startswith("router:") for n in v]
    if routers:
        feeds = sorted({k.split(":", 1)[1] for k in policy if k.startswith("router:")})
        notes.append(
            f"left to Inductor: {len(routers)} MoE router product(s) ({names(routers)}) feeding "
            f"{', '.join(feeds)}: routing stays ATen, fused by Inductor"
        )
    if policy.get("activations"):
        notes.append(
            f"left to Inductor: {len(policy['activations'])} product(s) whose b is not a weight "
            f"({names(policy['activations'])}): not a linear layer"
        )
    if policy.get("non-float"):
        notes.append(f"left to Inductor: {len(policy['non-float'])} integer product(s) ({names(policy['non-float'])})")
    return notes
