"""match_moe: rewrite every mixture-of-experts idiom we recognise into ``rubin.moe``.

Each matcher is a module of this package with ``IDIOM`` (a short name for reports) and
``match(graph, ctx) -> (list[Rewrite], list[Unchanged])``; its docstring quotes the source idiom it
recognises: ``vllm_cpu`` (vLLM's CPU op ``_C.cpu_fused_moe``), ``vllm_layer`` (vLLM's layer op
``vllm.moe_forward``), ``hf_grouped_mm`` and ``hf_batched_mm`` (Hugging Face experts in their two forms),
``hf_llama4`` (Llama 4's dense experts: every expert on every token, the routing weight on the input) and
``expert_loop`` (plain-PyTorch loops over the experts). Matchers run in the order of ``MATCHERS``; each leaves alone what it does not fully recognise,
with the reason recorded. A router whose experts no matcher took or explained (a top-k of softmax / sigmoid
router scores whose expert ids reach no ``rubin.moe`` and no block a matcher reported) is reported too, with
the most likely reason: its ids leave the graph (a graph break: transformers' ``eager`` experts loop breaks the
graph at its ``nonzero()``), or its experts are in a form no matcher knows. In a training graph (``ctx.gradients``) each leaves every block it finds alone, with
``GRADIENTS_REASON``: the forward keeps the experts' intermediates for the backward.
"""

from __future__ import annotations

import operator

import torch

from rubin_compile.passes.base import GRADIENTS_REASON, Pass, PassContext, PassResult, Unchanged
from rubin_compile.passes.fx import is_call
from rubin_compile.passes.match_moe import expert_loop, hf_batched_mm, hf_grouped_mm, hf_llama4, vllm_cpu, vllm_layer
from rubin_compile.passes.match_moe.routing import describe_routing

NAME = "match_moe"

# Order matters only where idioms could overlap; the specific vLLM forms go first.
MATCHERS = (vllm_cpu, vllm_layer, hf_grouped_mm, hf_batched_mm, hf_llama4, expert_loop)
ROUTER = "MoE router (top-k)"
KNOWN_FORMS = (
    "Hugging Face experts in their grouped_mm (the default) and batched_mm forms, Llama 4's dense experts (every "
    "expert on every token, weighted on the input), plain-PyTorch loops over the experts with per-expert masks, "
    "vLLM's MoE layers"
)


def run(graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
    result = PassResult(NAME)
    for matcher in MATCHERS:
        rewrites, unchanged = matcher.match(graph, ctx)
        result.rewrites.extend(rewrites)
        result.unchanged.extend(unchanged)
    if ctx.gradients and not result.unchanged:
        # A training compile whose experts are not in this graph (Hugging Face's experts break the graph when
        # they need gradients): the router's top-k is what is left to say it of.
        for node in graph.nodes:
            if is_call(node, torch.ops.aten.topk.default):
                result.unchanged.append(Unchanged(node.name, ROUTER, GRADIENTS_REASON))
    elif not ctx.gradients:
        result.unchanged.extend(_routers_left_alone(graph, result))
    result.changed = bool(result.rewrites)
    if result.changed:
        graph.lint()
    return result


def _downstream(start: torch.fx.Node) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    todo = [start]
    while todo:
        for user in todo.pop().users:
            if user not in seen:
                seen.add(user)
                todo.append(user)
    return seen


def _routers_left_alone(graph: torch.fx.Graph, result: PassResult) -> list[Unchanged]:
    """An ``Unchanged`` for each router whose expert ids reach neither a ``rubin.moe`` nor a block a matcher
    reported: the most likely reason, so that no MoE block is left alone without one."""
    explained = {u.node for u in result.unchanged}
    out = []
    for node in graph.nodes:
        if not is_call(node, torch.ops.aten.topk.default):
            continue
        values = ids = None
        for user in node.users:
            if is_call(user, operator.getitem):
                values, ids = (user, ids) if user.args[1] == 0 else (values, user)
        if ids is None or values is None or describe_routing(values, ids).get("router") != "linear":
            continue  # not a router's top-k (a top-k of router scores computed from a linear projection)
        reach = _downstream(ids) | {node, values, ids}
        if any(n.target is torch.ops.rubin.moe.default or n.name in explained for n in reach):
            continue
        if ids in graph.output_node().all_input_nodes:  # the ids themselves are an output: the graph breaks here
            why = (
                "its expert ids leave this graph (a graph break): the experts run in another graph or eagerly, and no "
                "rewrite sees the whole block. transformers' experts_implementation='eager' loops over the experts "
                "hit, which breaks the graph at nonzero(); use 'grouped_mm' (the default) or 'batched_mm' "
                "(model.set_experts_implementation(...)) and compile again"
            )
        else:
            why = f"the experts its ids select are in a form no matcher recognises (the forms: {KNOWN_FORMS})"
        out.append(Unchanged(node.name, ROUTER, why))
    return out


PASS = Pass(NAME, run, reads=("engine", "gradients", "target"))
