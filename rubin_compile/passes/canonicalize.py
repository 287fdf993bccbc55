"""canonicalize: put the graph in the form the matchers expect.

Today that is dead-code elimination (Dynamo and AOTAutograd leave unused views and size computations
that would otherwise count as extra users of an intermediate and block a match) and a census of the ops
the later passes look for, written to the report so a user sees what the graph held.
"""

from __future__ import annotations

import collections

import torch

from rubin_compile.passes.base import Pass, PassContext, PassResult

NAME = "canonicalize"

# Ops whose presence the report counts: the raw material of match_moe / match_attention / match_gemm.
CENSUS = (
    "topk",
    "mm",
    "addmm",
    "bmm",
    "_grouped_mm",
    "grouped_mm_fallback",
    "cpu_fused_moe",
    "moe_forward",
    "moe_forward_shared",
    "scaled_dot_product",
    "unified_attention_with_output",
)


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    # auto_functionalized(op, ...) and auto_functionalized_v2(op, ...) wrap a mutating op: count the op.
    if (
        isinstance(target, torch._ops.HigherOrderOperator)
        and node.args
        and isinstance(node.args[0], torch._ops.OpOverload)
    ):
        target = node.args[0]
    return getattr(target, "__name__", str(target))


def run(graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
    result = PassResult(NAME)
    before = len(graph.nodes)
    graph.eliminate_dead_code()
    removed = before - len(graph.nodes)
    result.changed = removed > 0
    if removed:
        result.notes.append(f"removed {removed} dead node(s)")
    census: collections.Counter[str] = collections.Counter()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        name = _op_name(node)
        for key in CENSUS:
            if key in name:
                census[name.split(".")[0]] += 1
                break
    if census:
        result.notes.append("ops of interest: " + ", ".join(f"{k} x{v}" for k, v in sorted(census.items())))
    return result


PASS = Pass(NAME, run)
