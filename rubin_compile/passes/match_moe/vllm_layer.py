"""Matcher: vLLM's opaque MoE layer op, ``vllm.moe_forward`` / ``vllm.moe_forward_shared``, into
``rubin.vllm_moe_layer`` / ``rubin.vllm_moe_layer_shared``.

The idiom, as vLLM 0.32 builds it on GPUs (``vllm/model_executor/layers/fused_moe/runner/moe_runner.py``:
``MoERunner.forward`` calls the op, whose implementation looks the layer up by name and runs
``_forward_impl``; on the CPU build the same op appears when ``MoERunner._select_forward`` returns it).
``moe_forward`` declares ``hidden_states`` mutated, so it sits behind ``auto_functionalized``::

    out = auto_functionalized(vllm.moe_forward.default, hidden_states=x, router_logits=logits,
                              shared_experts_input=None, input_ids=None, layer_name=L,
                              hidden_dim_unpadded=0)[0]
    shared, fused = vllm.moe_forward_shared.default(x, logits, x_shared, None, L, 0)   # getitem 0, 1

(``auto_functionalized_v2(..., _hidden_states_base_index=0, _all_bases=[x])`` when Inductor's v2 is on.)
``L`` is a graph input holding vLLM's hoisted ``LayerName`` (torch >= 2.11), or a string. The layer's weights
and routing settings are not in the graph: the rewrite keeps ``L`` and lets the new op find the layer at run
time, as vLLM's op does (integrations/vllm/layer_ops.py), so no weight becomes a graph constant. At compile time the
matcher reads the layer from the forward context vLLM compiles under (or vLLM's current config) to check
that rubin reproduces it and to record E, H, I, k, dtype and the routing in the report. Everything it knows of
vLLM's layers it asks the engine adapter on the pass context (integrations/vllm/engine.py); this module
imports nothing of vLLM.

What the layer's experts compute is read as vLLM's kernels compute it (integrations/vllm/layer_ops.py,
``experts_activation``): its activation with the constants its kernel reads (SiLU with a ``swiglu_limit`` is
``silu_clamp:<limit>`` on the Triton experts, ``swigluoai_uninterleave`` takes the layer's alpha and limit, the
``_no_mul`` activations read w13 as [E, I, H]), and ``apply_router_weight_on_input`` (Llama 4; vLLM's prepare()
scales the input by the top-1 weight) becomes rubin.moe's flag of that name, which selection gives only to kernels
that declare it (on a CUDA target a layer whose rubin.moe only the reference would run stays with vLLM's fused MoE).

Left alone, with the reason: quantised methods, expert / data parallel layers, LoRA, activations
``rubin.moe`` lacks and activation constants the layer sets but its vLLM kernel ignores (vLLM's CPU experts run a
``swiglu_limit`` layer's SiLU unclamped), the router weight on the input with top-k > 1 (vLLM asserts top-1),
weight layouts rubin does not undo (FlashInfer / AITER shuffles), a read of the
mutated ``hidden_states`` after the call, a layer name resolved from the forward context's order
(``VLLM_USE_LAYERNAME=0`` on torch < 2.11), and a layer that cannot be found at compile time.

Why a hand walk and not ``torch._inductor.pattern_matcher``: the op is opaque and mutating (behind
``auto_functionalized``), and whether it matches depends on the layer object, not on the graph.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from rubin_compile.ops.moe import call_features
from rubin_compile.passes.base import PassContext, Rewrite, Unchanged
from rubin_compile.passes.match_moe.emit import reference_only_reason
from rubin_compile.passes.fx import (
    MutatingCall,
    bound_arguments,
    call,
    decode_mutating_call,
    inherit_source,
    schema_name,
)

IDIOM = "vllm.moe_forward (layer op)"

OPS = {"vllm::moe_forward": False, "vllm::moe_forward_shared": True}  # name -> has shared experts


def match(graph: torch.fx.Graph, ctx: PassContext) -> tuple[list[Rewrite], list[Unchanged]]:
    rewrites: list[Rewrite] = []
    unchanged: list[Unchanged] = []
    for node in list(graph.nodes):
        mc = _read_call(node)
        if mc is None:
            continue
        shared = OPS[schema_name(mc.op)]
        layer, reason = _find_layer(mc, ctx)
        if reason is None:
            reason = _graph_reason(mc, shared) or ctx.engine.moe_layer_unsupported(layer, shared)
        if reason is None:
            d = ctx.engine.moe_layer_details(layer)
            sizes = {n: d.get(n) for n in ("E", "H", "I", "k")}
            features = call_features(d["apply_router_weight_on_input"], False)
            reason = reference_only_reason(ctx.target, d["dtype"], d["dtype"], sizes, d["activation"], features)
        if reason is not None:
            unchanged.append(Unchanged(node.name, IDIOM, reason))
            continue
        rewrites.append(_rewrite(graph, mc, layer, shared, ctx))
    return rewrites, unchanged


def _read_call(node: torch.fx.Node) -> Optional[MutatingCall]:
    """``moe_forward`` under auto_functionalized(_v2), or a plain ``moe_forward_shared`` call."""
    mc = decode_mutating_call(node)
    if mc is not None:
        return mc if schema_name(mc.op) in OPS else None
    if (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and schema_name(node.target) in OPS
    ):
        return MutatingCall(node, node.target, 0, bound_arguments(node), {})
    return None


def _layer_name(mc: MutatingCall, ctx: PassContext) -> tuple[Optional[str], Optional[str]]:
    """(name, None) or (None, why not)."""
    ln = mc.args["layer_name"]
    if isinstance(ln, torch.fx.Node):
        val = ln.meta.get("val")
        if val is None:
            return None, f"layer_name input {ln.name} has no recorded value"
        ln = val
    name = ctx.engine.layer_name(ln)
    if not isinstance(name, str):
        return None, f"layer_name is a {type(ln).__name__}"
    if name == "from_forward_context":
        return None, (
            "the layer is resolved from the forward context's call order (VLLM_USE_LAYERNAME=0 or "
            "torch < 2.11); rubin needs the layer's name"
        )
    return name, None


def _find_layer(mc: MutatingCall, ctx: PassContext) -> tuple[Any, Optional[str]]:
    name, reason = _layer_name(mc, ctx)
    if reason is not None:
        return None, reason
    return ctx.engine.find_layer(name)


def _graph_reason(mc: MutatingCall, shared: bool) -> Optional[str]:
    if mc.view_args:
        return "hidden_states is passed as a view of a larger buffer"
    if mc.args.get("hidden_dim_unpadded") not in (0, None):
        return "hidden_dim_unpadded > 0 (the layer's kernel writes a narrower output)"
    keep = {0, 1} if shared else {0}
    extra = mc.other_users(keep)
    if extra:
        what = "the mutated hidden_states" if not shared else "an unexpected result"
        return f"an extra user of {what} after the call ({', '.join(u.name for u in extra)})"
    return None


def _rewrite(graph: torch.fx.Graph, mc: MutatingCall, layer: Any, shared: bool, ctx: PassContext) -> Rewrite:
    a = mc.args
    node = mc.node
    target = ctx.engine.moe_layer_op(shared)
    with graph.inserting_before(node):
        new = call(
            graph,
            target,
            (a["hidden_states"], a["router_logits"], a["shared_experts_input"], a["input_ids"], a["layer_name"]),
        )
    inherit_source([new], node)
    replaced = [node.name]
    if shared:
        # The tuple result: getitem 0 (shared out) and 1 (fused out) keep reading the new node.
        node.replace_all_uses_with(new)
    else:
        for user in list(node.users):  # getitem 0 is the layer's output; other getitems are unused
            if user.args[1] == 0:
                user.replace_all_uses_with(new)
            replaced.append(user.name)
            graph.erase_node(user)
    graph.erase_node(node)
    details = ctx.engine.moe_layer_details(layer)
    details["op"] = schema_name(mc.op)
    details["auto_functionalized"] = f"v{mc.version}" if mc.version else "none"
    return Rewrite(
        new.name, "rubin.vllm_moe_layer_shared" if shared else "rubin.vllm_moe_layer", IDIOM, replaced, details
    )
