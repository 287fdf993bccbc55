"""match_moe: rewrite every mixture-of-experts idiom we recognise into ``rubin.moe``.

Each matcher is a module of this package with ``IDIOM`` (a short name for reports) and
``match(graph, ctx) -> (list[Rewrite], list[Unchanged])``; its docstring quotes the source idiom it
recognises. Matchers run in the order of ``MATCHERS``; each leaves alone what it does not fully recognise,
with the reason recorded. In a training graph (``ctx.gradients``) each leaves every block it finds alone, with
``GRADIENTS_REASON``: the forward keeps the experts' intermediates for the backward.
"""

from __future__ import annotations

import torch

from rubin_compile.passes.base import GRADIENTS_REASON, Pass, PassContext, PassResult, Unchanged
from rubin_compile.passes.fx import is_call
from rubin_compile.passes.match_moe import expert_loop, hf_grouped_mm, vllm_cpu, vllm_layer

NAME = "match_moe"

# Order matters only where idioms could overlap; the specific vLLM forms go first.
MATCHERS = (vllm_cpu, vllm_layer, hf_grouped_mm, expert_loop)


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
                result.unchanged.append(Unchanged(node.name, "MoE router (top-k)", GRADIENTS_REASON))
    result.changed = bool(result.rewrites)
    if result.changed:
        graph.lint()
    return result


PASS = Pass(NAME, run, reads=("engine", "gradients"))
