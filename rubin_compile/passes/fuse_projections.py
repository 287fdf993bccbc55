"""fuse_projections: join linear layers that read the same input into one ``rubin.gemm`` (horizontal fusion).

After match_gemm, an attention block's q / k / v projections and a dense MLP's gate / up projections (Hugging
Face Llama / Qwen write ``down(act(gate(x)) * up(x))`` as separate linears) are separate ``rubin.gemm`` nodes
reading one input. At decode each is a small, weight-bound GEMM: one launch over the concatenated weights
reads the same bytes in one kernel instead of two or three. This pass rewrites::

    q = rubin.gemm(x, permute(Wq, [1, 0]), bias=bq)          # every member: b = W.t() of a graph input W [N_i, K]
    k = rubin.gemm(x, permute(Wk, [1, 0]), bias=bk)
    v = rubin.gemm(x, permute(Wv, [1, 0]), bias=bv)
  ->
    w   = rubin.stacked_weights([Wq, Wk, Wv])                # [Nq + Nk + Nv, K], made once and cached (ops/weights.py)
    qkv = rubin.gemm(x, permute(w, [1, 0]), bias=rubin.stacked_weights([bq, bk, bv]))
    q, k, v = aten.slice(qkv, 1, 0, Nq), aten.slice(qkv, 1, Nq, Nq + Nk), ...   # views, no copy

and a gate / up pair whose products meet only in ``act(gate) * up`` (SiLU, or GELU-tanh; either operand order;
with the bf16 / fp16 upcasts Inductor's decomposition puts around the activation) into one product with the
gated epilogue: ``rubin.gemm(x, permute(stacked([Wg, Wu]), [1, 0]), epilogue="silu_and_mul")``, which replaces
the ``mul``.

Who joins: ``rubin.gemm`` nodes reading the same input (the same node, or reshapes of one node to the same
2-D shape, as a 3-D input gives every linear its own ``view``), unquantised, with no epilogue, of one dtype,
each ``b`` the transpose of a weight that is a graph input (what match_gemm's ``b_layout`` calls
``weight.t()``); all with a bias (a graph input too) or none. Groups of at least two; the fused node goes before
the earliest member in graph order (its input and the weights are defined before every member).

The price is memory: the stacked copy is kept alive next to the original weights (which the model still
holds), so every fusion reports ``stacked_weight_bytes`` and a note sums them. The numerics are the members':
each output column is the same dot product over K.

``options.fuse_projections``: ``"auto"`` fuses on CUDA targets only (fewer, larger GEMM launches pay at decode;
on the CPU target the reference runs ``torch.mm`` and a concatenated copy only costs memory), with or without CUDA
graphs (the stacked copy is made outside cudagraph trees' memory pool: ops/weights.py), ``"on"`` always, ``"off"``
never.
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch._guards import detect_fake_mode

import rubin_compile.ops.weights  # noqa: F401  (registers rubin.stacked_weights)
from rubin_compile.ops.gemm import GATED
from rubin_compile.passes.base import Pass, PassContext, PassResult, Rewrite
from rubin_compile.passes.fx import (
    RESHAPES,
    bound_arguments,
    call,
    dtype_name,
    inherit_source,
    is_call,
    report_value,
    single_user,
    tensor_val,
)
from rubin_compile.passes.match_gemm import _act, _constants

NAME = "fuse_projections"

aten = torch.ops.aten
_INPUTS = ("placeholder", "get_attr")


GEMM = torch.ops.rubin.gemm.default
STACKED_WEIGHTS = torch.ops.rubin.stacked_weights.default


# --------------------------------------------------------------------------------------------------
# the gated pattern over two products: act(gate) * up
# --------------------------------------------------------------------------------------------------


def _gated(act: str, up_first: bool):
    """``act(g) * u`` (or ``u * act(g)``) of two separate products; traced into a pattern below."""

    def fn(g, u):
        return u * _act(act)(g) if up_first else _act(act)(g) * u

    return fn


@functools.lru_cache(maxsize=None)
def _gated_patterns(low_precision: bool) -> tuple:
    """(epilogue, pattern, constants) for SiLU / GELU-tanh, either operand order; bf16 / fp16 add the upcasts
    around the activation (low_precision)."""
    from torch._inductor.pattern_matcher import fwd_only, gen_pattern_and_search_gm

    dtype = torch.bfloat16 if low_precision else torch.float32
    out = []
    for epilogue, act in GATED.items():
        for up_first in (False, True):
            example = [torch.empty(4, 8, dtype=dtype), torch.empty(4, 8, dtype=dtype)]
            pattern, gm = gen_pattern_and_search_gm(_gated(act, up_first), example, fwd_only)
            out.append((epilogue, pattern, _constants(gm.graph.nodes)))
    return tuple(out)


# --------------------------------------------------------------------------------------------------
# reading the candidates
# --------------------------------------------------------------------------------------------------


@dataclass
class _Member:
    node: torch.fx.Node  # the rubin.gemm node
    a: torch.fx.Node
    b: torch.fx.Node  # permute(W, [1, 0]) / t(W)
    weight: torch.fx.Node  # W [N, K], a graph input
    bias: Optional[torch.fx.Node]
    N: int
    K: int
    dtype: torch.dtype
    order: int  # position in the graph


def _root(a: torch.fx.Node) -> torch.fx.Node:
    """The node under any chain of reshapes / views."""
    while is_call(a, *RESHAPES):
        a = a.args[0]
    return a


def _transposed_input(b: Any) -> Optional[torch.fx.Node]:
    """W when ``b`` is ``permute(W, [1, 0])`` or ``t(W)`` of a 2-D graph input W; else None."""
    if not ((is_call(b, aten.permute.default) and list(b.args[1]) == [1, 0]) or is_call(b, aten.t.default)):
        return None
    w = b.args[0]
    if not isinstance(w, torch.fx.Node) or w.op not in _INPUTS:
        return None
    wv = tensor_val(w)
    return w if wv is not None and wv.dim() == 2 else None


def _read(node: torch.fx.Node, order: int) -> tuple[Optional[_Member], str]:
    """The member a rubin.gemm node can be, or (None, why it cannot)."""
    args = bound_arguments(node)
    a, b = args["a"], args["b"]
    av, bv = tensor_val(a), tensor_val(b)
    if av is None or bv is None or tensor_val(node) is None:
        return None, "no fake tensor recorded on it"
    if args.get("a_scale") is not None or args.get("b_scale") is not None:
        return None, "quantised (a_scale / b_scale)"
    if args.get("epilogue", "none") != "none":
        return None, f"epilogue {args['epilogue']}"
    if args.get("out_dtype") not in (None, av.dtype):
        return None, f"out_dtype {args['out_dtype']}"
    impl = args.get("impl", "reference")
    if impl not in ("reference", None):
        return None, f"already bound to kernel {impl}"
    weight = _transposed_input(b)
    if weight is None:
        return None, "b is not the transpose of a weight that is a graph input"
    N, K = bv.shape[1], bv.shape[0]
    if not isinstance(N, int) or not isinstance(K, int):
        return None, "symbolic N or K"
    bias = args.get("bias")
    if bias is not None and (not isinstance(bias, torch.fx.Node) or bias.op not in _INPUTS):
        return None, "its bias is computed in the graph (only graph inputs are stacked once)"
    return _Member(node, a, b, weight, bias, N, K, av.dtype, order), ""


def _input_key(a: torch.fx.Node) -> tuple:
    """Equal for inputs that are the same tensor: one node, or reshapes of one node to one shape."""
    av = tensor_val(a)
    return (_root(a), tuple(str(s) for s in av.shape), av.dtype)


# --------------------------------------------------------------------------------------------------
# the gated pair
# --------------------------------------------------------------------------------------------------


def _product_out(m: _Member) -> torch.fx.Node:
    """The member's product as the code reads it: the node, or its only user when that is a reshape back
    to the input's leading dims (a 3-D input)."""
    user = single_user(m.node)
    if is_call(user, *RESHAPES):
        return user
    return m.node


@dataclass
class _GatedMatch:
    epilogue: str
    gate: _Member
    up: _Member
    mul: torch.fx.Node
    nodes: list  # the pattern's nodes (the mul and the activation), replaced
    views: list  # the members' reshapes back to 3-D, replaced


def _match_gated(pair: list[_Member]) -> tuple[Optional[_GatedMatch], Optional[str]]:
    """``act(gate) * up`` over the two members' products and nothing else reading them; or (None, why not)
    when such a mul is there but cannot be folded (None, None when there is none)."""
    from torch._inductor.pattern_matcher import Match

    if pair[0].N != pair[1].N or pair[0].weight is pair[1].weight:
        return None, None
    outs = {_product_out(m): m for m in pair}
    muls = {u for o in outs for u in o.users if is_call(u, aten.mul.Tensor)}
    low = pair[0].dtype in (torch.bfloat16, torch.float16)
    seen: Optional[str] = None
    for mul in sorted(muls, key=lambda n: n.name):
        for epilogue, pattern, constants in _gated_patterns(low):
            m = pattern.match(mul)
            if not isinstance(m, Match):
                if str(m).startswith("multiple_users"):
                    seen = f"act(gate) * up ({mul.name}): an intermediate has a user outside it"
                continue
            if _constants(m.nodes) != constants:
                continue
            g, u = m.kwargs.get("g"), m.kwargs.get("u")
            if g not in outs or u not in outs or g is u:
                continue
            outside = [x.name for o in outs for x in o.users if x not in m.nodes]
            if outside:
                seen = f"{epilogue} of {mul.name}: the products are also read by {', '.join(sorted(set(outside)))}"
                continue
            views = [o for o in outs if o is not outs[o].node]
            return _GatedMatch(epilogue, outs[g], outs[u], mul, list(m.nodes), views), None
    return None, seen


# --------------------------------------------------------------------------------------------------
# the rewrite
# --------------------------------------------------------------------------------------------------


def _stack(graph: torch.fx.Graph, parts: list[torch.fx.Node]) -> torch.fx.Node:
    return call(graph, STACKED_WEIGHTS, (list(parts),))


def _fuse(graph: torch.fx.Graph, members: list[_Member], gated: Optional[_GatedMatch]) -> Rewrite:
    first = members[0]
    epilogue = gated.epilogue if gated is not None else "none"
    ordered = [gated.gate, gated.up] if gated is not None else members
    # the same weight (and bias) applied twice to the input (Inductor does not merge the two products): one
    # part of the stack, one slice read by both
    parts: list[_Member] = []
    part_of: dict[torch.fx.Node, int] = {}
    for m in ordered:
        same = [i for i, p in enumerate(parts) if p.weight is m.weight and p.bias is m.bias]
        if same:
            part_of[m.node] = same[0]
        else:
            part_of[m.node] = len(parts)
            parts.append(m)
    bias = first.bias is not None
    with graph.inserting_before(first.node):
        w = _stack(graph, [m.weight for m in parts])
        b = call(graph, aten.permute.default, (w, [1, 0]))
        kwargs: dict[str, Any] = {}
        new_nodes = [w, b]
        if bias:
            kwargs["bias"] = _stack(graph, [m.bias for m in parts])
            new_nodes.append(kwargs["bias"])
        if epilogue != "none":
            kwargs["epilogue"] = epilogue
        fused = call(graph, GEMM, (first.a, b), kwargs)
        new_nodes.append(fused)
        outs: list[torch.fx.Node] = []
        if gated is None:
            start = 0
            for m in parts:
                outs.append(call(graph, aten.slice.Tensor, (fused, 1, start, start + m.N)))
                start += m.N
        else:
            outs.append(fused)
    if gated is not None and gated.views:
        # back to the input's leading dims, as the gate's reshape had them (its sizes may be symbols defined
        # after the first member: insert before the mul, which comes after both reshapes)
        view = _product_out(gated.gate) if _product_out(gated.gate) in gated.views else gated.views[0]
        with graph.inserting_before(gated.mul):
            outs = [call(graph, aten.reshape.default, (fused, list(view.args[1])))]
    new_nodes += outs
    inherit_source(new_nodes, first.node)
    doomed: set[torch.fx.Node] = set()
    if gated is None:
        for m in ordered:
            out = outs[part_of[m.node]]
            _keep_views_valid(m.node, out)
            m.node.replace_all_uses_with(out)
            doomed.add(m.node)
    else:
        gated.mul.replace_all_uses_with(outs[0])
        doomed |= set(gated.nodes) | set(gated.views) | {m.node for m in members}
    doomed |= {m.b for m in members} | {m.a for m in members if m.a is not first.a}
    joined = [m.node.name for m in ordered]
    replaced = set(joined) | ({n.name for n in gated.nodes} | {n.name for n in gated.views} if gated else set())
    for n in reversed(list(graph.nodes)):  # users before producers
        if n in doomed and not n.users:
            graph.erase_node(n)
    itemsize = first.dtype.itemsize
    total_n = sum(m.N for m in parts)
    stacked = total_n * first.K * itemsize + (total_n * itemsize if bias else 0)
    if gated is not None:
        act = GATED[epilogue]
        idiom = f"gate / up projections sharing an input, {act}(gate) * up ({len(parts)} linears)"
    else:
        idiom = f"projections sharing an input ({len(parts)} linears)"
    details = {
        "joined": joined,
        "weights": [m.weight.name for m in parts],
        "N": [m.N for m in parts],
        "K": first.K,
        "M": report_value(tensor_val(first.a).shape[0]),
        "dtype": dtype_name(first.dtype),
        "epilogue": epilogue,
        "bias": bias,
        "stacked_weight_bytes": stacked,
    }
    if len(parts) < len(ordered):
        details["same_product"] = {m.node.name: parts[part_of[m.node]].node.name for m in ordered if m not in parts}
    if gated is not None:
        details["gate"], details["up"], details["mul"] = gated.gate.node.name, gated.up.node.name, gated.mul.name
    return Rewrite(
        node=fused.name,
        canonical_op="rubin.gemm",
        source_idiom=idiom,
        replaced=sorted(replaced),
        details=details,
    )


def _keep_views_valid(member: torch.fx.Node, out: torch.fx.Node) -> None:
    """A member's output was contiguous, its slice of the fused output is not: an ``aten.view`` of it that
    the slice's strides cannot serve becomes ``aten.reshape`` (which copies where it must)."""
    sv = tensor_val(out)
    for user in list(member.users):
        if not is_call(user, aten.view.default) or sv is None:
            continue
        try:
            with detect_fake_mode([sv]):
                sv.view(*[tensor_val(s) if isinstance(s, torch.fx.Node) else s for s in user.args[1]])
        except Exception:
            user.target = aten.reshape.default


# --------------------------------------------------------------------------------------------------
# the pass
# --------------------------------------------------------------------------------------------------


def _enabled(ctx: PassContext, groups: list[list[_Member]]) -> tuple[bool, str]:
    mode = ctx.options.fuse_projections
    target = ctx.target
    if mode == "off":
        return False, "fuse_projections='off'"
    if mode == "on":
        return True, "fuse_projections='on'"
    on_cpu = any(tensor_val(g[0].a).device.type == "cpu" for g in groups)
    if target.is_cuda and ctx.options.target in ("auto", "") and on_cpu:
        # as select_kernels: "auto" detected a GPU, but this graph's tensors live on the CPU
        return False, (
            f"fuse_projections='auto': target auto detected {target.name}, but the graph's tensors are on the CPU, "
            "where a concatenated weight copy would only cost memory; force it with fuse_projections='on'"
        )
    if target.is_cuda:
        return True, f"fuse_projections='auto' on CUDA target {target.name}"
    return False, (
        f"fuse_projections='auto' on target {target.name}: no GPU, where the reference runs torch.mm per "
        "projection and a concatenated weight copy would only cost memory; force it with fuse_projections='on'"
    )


def _groups(graph: torch.fx.Graph) -> tuple[list[list[_Member]], list[str]]:
    """Groups of at least two members, and notes on rubin.gemm nodes that share an input with a group (or
    with each other) but cannot join, with the reason."""
    by_input: dict[tuple, list[tuple[Optional[_Member], torch.fx.Node, str]]] = collections.defaultdict(list)
    for order, node in enumerate(graph.nodes):
        if not is_call(node, GEMM):
            continue
        a = bound_arguments(node)["a"]
        if tensor_val(a) is None:
            continue
        member, why = _read(node, order)
        by_input[_input_key(a)].append((member, node, why))
    groups: list[list[_Member]] = []
    notes: list[str] = []
    for entries in by_input.values():
        if len(entries) < 2:
            continue
        members = [m for m, _, _ in entries if m is not None]
        left = [f"{n.name} ({why})" for m, n, why in entries if m is None]
        with_bias = [m for m in members if m.bias is not None]
        without = [m for m in members if m.bias is None]
        if with_bias and without:
            notes.append(
                "not joined across a bias mismatch: "
                f"{', '.join(m.node.name for m in with_bias)} have a bias, "
                f"{', '.join(m.node.name for m in without)} have none"
            )
        for part in (with_bias, without):
            if len({(m.weight, m.bias) for m in part}) >= 2:
                groups.append(sorted(part, key=lambda m: m.order))
            elif part and left:
                left.append(f"{part[0].node.name} (no other member to join)")
        if left:
            notes.append(f"left out of a fusion of products sharing an input: {', '.join(left)}")
    groups.sort(key=lambda g: g[0].order)
    return groups, notes


def run(graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
    result = PassResult(NAME)
    groups, notes = _groups(graph)
    on, why = _enabled(ctx, groups)
    if not on:
        if groups:
            sizes = ", ".join(str(len({m.weight for m in g})) for g in groups)
            result.notes.append(f"did nothing: {why} ({len(groups)} group(s) of {sizes} projection(s) could join)")
        else:
            result.notes.append(f"did nothing: {why}")
        return result
    result.notes += notes
    total = 0
    for group in groups:
        gated = None
        if len(group) == 2:
            gated, missed = _match_gated(group)
            if missed:
                result.notes.append(f"gate / up of {group[0].node.name}, {group[1].node.name}: plain fusion, {missed}")
        rewrite = _fuse(graph, group, gated)
        total += rewrite.details["stacked_weight_bytes"]
        result.rewrites.append(rewrite)
    if result.rewrites:
        result.notes.append(
            f"{len(result.rewrites)} fusion(s) ({why}); the stacked copies hold {total} bytes "
            f"({total / 2**20:.2f} MiB) next to the original weights"
        )
        result.changed = True
        graph.lint()
    return result


PASS = Pass(NAME, run, reads=("options", "target"))
