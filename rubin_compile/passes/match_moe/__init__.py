"""match_moe: rewrite every mixture-of-experts idiom we recognise into ``rubin.moe``.

Each matcher is a module of this package with ``IDIOM`` (a short name for reports) and
``match(graph, ctx) -> (list[Rewrite], list[Unchanged])``; its docstring quotes the source idiom it
recognises: ``vllm_cpu`` (vLLM's CPU op ``_C.cpu_fused_moe``), ``vllm_layer`` (vLLM's layer op
``vllm.moe_forward``), ``hf_grouped_mm`` and ``hf_batched_mm`` (Hugging Face experts in their two forms),
``hf_llama4`` (Llama 4's dense experts: every expert on every token, the routing weight on the input) and
``expert_loop`` (plain-PyTorch loops over the experts). Matchers run in the order of ``MATCHERS``; each leaves alone
what it does not fully recognise, with the reason recorded. A router whose experts no matcher took or explained (a
top-k, or an argmax, of the scores of a linear projection, whose expert ids reach no ``rubin.moe`` and no block a
matcher reported) is reported too, with the most likely reason: its ids, or a dispatch mask made from them, leave
the graph (a graph break: an experts loop over ``nonzero()``, transformers' ``eager`` experts implementation or a
model's own), it routes to one expert (a dense MLP), or its experts are in a form no matcher knows. In a training
graph (``ctx.gradients``) each leaves every block it finds alone, with ``GRADIENTS_REASON``: the forward keeps the
experts' intermediates for the backward.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch

from rubin_compile.passes.base import GRADIENTS_REASON, Pass, PassContext, PassResult, Unchanged
from rubin_compile.passes.fx import is_call, tensor_val
from rubin_compile.passes.match_moe import expert_loop, hf_batched_mm, hf_grouped_mm, hf_llama4, vllm_cpu, vllm_layer
from rubin_compile.passes.match_moe.routing import read_selection

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


def _routers(graph: torch.fx.Graph) -> dict[torch.fx.Node, list[tuple[torch.fx.Node, torch.fx.Node, dict]]]:
    """The routers of the graph by their projection: for each, (choice, its expert ids, the selection read) of every
    ``aten.topk`` (its indices; the values may be unused: weights gathered from the scores), ``aten.argmax`` or the
    indices of ``aten.max.dim`` (a top-1: Switch Transformers; NLLB-MoE's two, the second over the logits without the
    first) over the scores of a
    linear projection (routing.read_selection). One router, one block: its choices are explained together."""
    out: dict[torch.fx.Node, list] = {}
    for node in graph.nodes:
        if is_call(node, torch.ops.aten.topk.default):
            ids = next((u for u in node.users if is_call(u, operator.getitem) and u.args[1] == 1), None)
        elif is_call(node, torch.ops.aten.argmax.default):
            ids = node
        elif is_call(node, torch.ops.aten.max.dim):  # torch.max(probs, dim=-1): Switch Transformers before 5.17
            ids = next((u for u in node.users if is_call(u, operator.getitem) and u.args[1] == 1), None)
        else:
            continue
        if ids is None:
            continue
        selection, projection = read_selection(node)
        if node.target is not torch.ops.aten.topk.default and not _one_hot(ids, selection.get("num_experts")):
            continue  # an argmax / max that is no dispatch (a greedy decode's next token)
        if selection.get("router") == "linear":  # not a router's top-k otherwise (a sampling top-k, a group score's)
            out.setdefault(projection, []).append((node, ids, selection))
    return out


def _one_hot(ids: torch.fx.Node, num: Optional[int]) -> bool:
    """``one_hot(ids, num_classes=num)``, as it reaches the graph: ``eq(ids.unsqueeze(-1), iota(num))``."""
    for u in ids.users:
        if is_call(u, torch.ops.aten.unsqueeze.default) and u.args[1] == -1:
            for eq in u.users:
                if is_call(eq, torch.ops.aten.eq.Tensor) and eq.args[0] is u:
                    iota = eq.args[1]
                    if is_call(iota, torch.ops.prims.iota.default) and num is not None and iota.args[0] == num:
                        return True
    return False


def _leaves_graph(ids: torch.fx.Node, graph: torch.fx.Graph) -> bool:
    """The ids, or an integer / bool tensor computed from them (a dispatch mask), are an output of the graph: the
    experts that read them run in another graph."""
    outputs = set(graph.output_node().all_input_nodes)
    for n in _downstream(ids) | {ids}:
        val = tensor_val(n)
        if n in outputs and val is not None and not val.is_floating_point():
            return True
    return False


def _routers_left_alone(graph: torch.fx.Graph, result: PassResult) -> list[Unchanged]:
    """An ``Unchanged`` for each router whose expert ids reach neither a ``rubin.moe`` nor a block a matcher
    reported: the most likely reason, so that no MoE block is left alone without one."""
    explained = {u.node for u in result.unchanged}
    out = []
    for choices in _routers(graph).values():
        reach = set().union(*(_downstream(ids) | {node, ids} for node, ids, _ in choices))
        if any(n.target is torch.ops.rubin.moe.default or n.name in explained for n in reach):
            continue
        node, ids, selection = choices[0]
        if any(_leaves_graph(choice_ids, graph) for _, choice_ids, _ in choices):
            why = (
                "its expert ids leave this graph (a graph break): the experts run in another graph or eagerly, and no "
                "rewrite sees the whole block. A loop over the experts hit (nonzero(), then a Python int per expert) "
                "breaks the graph: transformers' experts_implementation='eager' does, where 'grouped_mm' (the default) "
                "or 'batched_mm' (model.set_experts_implementation(...)) compiles in one graph; an experts class that "
                "writes such a loop itself, without that interface, needs its forward changed"
            )
        elif selection.get("num_experts") == 1:
            why = (
                "a router over one expert (E = 1): every token goes to it, scaled by its routing weight, a dense MLP "
                "rather than a mixture. The expert-loop matcher groups per-expert masks from two experts up and no "
                "other matcher took the block, so it stays as written for Inductor"
            )
        else:
            why = f"the experts its ids select are in a form no matcher recognises (the forms: {KNOWN_FORMS})"
        out.append(Unchanged(node.name, ROUTER, why))
    return out


PASS = Pass(NAME, run, reads=("engine", "gradients", "target"))
