"""Matcher (e): Llama 4's experts as transformers writes them, every expert on every token with the routing weight
on its input, into ``rubin.moe(..., apply_router_weight_on_input=True)`` over the top-k experts only.

Source idiom (``transformers/models/llama4/modeling_llama4.py``, transformers 5.19 and 5.24)::

    # Llama4Router.forward
    router_logits = F.linear(x, W_r)                                               # [T, E]
    top, ids = torch.topk(router_logits, k, dim=1)
    scores = torch.full_like(router_logits, float("-inf")).scatter_(1, ids, top)
    scores = torch.nn.functional.sigmoid(scores.float()).to(scores.dtype)          # [T, E]: 0 where not routed
    # Llama4TextMoe.forward
    routed_in = x.repeat(E, 1) * scores.transpose(0, 1).reshape(-1, 1)             # [E*T, H]: expert-major
    # Llama4TextExperts.forward (gate_up_proj [E, H, 2I], down_proj [E, I, H])
    gate, up = torch.bmm(routed_in.view(E, -1, H), gate_up_proj).chunk(2, dim=-1)
    y = torch.bmm(up * act_fn(gate), down_proj)                                    # [E, T, H]
    out = shared_expert(x);  out.add_(y.view(-1, H).reshape(E, -1, H).sum(dim=0))

Post-grad ATen: ``aten.full([T, E], -inf)``, ``aten.scatter.src(full, 1, ids, top)``, ``convert_element_type`` /
``sigmoid`` / ``convert_element_type``; ``aten.repeat(x, [E, 1])`` times ``reshape(clone(permute(scores, [1, 0])),
[E*T, 1])``; ``reshape(.., [E, T, H])``, ``aten.bmm``, ``aten.split``, ``up * act(gate)`` as Inductor decomposes it,
``aten.bmm``, ``aten.sum(.., [0])`` (the views in between elided). The shared expert stays in the graph.

It becomes ``rubin.moe(x, gate_up_proj.permute(0, 2, 1), down_proj.permute(0, 2, 1), w, ids, act,
apply_router_weight_on_input=True)`` with ``w = sigmoid(top.float()).to(scores.dtype)``: the router's own ops
between the scatter and the scores, replayed on the ``[T, k]`` top-k values (elementwise, so the values are the
scores at the routed positions, bit for bit). Why that is exact: expert ``e`` sees ``x[t] * scores[t, e]``, which
for a routed expert is ``x[t] * w[t, j]`` (rubin.moe's on-input product, in x's dtype), and for any other is
``x[t] * sigmoid(-inf) = x[t] * 0 = 0``; without biases the expert's output on a zero row is
``act(0) * 0 @ down_proj = 0``, so the sum over all E experts is the sum over the top k. Each condition is checked
in the graph, and the block stays as written, with the reason, when one fails: the fill is exactly -inf, the ops
between the scatter and the product are one sigmoid and dtype conversions (a softmax is no elementwise function of
the top-k values; no score function leaves the -inf in the inputs), what is scattered is the values of the top-k
whose indices say where, over the E experts, and neither projection has a bias (``FFN(0) = act(b13) @ W2 + b2``
would reach every unrouted token).

Why it is worth a rewrite: the dense form runs every expert on every token, E / k times the work of the routed
experts (Llama 4 Scout: 16 experts, top-1), and reads every expert's weights for every batch.

Walked by hand from the first bmm (whose input is the repeated hidden states times the transposed scores): a near
miss must be reported with the step that differs (the fill, the score function, a bias), which a pattern over the
whole block, matching or failing as a whole, cannot say. The activation is matched with Inductor's pattern matcher
(patterns traced from ``up * act(gate)``, Llama 4's operand order; ``hf_experts.match_activation`` reads
``act(gate) * up``); the split, the checks before the rewrite and the rewrite itself are hf_experts.py's.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.nn.functional as F

from rubin_compile.passes.base import GRADIENTS_REASON, PassContext, Rewrite, Unchanged
from rubin_compile.passes.fx import (
    CONVERTS,
    RESHAPES,
    call,
    getitem_of,
    inherit_source,
    is_call,
    strip_converts,
    tensor_val,
)
from rubin_compile.passes.match_moe.hf_experts import (
    Block,
    NoMatch,
    check_block,
    gpu_kernel_reason,
    ids_from_topk,
    match_activation,
    rewrite,
    same,
    sole_user,
)
from rubin_compile.passes.match_moe.hf_activation import HALVES, split_gate_up
from rubin_compile.passes.match_moe.routing import softmax_input

IDIOM = "hf llama4 dense experts"
FORM = "aten.bmm over all experts"
aten = torch.ops.aten


# ``up * act_fn(gate)``: Llama 4 writes the product this way round, which a pattern traced from ``act(gate) * up``
# does not match (the pattern matcher does not commute operands). Supported ones first; None: not rubin.moe's.
_UP_TIMES_ACT = {
    "silu": lambda gate, up: up * F.silu(gate),
    "gelu_tanh": lambda gate, up: up * F.gelu(gate, approximate="tanh"),
    "gelu": lambda gate, up: up * F.gelu(gate),
    "relu": lambda gate, up: up * F.relu(gate),
    "sigmoid": lambda gate, up: up * torch.sigmoid(gate),
}
_SUPPORTED = ("silu", "gelu_tanh", "gelu")  # rubin.moe's gated activations over gate rows then up rows


@functools.lru_cache(maxsize=None)
def _up_times_act_pattern(name: str, low_precision: bool):
    """``up * act(gate)`` as Inductor decomposes it (bf16 / fp16 add upcasts around the activation), and the numbers
    in it, sorted: a generated pattern ignores scalar arguments, so a match is checked against them."""
    from torch._inductor.pattern_matcher import fwd_only, gen_pattern_and_search_gm

    dtype = torch.bfloat16 if low_precision else torch.float32
    example = [torch.empty(4, 8, dtype=dtype), torch.empty(4, 8, dtype=dtype)]
    pattern, search_gm = gen_pattern_and_search_gm(_UP_TIMES_ACT[name], example, fwd_only)
    return pattern, _numbers(n for n in search_gm.graph.nodes if n.op == "call_function")


def _numbers(nodes) -> list[float]:
    return sorted(
        float(a)
        for n in nodes
        for a in list(n.args) + list(n.kwargs.values())
        if isinstance(a, (int, float)) and not isinstance(a, bool)
    )


def _match_up_times_act(b: Block, fc1: torch.fx.Node, split: tuple, act_out: torch.fx.Node) -> None:
    """Set ``b.activation`` from ``act_out = up * act(gate)``; the other operand order goes to
    ``hf_experts.match_activation``, which raises NoMatch with its reason when neither is there."""
    from torch._inductor.pattern_matcher import Match

    gate, up, interleaved, split_nodes = split
    gval = tensor_val(gate)
    low = gval is not None and gval.dtype in (torch.bfloat16, torch.float16)
    for name in _UP_TIMES_ACT:
        pattern, numbers = _up_times_act_pattern(name, low)
        m = pattern.match(act_out)
        if not isinstance(m, Match) or m.kwargs.get("gate") is not gate or m.kwargs.get("up") is not up:
            continue
        if _numbers(m.nodes) != numbers:
            continue
        if name not in _SUPPORTED:
            raise NoMatch(f"the experts' activation is up * {name}(gate); rubin.moe implements {list(_SUPPORTED)}")
        if interleaved:
            raise NoMatch(
                f"the experts' activation is {name} over interleaved gate / up columns; rubin.moe's {name} reads "
                "gate rows then up rows"
            )
        b.activation = name
        b.extra_details["gate_up"] = HALVES
        b.flow += split_nodes + [n for n in m.nodes if n not in (gate, up)]
        return
    match_activation(b, fc1, act_out, "down bmm")  # the split again, and every form hf_activation.py reads


def _bias_reason(node: torch.fx.Node, what: str) -> Optional[str]:
    user = next(iter(node.users)) if len(node.users) == 1 else None
    if is_call(user, aten.add.Tensor):
        other = user.args[1] if user.args[0] is node else user.args[0]
        return (
            f"the {what} output is added to {getattr(other, 'name', other)} (an expert bias): every expert runs on "
            "every token here and an unrouted one sees a zero input, whose output is zero only without biases "
            "(act(b13) * b13_up @ W2 + b2 otherwise), so the dense sum is not the top-k sum rubin.moe computes"
        )
    return None


def _score_chain(scores: torch.fx.Node) -> tuple[list[torch.fx.Node], torch.fx.Node]:
    """The ops between the scatter and the scores that scale the expert inputs (scores first), and the scatter;
    NoMatch unless they are Llama 4's: one sigmoid among dtype conversions, over a top-k scattered into -inf."""
    chain, node = [], scores
    while is_call(node, *CONVERTS, aten.sigmoid.default):
        chain.append(node)
        node = node.args[0]
    if not is_call(node, aten.scatter.src):
        if softmax_input(scores) is not None and is_call(strip_converts(softmax_input(scores)), aten.scatter.src):
            raise NoMatch(
                "the scattered router scores go through softmax, not Llama 4's sigmoid: its unrouted scores are 0 "
                "too, but its routed ones are a softmax over the k values, which this matcher does not replay (it "
                "replays an elementwise score function on the top-k values)"
            )
        below = node
        for _ in range(4):  # another elementwise score function over the scatter: name it
            below = below.args[0] if isinstance(below, torch.fx.Node) and below.args else None
            if is_call(strip_converts(below), aten.scatter.src):
                raise NoMatch(
                    f"the scattered router scores go through {node.target} before they scale the expert inputs; "
                    "this matcher takes Llama 4's sigmoid, which makes the -inf fill exactly 0"
                )
        raise NoMatch(
            f"the weights scaling the repeated hidden states come from {getattr(node, 'name', node)} "
            f"({getattr(node, 'target', node)}), not from top-k values scattered into the [T, E] scores "
            "(Llama4Router: full_like(logits, -inf).scatter_(1, ids, top), then sigmoid)"
        )
    sigmoids = [n for n in chain if is_call(n, aten.sigmoid.default)]
    if len(sigmoids) != 1:
        raise NoMatch(
            f"{len(sigmoids)} sigmoids between the scattered top-k values and the expert inputs; Llama 4's router "
            "has one, which maps the -inf fill of unrouted experts to exactly 0"
        )
    if any(is_call(n, *CONVERTS) and not tensor_val(n).dtype.is_floating_point for n in chain):
        raise NoMatch("the router scores are converted to a non-float dtype before they scale the expert inputs")
    return chain, node


def _check_scatter(scatter: torch.fx.Node, E: int, T: Any) -> tuple[torch.fx.Node, torch.fx.Node]:
    """(the top-k values, the top-k indices) that ``scatter`` writes into a -inf fill; NoMatch naming what differs."""
    base, dim, index, src = scatter.args[:4]
    sval = tensor_val(scatter)
    if dim not in (1, -1) or sval.dim() != 2 or not same(sval.shape[0], T) or sval.shape[1] != E:
        raise NoMatch(f"the scores are scattered along dim {dim} of {tuple(sval.shape)}, not along the E={E} experts")
    topk = getitem_of(index, 1, aten.topk.default)
    if topk is None or getitem_of(src, 0, aten.topk.default) is not topk:
        raise NoMatch(
            f"the scatter writes {getattr(src, 'name', src)} at {getattr(index, 'name', index)}, not the values of a "
            "top-k at its own indices (Llama4Router: scatter_(1, router_indices, router_top_value))"
        )
    if not is_call(base, aten.full.default):
        raise NoMatch(
            f"the top-k values are scattered into {getattr(base, 'name', base)}, not into a constant fill "
            "(torch.full_like(router_logits, -inf))"
        )
    fill = base.args[1]
    if fill != float("-inf"):
        after = torch.sigmoid(torch.tensor(float(fill), dtype=torch.float32)).item()
        what = (
            f"sigmoid({fill}) = {after:.6g}, so every expert adds its output for every token and the dense sum is "
            "not the top-k sum"
            if after != 0
            else f"sigmoid({fill}) rounds to 0 in float32, but only -inf is 0 after sigmoid in every dtype and "
            "implementation"
        )
        raise NoMatch(f"the top-k values are scattered into a fill of {fill}, not -inf: the unrouted scores are {what}")
    return src, index


def _match_block(fc1: torch.fx.Node, mul: torch.fx.Node, repeat: torch.fx.Node) -> tuple[Block, list[torch.fx.Node]]:
    """Recognise the block from its first bmm; (the block, the router's ops from the scores down to the scatter,
    replayed for the weights); NoMatch(reason) otherwise."""
    b = Block(form=FORM, fc1=fc1, fc2=fc1, apply_router_weight_on_input=True)
    w13 = fc1.args[1]
    w13v, xin = tensor_val(w13), tensor_val(fc1.args[0])
    if w13v is None or w13v.dim() != 3 or xin.dim() != 3:
        raise NoMatch(f"the first bmm ({fc1.name}) does not multiply [E, T, H] rows by a stored [E, H, 2I] weight")
    E = w13v.shape[0]
    x = repeat.args[0]
    xv = tensor_val(x)
    if xv is None or xv.dim() != 2 or list(repeat.args[1]) != [E, 1]:
        raise NoMatch(
            f"the expert inputs repeat {getattr(x, 'name', x)} by {list(repeat.args[1])}, not the [T, H] hidden "
            f"states once per expert (hidden_states.repeat(E={E}, 1))"
        )
    T, H = xv.shape
    if not (same(xin.shape[0], E) and same(xin.shape[1], T) and same(xin.shape[2], H)):
        raise NoMatch(f"the repeated rows reach the bmm as {tuple(xin.shape)}, not as [E={E}, T, H] (expert-major)")
    b.hidden, b.w13, b.w13_transposed = x, w13, True

    # routed_in = x.repeat(E, 1) * scores.transpose(0, 1).reshape(-1, 1)
    col = mul.args[1] if mul.args[0] is repeat else mul.args[0]
    colv = tensor_val(col)
    chain = [col]
    node = col.args[0] if is_call(col, *RESHAPES) else None
    if is_call(node, aten.clone.default):
        chain.append(node)
        node = node.args[0]
    if not (is_call(node, aten.permute.default) and list(node.args[1]) == [1, 0]):
        raise NoMatch(
            f"the repeated hidden states are multiplied by {getattr(col, 'name', col)}, not by the [T, E] router "
            "scores transposed to one column, expert-major (scores.transpose(0, 1).reshape(-1, 1))"
        )
    scores = node.args[0]
    sv = tensor_val(scores)
    if colv is None or colv.dim() != 2 or colv.shape[1] != 1 or sv is None or sv.dim() != 2 or sv.shape[1] != E:
        raise NoMatch(f"the routing column {getattr(col, 'name', col)} is not the [T, E={E}] scores as [E*T, 1]")
    if sv.dtype != xv.dtype:
        raise NoMatch(
            f"the router scores are {sv.dtype} and the hidden states {xv.dtype}: the product would be computed in "
            "the promoted dtype, and rubin.moe scales the input in the hidden states' dtype"
        )
    b.flow += [repeat, mul, *chain, node, fc1.args[0]]
    score_ops, scatter = _score_chain(scores)
    b.topk_weights, b.topk_ids = _check_scatter(scatter, E, T)
    why = ids_from_topk(b, E)
    if why is not None:
        raise NoMatch(why)
    b.aux += [*score_ops, scatter, scatter.args[0]]

    # gate, up = bmm(routed_in, gate_up_proj).chunk(2); y = bmm(up * act(gate), down_proj)
    reason = _bias_reason(fc1, "gate_up bmm")
    if reason:
        raise NoMatch(reason)
    b.flow.append(fc1)
    split = split_gate_up(fc1)
    act_out = sole_user(split[1], "up")
    fc2 = sole_user(act_out, "the gated activation")
    if not (is_call(fc2, aten.bmm.default) and fc2.args[0] is act_out):
        raise NoMatch(f"the gated activation feeds {fc2.name} ({fc2.target}), not the down projection's bmm")
    b.fc2, b.w2, b.w2_transposed = fc2, fc2.args[1], True
    w2v = tensor_val(b.w2)
    if w2v is None or w2v.dim() != 3 or w2v.shape[0] != E:
        raise NoMatch(f"the down bmm's weight is not a stored [E={E}, I, H] tensor")
    _match_up_times_act(b, fc1, split, act_out)
    reason = _bias_reason(fc2, "down bmm")
    if reason:
        raise NoMatch(reason)
    b.flow.append(fc2)

    # y.view(-1, H).reshape(E, -1, H).sum(dim=0): row-major reshapes back to [E, T, H] are the identity
    y, y_shape = fc2, tuple(tensor_val(fc2).shape)
    views = []
    while is_call(sole_user(y, f"the expert outputs ({y.name})"), *RESHAPES):
        y = sole_user(y, "the expert outputs")
        views.append(y)
    total = sole_user(y, "the expert outputs")
    yv = tensor_val(y)
    if len(yv.shape) != len(y_shape) or not all(same(a, c) for a, c in zip(yv.shape, y_shape)):
        raise NoMatch(f"the expert outputs are summed as {tuple(yv.shape)}, not as the [E, T, H] the bmm writes")
    keepdim = total.args[2] if len(total.args) > 2 else total.kwargs.get("keepdim", False)
    if not (is_call(total, aten.sum.dim_IntList) and list(total.args[1]) in ([0], [-3]) and not keepdim):
        raise NoMatch(f"the [E, T, H] expert outputs feed {total.name} ({total.target}), not a sum over the experts")
    if tensor_val(total).dtype != xv.dtype:
        raise NoMatch(f"the block returns {tensor_val(total).dtype}, not the hidden states' {xv.dtype}")
    b.flow += [*views, total]
    b.final = total
    b.extra_details.update(
        experts=f"dense: every one of the {E} experts ran on every token; rubin.moe runs the top-k",
        router_weight="on the expert input (apply_router_weight_on_input), as the dense form scales its rows",
        routing_weights=f"the top-k values, then {_describe(score_ops)}: the router's own ops (its unrouted scores "
        "are sigmoid(-inf) = 0)",
    )
    check_block(b)
    return b, score_ops


def _describe(score_ops: list[torch.fx.Node]) -> str:
    """The score function as the router applies it, scatter side first: "to float32, sigmoid, to bfloat16"."""
    return ", ".join(
        "sigmoid" if is_call(n, aten.sigmoid.default) else f"to {str(tensor_val(n).dtype).replace('torch.', '')}"
        for n in reversed(score_ops)
    )


def _candidates(graph: torch.fx.Graph):
    """(bmm, mul, repeat) for each ``bmm(reshape(repeat(x, ...) * col), W)`` with W a stored 3-D weight: the first
    bmm of the dense form, the only shape of this idiom's anchor."""
    for node in graph.nodes:
        if not is_call(node, aten.bmm.default):
            continue
        view = node.args[0]
        mul = view.args[0] if is_call(view, *RESHAPES) else None
        if not is_call(mul, aten.mul.Tensor):
            continue
        repeats = [a for a in mul.args if is_call(a, aten.repeat.default)]
        if len(repeats) == 1:
            yield node, mul, repeats[0]


def match(graph: torch.fx.Graph, ctx: PassContext) -> tuple[list[Rewrite], list[Unchanged]]:
    """Rewrite every Llama 4 dense experts block in ``graph`` into ``rubin.moe``."""
    rewrites: list[Rewrite] = []
    unchanged: list[Unchanged] = []
    for fc1, mul, repeat in list(_candidates(graph)):
        if ctx.gradients:
            unchanged.append(Unchanged(fc1.name, IDIOM, GRADIENTS_REASON))
            continue
        try:
            block, score_ops = _match_block(fc1, mul, repeat)
        except NoMatch as e:
            unchanged.append(Unchanged(fc1.name, IDIOM, str(e)))
            continue
        reason = gpu_kernel_reason(block, ctx.target)
        if reason is not None:
            unchanged.append(Unchanged(fc1.name, IDIOM, reason))
            continue
        rewrites.append(_rewrite(graph, block, score_ops))
    return rewrites, unchanged


def _rewrite(graph: torch.fx.Graph, b: Block, score_ops: list[torch.fx.Node]) -> Rewrite:
    """The router's score function replayed on the [T, k] top-k values (scatter side first), then hf_experts'
    rewrite with those weights on the input."""
    with graph.inserting_before(b.final):
        w = b.topk_weights
        replayed = []
        for op in reversed(score_ops):
            w = call(graph, op.target, (w, *op.args[1:]), dict(op.kwargs))
            replayed.append(w)
    inherit_source(replayed, score_ops[0])
    b.topk_weights = w
    return rewrite(graph, b, IDIOM)
