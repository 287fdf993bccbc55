"""match_routing: rewrite the router upstream of each ``rubin.moe`` into one ``rubin.route`` where a routing kernel
takes it.

At decode the routing of an MoE layer is a router GEMM plus softmax / top-k / renormalisation kernels: about 10 us
and 3-4 launches per layer on an H200 for a few microseconds of bytes (docs/kernels/routing.md). The idioms are the
ones passes/match_moe/routing.py describes; this pass reads the same description with the nodes it came from
(``describe_routing(..., found)``) and, for each ``rubin.moe`` whose ``topk_weights`` / ``topk_ids`` come from a
recognised router, inserts::

    weights, ids = rubin.route(x, W_r, k, scoring=..., order=..., renormalize=..., router_bias=..., correction_bias=...,
                               n_group=..., topk_group=..., group_fill=..., scale=... | scale_tensor=...,
                               logits_dtype=<the router's output dtype>, weights_dtype=<what rubin.moe read>)
    rubin.moe(hidden_states, w13, w2, weights, ids, ...)

and the old routing nodes go (dead code). ``x`` and ``W_r`` are taken under their dtype conversions (DeepSeek-V3's
router casts both to float32: the kernel multiplies bf16 inputs in float32, the same products, without writing a
float32 copy of the weight); ``logits_dtype`` keeps the source's rounding of the logits (a bf16 ``nn.Linear`` writes
bf16 logits that Qwen3-MoE / Mixtral then soften in float32).

The rewrite is made only where selection will bind a routing kernel (``select_kernels.planning``, the same
question select_kernels asks): the op's reference is no faster than what Inductor compiles from the routing as
written, so elsewhere -- the CPU, a prefill-sized static T, an unsupported size -- the routing stays, with the
reason in a note (a kernel decision: ``strict`` does not raise on it). Also left alone, with the reason: routing
the kernel does not implement (top-k then sigmoid, a per-expert scale, a skip class, logits with no linear
projection), a router whose logits or choices are read by anything
else (they would be computed twice), and the routing inside vLLM's MoE layer ops (vLLM's own top-k kernels run it).

The router is walked by hand for the same reason as in routing.py: it is a chain of optional steps read off the
description; torch's pattern matcher would need one pattern per combination of them.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

import rubin_compile.kernels  # noqa: F401  (registers the routing kernels: the rewrite asks selection)
from rubin_compile.ops.moe import MOE
from rubin_compile.ops.registry import canonical_form
from rubin_compile.ops.route import ROUTE
from rubin_compile.passes.base import Pass, PassContext, PassResult, Rewrite, Unchanged
from rubin_compile.passes.fx import (
    RESHAPES,
    bound_arguments,
    call,
    inherit_source,
    is_call,
    set_argument,
    strip_converts,
    tensor_val,
)
from rubin_compile.passes.match_moe.routing import describe_routing
from rubin_compile.passes.select_kernels import planning

NAME = "match_routing"
IDIOM = "MoE routing"
aten = torch.ops.aten

# describe_routing's orders the kernel implements, as rubin.route's (scoring, order)
_ORDERS = {
    "softmax_then_topk": ("softmax", "score_then_topk"),
    "sigmoid_then_topk": ("sigmoid", "score_then_topk"),
    "topk_then_softmax": ("softmax", "topk_then_softmax"),
}


class _Skip(Exception):
    """A router this pass leaves as written; the message is the reason."""


class _Kept(_Skip):
    """A router left as written because selection would bind no routing kernel to it (a decision, not a near miss:
    a note, which ``strict`` does not turn into an error)."""


def run(graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
    result = PassResult(NAME)
    moes = [n for n in graph.nodes if (form := canonical_form(n)) is not None and form[0] is MOE]
    if not moes or ctx.gradients:
        return result
    target, runs_here, cudagraphs, _ = planning(graph, ctx)
    if not target.is_cuda:
        result.notes.append(
            f"target {target.name}: the routing of {len(moes)} MoE block(s) stays as written (no routing kernel "
            "for the CPU; Inductor compiles it)"
        )
        return result
    for moe in moes:
        if moe.target is not torch.ops.rubin.moe.default:
            result.unchanged.append(
                Unchanged(
                    moe.name,
                    IDIOM,
                    "the routing runs inside vLLM's MoE layer op (vLLM's own fused top-k / grouped top-k kernels, "
                    "from the router logits it is given); this version fuses routing only ahead of rubin.moe",
                )
            )
            continue
        try:
            result.rewrites.append(_rewrite(graph, moe, ctx, target, runs_here, cudagraphs))
        except _Kept as why:
            result.notes.append(f"{moe.name}: routing kept as written: {why}")
        except _Skip as why:
            result.unchanged.append(Unchanged(moe.name, IDIOM, str(why)))
    if result.rewrites:
        graph.eliminate_dead_code()
        graph.lint()
        result.changed = True
    return result


def _rewrite(graph, moe, ctx, target, runs_here, cudagraphs) -> Rewrite:
    args = bound_arguments(moe)
    tw, ti = args["topk_weights"], args["topk_ids"]
    found: dict[str, Any] = {}
    info = describe_routing(tw, ti, found)
    if not info["recognised"]:
        raise _Skip(f"routing not recognised: {info.get('why')}")
    if info["order"] not in _ORDERS:
        raise _Skip(f"routing {info['order']}: the routing kernel implements {', '.join(_ORDERS)}")
    for key, what in (("per_expert_scale", "a per-expert scale on the weights"), ("skip_expert", "a skip class")):
        if info.get(key):
            raise _Skip(f"routing with {what}: not implemented by the routing kernel")
    if info["router"] != "linear":
        raise _Skip(f"the router's logits are not a linear projection ({info['router']})")
    scoring, order = _ORDERS[info["order"]]
    if order == "score_then_topk" and info["scoring"] != scoring:
        raise _Skip(f"scoring {info['scoring']} with order {info['order']}")

    x, weight, bias, logits_dtype = _projection(found["projection"])
    xval, hval = tensor_val(x), tensor_val(args["hidden_states"])
    if xval is None or hval is None or not statically_known_true(xval.shape[0] == hval.shape[0]):
        raise _Skip("the router reads another number of tokens than the experts")
    E = tensor_val(weight).shape[0]
    n_group, topk_group = _groups(found, E) if info["group_limited"] else (1, 1)
    corr = _vector(found.get("correction_bias"), E, "the score-correction bias")
    eps = found.get("renorm_eps") or 0.0
    floor = str(info.get("renormalize_eps", "")).startswith("max(")
    kwargs: dict[str, Any] = {"scoring": scoring, "order": order}
    if info["renormalize"]:
        kwargs.update(renormalize=True, renorm_eps=float(eps), renorm_floor=floor)
    if bias is not None:
        kwargs["router_bias"] = bias
    if corr is not None:
        kwargs["correction_bias"] = corr
    if n_group > 1:
        kwargs.update(n_group=n_group, topk_group=topk_group, group_fill=info.get("group_fill", "-inf"))
    if found.get("scale_input") is not None:
        kwargs["scale_tensor"] = found["scale_input"]
    elif isinstance(info["scale"], (int, float)):
        kwargs["scale"] = float(info["scale"])
    if logits_dtype is not None:
        kwargs["logits_dtype"] = logits_dtype
    kwargs["weights_dtype"] = tensor_val(tw).dtype

    dead = _dead_after(graph, moe, (tw, ti))
    used = [n for n in (found["projection"], found["topk"]) if n not in dead]
    if used:
        others = sorted({u.name for n in used for u in n.users if u not in dead and u is not moe})
        raise _Skip(
            f"the router's {'logits' if found['projection'] in used else 'choice'} are also read by "
            f"{', '.join(others) or 'the graph output'}: fused, the routing would be computed twice"
        )

    with graph.inserting_before(moe):
        route = call(graph, torch.ops.rubin.route.default, (x, weight, int(info["top_k"])), kwargs)
        weights = call(graph, operator.getitem, (route, 0))
        ids = call(graph, operator.getitem, (route, 1))
    selection = ROUTE.select(
        ROUTE.forms["rubin::route"](route), target, ctx.options.kernels.get("route"), runs_here, cudagraphs
    )
    if selection.chosen.name == "reference" and ctx.options.kernels.get("route") != "reference":
        for n in (ids, weights, route):
            graph.erase_node(n)
        reasons = "; ".join(f"{k}: {r}" for k, r in selection.rejected)
        raise _Kept(
            f"no routing kernel takes it on {target.name} ({reasons}); Inductor compiles the routing as written"
        )
    inherit_source([route, weights, ids], found["topk"])
    set_argument(moe, "topk_weights", weights)
    set_argument(moe, "topk_ids", ids)
    details = {k: info[k] for k in ("order", "scoring", "renormalize", "top_k", "num_experts", "router_bias")}
    details.update(
        score_correction_bias=corr is not None,
        n_group=n_group,
        topk_group=topk_group,
        scale=info["scale"],
        logits_dtype=str(logits_dtype).replace("torch.", "") if logits_dtype else "float32",
        kernel=selection.chosen.name,
    )
    return Rewrite(route.name, "rubin.route", f"{info['order']} router", sorted(n.name for n in dead), details)


def _projection(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, Optional[torch.fx.Node], Any]:
    """``(x [T, H], W [E, H], bias or None, logits dtype or None)`` of the router projection ``node`` (an mm, an
    addmm, or an mm plus a bias), the inputs under their dtype conversions. The logits dtype is the projection's
    output dtype when it is 16-bit (the values the source graph scores)."""
    out = tensor_val(node)
    bias = None
    if is_call(node, aten.addmm.default):
        bias, mm_args = node.args[0], (node.args[1], node.args[2])
        if node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("beta", 1) != 1:
            raise _Skip("the router's addmm scales its terms (alpha / beta)")
    elif is_call(node, aten.mm.default):
        mm_args = node.args
    elif is_call(node, aten.add.Tensor):
        mm = next((a for a in node.args if is_call(strip_converts(a), aten.mm.default)), None)
        if mm is None:
            raise _Skip("the router's projection is not an mm plus a bias")
        bias = node.args[1] if node.args[0] is mm else node.args[0]
        mm_args = strip_converts(mm).args
    else:
        raise _Skip(f"the router's projection ({node.name}) is not an mm / addmm (a one-token CPU decomposition?)")
    x, b = strip_converts(mm_args[0]), strip_converts(mm_args[1])
    if is_call(b, aten.permute.default) and list(b.args[1]) == [1, 0]:
        weight = strip_converts(b.args[0])
    else:
        raise _Skip(f"the router weight ({b.name}) is not a transposed [E, H] parameter (W.t())")
    xv, wv = tensor_val(x), tensor_val(weight)
    if xv is None or wv is None or xv.dim() != 2 or wv.dim() != 2:
        raise _Skip("the router's operands are not 2-D")
    E = wv.shape[0]
    bias = _vector(bias, E, "the router bias")
    dtype = out.dtype if out is not None and out.dtype in (torch.bfloat16, torch.float16) else None
    return x, weight, bias, dtype


def _vector(node: Any, E: int, what: str) -> Optional[torch.fx.Node]:
    """``node`` as the [E] tensor under its reshapes / unsqueezes ([1, E] bias views) and conversions; None for None."""
    if node is None:
        return None
    cur = strip_converts(node)
    while (is_call(cur, *RESHAPES) or is_call(cur, aten.unsqueeze.default, aten.expand.default)) and tensor_val(
        cur
    ) is not None:
        if tensor_val(cur).dim() == 1:
            break
        cur = strip_converts(cur.args[0])
    val = tensor_val(cur)
    if not isinstance(cur, torch.fx.Node) or val is None or tuple(val.shape) != (E,):
        raise _Skip(f"{what} is not a [E] = [{E}] tensor")
    return cur


def _groups(found: dict[str, Any], E: int) -> tuple[int, int]:
    """``(n_group, topk_group)`` of a group-limited top-k: the top-k over [T, n_group] group scores behind the mask
    (routing.group_choice), whose scores are each group's top-2 sum of the selection values (DeepSeek-V3's
    ``group_scores``)."""
    choice = found.get("group_choice")
    if choice is None:
        raise _Skip("a group mask whose group top-k was not found")
    n_group = tensor_val(choice.args[0]).shape[1]
    topk_group = choice.args[1] if len(choice.args) > 1 else choice.kwargs["k"]
    if not _is_top2_sum(choice.args[0], found["selected"]):
        raise _Skip("the group scores are not each group's sum of its two largest selection values")
    return n_group, int(topk_group)


def _base(node: Any) -> Any:
    node = strip_converts(node)
    while is_call(node, *RESHAPES):
        node = strip_converts(node.args[0])
    return node


def _is_top2_sum(node: Any, selected: Any) -> bool:
    """``topk(sel.view(T, n_group, E / n_group), 2)[0].sum(-1)`` with ``sel`` the selection values (the scores plus
    any correction bias: what the masked top-k selects from)."""
    node = strip_converts(node)
    if not is_call(node, aten.sum.dim_IntList) or list(node.args[1]) not in ([-1], [2]):
        return False
    top = node.args[0]
    if not (is_call(top, operator.getitem) and top.args[1] == 0 and is_call(top.args[0], aten.topk.default)):
        return False
    topk = top.args[0]
    if (topk.args[1] if len(topk.args) > 1 else topk.kwargs.get("k")) != 2:
        return False
    return _base(topk.args[0]) is _base(selected)


def _dead_after(graph: torch.fx.Graph, moe: torch.fx.Node, roots: tuple) -> set[torch.fx.Node]:
    """The nodes that die once ``moe`` stops reading ``roots`` (its routing arguments): those upstream of them whose
    every user is ``moe`` reading them only as such, or dies too (placeholders and impure nodes never)."""
    upstream: set[torch.fx.Node] = set()
    todo = [r for r in roots if isinstance(r, torch.fx.Node)]
    while todo:
        n = todo.pop()
        if n in upstream:
            continue
        upstream.add(n)
        todo.extend(n.all_input_nodes)
    # what the MoE goes on reading after the rewrite (its hidden states, weights, ...): those stay alive
    kept = {
        v
        for name, v in bound_arguments(moe).items()
        if isinstance(v, torch.fx.Node) and name not in ("topk_weights", "topk_ids")
    }
    dead: set[torch.fx.Node] = set()
    for n in reversed(list(graph.nodes)):
        if n not in upstream or n.op != "call_function" or n.is_impure():
            continue
        if all(u in dead or (u is moe and n in roots and n not in kept) for u in n.users):
            dead.add(n)
    return dead


PASS = Pass(NAME, run, reads=("options", "target", "engine", "gradients"))
