"""Matcher (d): a plain PyTorch loop over experts, as Dynamo unrolls it.

Source idiom (plain PyTorch; the compile-friendly "dense mask" form, which Dynamo traces without a graph
break because no shape depends on the routing)::

    logits = self.router(x)                                   # x: [T, H]
    w, ids = torch.topk(logits.softmax(-1), k)                # or topk then softmax, renormalised or not
    out = torch.zeros_like(x)
    for e, expert in enumerate(self.experts):                 # unrolled by Dynamo: E copies below
        w_e = (w * (ids == e)).sum(-1, keepdim=True)          # this token's weight for expert e (or 0)
        out = out + w_e * expert.down(F.silu(expert.gate(x)) * expert.up(x))   # or GELU-tanh

Post-grad ATen, per expert (SiLU shown as Inductor decomposes it)::

    eq = aten.eq.Scalar(ids, e); m = aten.mul.Tensor(w, eq); w_e = aten.sum.dim_IntList(m, [-1], True)
    g = aten.mm(x, aten.permute(W_gate_e, [1, 0])); u = aten.mm(x, aten.permute(W_up_e, [1, 0]))
    y = aten.mm(act(g) * u, aten.permute(W_down_e, [1, 0])); term = aten.mul.Tensor(w_e, y)
    out = aten.add.Tensor(... aten.add.Tensor(term_0, term_1) ..., term_{E-1})

The expert bodies are matched with Inductor's pattern matcher (patterns traced from plain functions with
Inductor's own decompositions, so SiLU and GELU-tanh match whatever form Inductor gives them). The
per-expert mask, the sum over the unrolled loop and the grouping of E bodies into one op are walked by
hand: the pattern matcher matches one fixed-size pattern, and the number of experts is not fixed.

The loop form that indexes tokens (``idx, top = torch.where(mask[e])``, Mixtral's older Hugging Face
code) has data-dependent shapes; Dynamo breaks the graph there, so no single graph holds an expert loop
to rewrite, and this matcher does not see it.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from rubin_compile.ops.nodes import bound_arguments
from rubin_compile.passes.base import GRADIENTS_REASON, PassContext, Rewrite, Unchanged
from rubin_compile.passes.fx import call, dtype_name, inherit_source, is_call, report_value, single_user, tensor_val
from rubin_compile.passes.match_moe.emit import emit_moe
from rubin_compile.passes.match_moe.routing import describe_routing

IDIOM = "expert loop"
aten = torch.ops.aten


def _ffn(x, w_gate, w_up, w_down, act):
    return torch.mm(act(torch.mm(x, w_gate.permute(1, 0))) * torch.mm(x, w_up.permute(1, 0)), w_down.permute(1, 0))


def _ffn_silu(x, w_gate, w_up, w_down):
    return _ffn(x, w_gate, w_up, w_down, F.silu)


def _ffn_gelu_tanh(x, w_gate, w_up, w_down):
    return _ffn(x, w_gate, w_up, w_down, lambda t: F.gelu(t, approximate="tanh"))


def _ffn_gelu(x, w_gate, w_up, w_down):  # exact GELU: recognised so the report can say why it is left
    return _ffn(x, w_gate, w_up, w_down, F.gelu)


def _ffn_relu(x, w_gate, w_up, w_down):
    return _ffn(x, w_gate, w_up, w_down, F.relu)


# activation name -> search function; None marks activations rubin.moe does not implement.
_BODIES = {"silu": _ffn_silu, "gelu_tanh": _ffn_gelu_tanh, "gelu": _ffn_gelu, "relu": _ffn_relu}
SUPPORTED = ("silu", "gelu_tanh", "gelu")  # rubin.moe's gated activations over gate then up


@functools.lru_cache(maxsize=None)
def _body_pattern(activation: str, dtype: torch.dtype):
    from torch._inductor.pattern_matcher import fwd_only, gen_pattern

    args = [
        torch.empty(4, 8, dtype=dtype),
        torch.empty(6, 8, dtype=dtype),
        torch.empty(6, 8, dtype=dtype),
        torch.empty(8, 6, dtype=dtype),
    ]
    return gen_pattern(_BODIES[activation], args, fwd_only)


@dataclass
class _Expert:
    index: int
    eq: torch.fx.Node
    masked: torch.fx.Node
    weight: torch.fx.Node  # [T, 1] this token's weight for the expert
    term: Optional[torch.fx.Node] = None  # weight * body output
    body_nodes: tuple = ()
    x: Optional[torch.fx.Node] = None
    w_gate: Optional[torch.fx.Node] = None
    w_up: Optional[torch.fx.Node] = None
    w_down: Optional[torch.fx.Node] = None
    activation: Optional[str] = None


def _mask_weight(eq: torch.fx.Node) -> tuple[Optional[torch.fx.Node], Optional[torch.fx.Node], str]:
    """From ``ids == e``: the (w * mask) node and the per-token weight ``sum(-1, keepdim)``; or a reason."""
    masked = single_user(eq)
    if masked is None or masked.target not in (aten.mul.Tensor, aten.where.self):
        return None, None, "the expert mask (ids == e) is not used only to mask the top-k weights"
    summed = single_user(masked)
    if (
        summed is None
        or summed.target != aten.sum.dim_IntList
        or list(summed.args[1]) not in ([-1], [1])
        or not (len(summed.args) > 2 and summed.args[2] or summed.kwargs.get("keepdim"))
    ):
        return None, None, "the masked top-k weights are not summed over k (keepdim) alone"
    return masked, summed, ""


def _topk_weights_of(masked: torch.fx.Node, eq: torch.fx.Node) -> Optional[torch.fx.Node]:
    if masked.target == aten.mul.Tensor:
        others = [a for a in masked.args if a is not eq]
        return others[0] if len(others) == 1 and isinstance(others[0], torch.fx.Node) else None
    # where(mask, w, 0)
    if masked.args[0] is eq and masked.args[2] in (0, 0.0):
        return masked.args[1]
    return None


def _match_body(node: torch.fx.Node, dtype: torch.dtype):
    """Try every activation's expert-body pattern at ``node``: (activation, match, "") on success, else
    (None, None, reason). The pattern matcher refuses a body whose intermediates have outside users
    ("multiple_users"); that is reported as such."""
    from torch._inductor.pattern_matcher import Match

    failures = []
    for activation in _BODIES:
        m = _body_pattern(activation, dtype).match(node)
        if isinstance(m, Match):
            return activation, m, ""
        failures.append((activation, m))
    if any(f.format_string.startswith("multiple_users") for _, f in failures):
        return None, None, "an intermediate of its body has another user outside the expert"
    stops = {a: _stopped_at(f) for a, f in failures}
    if len(set(stops.values())) == 1:
        where = f"every form stops at {next(iter(stops.values()))}"
    else:
        where = "; ".join(f"{a}: stops at {s}" for a, s in stops.items())
    return None, None, f"its body is not down(act(gate(x)) * up(x)) with a known activation ({where})"


def _stopped_at(failure) -> str:
    """Where a failed pattern match stopped: the kind of mismatch (the head of the pattern matcher's message,
    "function_mismatch: node={}, pattern={}"), the graph node it names and what that computes from what (its op,
    its inputs' ops). Read from the FailedMatch's arguments: the pattern's text is never formatted."""
    kind = failure.format_string.split(":", 1)[0].strip()
    found = next((a for a in failure.args if isinstance(a, torch.fx.Node)), None)
    if found is None:
        return kind[:80]
    if found.op != "call_function":
        return f"{found.name} ({kind})"
    inputs = ", ".join(f"{a.name}: {_op(a)}" for a in found.all_input_nodes[:3])
    return f"{found.name} = {_op(found)}({inputs}) ({kind})"


def _op(n: torch.fx.Node) -> str:
    return str(n.target) if n.op == "call_function" else n.op


def _sum_tree(terms: list[torch.fx.Node]) -> tuple[Optional[torch.fx.Node], list[torch.fx.Node], str]:
    """The root of an ``add`` tree whose leaves are exactly ``terms`` (and maybe a zeros start)."""
    leaves = set(terms)
    adds: list[torch.fx.Node] = []
    frontier = list(terms)
    root = None
    seen = set()
    while frontier:
        n = frontier.pop()
        user = single_user(n)
        if user is None or user.target != aten.add.Tensor or len(user.args) != 2:
            if root is not None and root is not n:
                return None, [], "the expert outputs are not combined by one sum"
            root = n
            continue
        if user not in seen:
            seen.add(user)
            adds.append(user)
            frontier.append(user)
    if root is None:
        return None, [], "no sum of the expert outputs found"
    for a in adds:
        for arg in a.args:
            if arg in leaves or arg in seen:
                continue
            if isinstance(arg, torch.fx.Node) and arg.target == aten.full.default and arg.args[1] == 0:
                continue  # out = zeros_like(x); out = out + ...
            return None, [], f"the sum of expert outputs also adds {getattr(arg, 'name', arg)}"
    return root, adds, ""


def match(graph: torch.fx.Graph, ctx: PassContext) -> tuple[list[Rewrite], list[Unchanged]]:
    rewrites: list[Rewrite] = []
    unchanged: list[Unchanged] = []
    # Group ``ids == e`` masks by the ids tensor: one group per unrolled loop.
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.target == aten.eq.Scalar and isinstance(node.args[1], int) and isinstance(node.args[0], torch.fx.Node):
            ids = node.args[0]
            if (
                ids.target is operator.getitem
                and ids.args[1] == 1
                and getattr(ids.args[0], "target", None) == aten.topk.default
            ):
                groups.setdefault(ids, []).append(node)
    for ids, eqs in groups.items():
        if len(eqs) < 2:
            continue
        result = GRADIENTS_REASON if ctx.gradients else _match_loop(graph, ids, eqs)
        if isinstance(result, Rewrite):
            rewrites.append(result)
        else:
            unchanged.append(Unchanged(ids.name, IDIOM, result))
    return rewrites, unchanged


def _match_loop(graph: torch.fx.Graph, ids: torch.fx.Node, eqs: list[torch.fx.Node]):
    """Rewrite one unrolled expert loop; return the Rewrite, or the reason it was left alone."""
    topk = ids.args[0]
    num_experts = tensor_val(topk.args[0]).shape[-1] if tensor_val(topk.args[0]) is not None else None
    experts: dict[int, _Expert] = {}
    topk_weights = None
    for eq in eqs:
        e = eq.args[1]
        if e in experts:
            return f"expert {e} is masked twice"
        masked, weight, why = _mask_weight(eq)
        if masked is None:
            return f"expert {e}: {why}"
        w = _topk_weights_of(masked, eq)
        if w is None or (topk_weights is not None and w is not topk_weights):
            return f"expert {e}: the mask is not applied to the same top-k weights as the other experts"
        topk_weights = w
        experts[e] = _Expert(e, eq, masked, weight)
    if num_experts is None or sorted(experts) != list(range(num_experts)):
        return (
            f"the loop covers experts {sorted(experts)} but the router chooses among {num_experts}; "
            "tokens routed elsewhere would be dropped, which rubin.moe does not express"
        )
    x_common = None
    for ex in experts.values():
        term = single_user(ex.weight)
        if term is None or term.target != aten.mul.Tensor:
            return f"expert {ex.index}: its routing weight has another user besides weight * output"
        body_out = term.args[1] if term.args[0] is ex.weight else term.args[0]
        val = tensor_val(body_out)
        if val is None:
            return "no shape information on the graph"
        activation, m, why = _match_body(body_out, val.dtype)
        if m is None:
            return f"expert {ex.index}: {why}"
        if activation not in SUPPORTED:
            return f"expert {ex.index}: activation {activation} is not one rubin.moe implements {SUPPORTED}"
        internal = set(m.nodes)
        for n in m.nodes:
            if n is not body_out and any(u not in internal for u in n.users):
                return f"expert {ex.index}: intermediate {n.name} of its body has another user outside the expert"
        ex.term, ex.body_nodes, ex.activation = term, tuple(m.nodes), activation
        ex.x, ex.w_gate, ex.w_up, ex.w_down = (m.kwargs[k] for k in ("x", "w_gate", "w_up", "w_down"))
        if x_common is None:
            x_common = ex.x
        elif ex.x is not x_common:
            return "the experts do not all read the same hidden states"
    acts = {ex.activation for ex in experts.values()}
    if len(acts) != 1:
        return f"the experts use different activations {sorted(acts)}"
    ordered = [experts[e] for e in range(num_experts)]
    x_val, out_val = tensor_val(x_common), tensor_val(ordered[0].term)
    weight_dtypes = {tensor_val(n).dtype for ex in ordered for n in (ex.w_gate, ex.w_up, ex.w_down)}
    if weight_dtypes != {x_val.dtype} or out_val.dtype != x_val.dtype:
        return (
            f"mixed dtypes: hidden states {x_val.dtype}, weights {sorted(map(str, weight_dtypes))}, "
            f"weighted output {out_val.dtype} (rubin.moe computes and returns the hidden states' dtype)"
        )
    root, adds, why = _sum_tree([ex.term for ex in ordered])
    if root is None:
        return why
    num_inter = tensor_val(ordered[0].w_gate).shape[0]
    hidden = x_val.shape[1]
    quantised = _dequantized_experts(ordered, num_inter)
    if isinstance(quantised, str):
        return quantised
    before = set(graph.nodes)
    with graph.inserting_before(root):
        # One concatenation per stacked weight ([g0, u0, g1, u1, ...] rows, then a view), made once and
        # reused while the expert weights stay the same tensors (ops/weights.py: a cat on every call would
        # copy all experts per call, more bytes than the loop it replaces).
        stack = torch.ops.rubin.stacked_weights.default

        def stacked(parts, shape=None):
            out = call(graph, stack, (parts,))
            return out if shape is None else call(graph, aten.view.default, (out, shape))

        extra: dict = {}
        if quantised is None:
            rows13 = [w for ex in ordered for w in (ex.w_gate, ex.w_up)]
            w13 = stacked(rows13, [num_experts, 2 * num_inter, hidden])
            w2 = stacked([ex.w_down for ex in ordered], [num_experts, hidden, num_inter])
        else:
            w13, w2, extra = _emit_quantised(graph, stacked, quantised, num_experts, num_inter, hidden)
        moe = emit_moe(graph, x_common, w13, w2, topk_weights, ids, activation=acts.pop(), **extra)
    added = [n for n in graph.nodes if n not in before]
    inherit_source(added, root)
    root.replace_all_uses_with(moe)
    weights_mb = _mb(ordered, num_inter, hidden)  # before the erase below, which takes the dequantise calls
    replaced = []
    dequantised = {w for ex in ordered for w in (ex.w_gate, ex.w_up, ex.w_down)} if quantised else set()
    for n in reversed(list(graph.nodes)):  # erase the old loop, users before producers
        if (
            n is root
            or n in adds
            or n in dequantised  # the rubin.dequantize calls the op now reads the weights of as stored
            or any(
                n is ex.term or n is ex.weight or n is ex.masked or n is ex.eq or n in ex.body_nodes for ex in ordered
            )
        ):
            if not n.users:
                replaced.append(n.name)
                graph.erase_node(n)
    x_shape = tuple(x_val.shape)
    routing = describe_routing(topk_weights, ids)  # upstream of the loop, untouched by the rewrite
    return Rewrite(
        node=moe.name,
        canonical_op="rubin.moe",
        source_idiom=IDIOM,
        replaced=sorted(replaced),
        details={
            "T": report_value(x_shape[0]),
            "H": report_value(x_shape[1]),
            "E": num_experts,
            "I": num_inter,
            "k": tensor_val(ids).shape[-1],
            "dtype": dtype_name(x_val.dtype),
            "activation": moe.kwargs["activation"],
            "routing": routing,
            "weights": (
                f"stacked into w13 / w2 once and reused while the expert parameters are unchanged "
                f"(rubin.stacked_weights; keeps a copy of {weights_mb} MB)"
            )
            + (f"; {quantised['format']} weights read as stored (rubin.dequantize folded)" if quantised else ""),
        },
    )


def _mb(ordered, num_inter: int, hidden: int) -> str:
    dq = _dequantize_args(ordered[0].w_gate)
    elt = tensor_val(ordered[0].w_gate).element_size() if dq is None else tensor_val(dq["weight"]).element_size()
    per = 0.5 if dq is not None and dq["format"] in ("nvfp4", "mxfp4") else 1  # FP4: two values per byte
    return f"{len(ordered) * 3 * num_inter * hidden * elt * per / 1e6:.3g}"


# ------------------------------------------------------------------------------------------------
# quantised experts: rubin.dequantize (ops/quantized.py) feeding each expert's gate / up / down
# ------------------------------------------------------------------------------------------------


def _dequantize_args(node: torch.fx.Node) -> Optional[dict]:
    """The arguments of a ``rubin.dequantize`` call by name (defaults filled), or None for any other node."""
    if not is_call(node, torch.ops.rubin.dequantize.default):
        return None
    return bound_arguments(node)


def _dequantized_experts(ordered: list, num_inter: int):
    """None when every expert weight is a plain tensor; the dequantise calls (by expert) and their format when every
    one is a ``rubin.dequantize``; else the reason the loop stays as written. rubin.moe has one global (NVFP4) or
    per-tensor (FP8) scale per expert for w13, so an expert's gate and up must share theirs (the same tensor), and
    FP8 block scales of gate and up stack into w13's only when I is a multiple of 128."""
    calls = [[_dequantize_args(w) for w in (ex.w_gate, ex.w_up, ex.w_down)] for ex in ordered]
    flat = [c for row in calls for c in row]
    if all(c is None for c in flat):
        return None
    if any(c is None for c in flat):
        return "some expert weights are dequantised in the graph (rubin.dequantize) and others are not"
    formats = {c["format"] for c in flat}
    if len(formats) != 1:
        return f"the experts' weights are in several formats {sorted(formats)}"
    fmt = formats.pop()
    for ex, (gate, up, _) in zip(ordered, calls):
        shared = "scale" if fmt == "fp8_tensor" else "scale_2" if fmt == "nvfp4" else None
        if shared and gate[shared] is not up[shared]:
            return (
                f"expert {ex.index}: its gate and up projections have different {fmt} {shared}s; rubin.moe takes one "
                "per expert for w13 (quantise the two with one shared scale)"
            )
        if gate["input_scale"] is not up["input_scale"]:
            return f"expert {ex.index}: gate and up read the same input but carry different input_scales"
    if fmt == "fp8_block" and num_inter % 128:
        return f"FP8 block scales of gate and up stack into w13's only when I ({num_inter}) is a multiple of 128"
    return {"format": fmt, "calls": calls}


def _emit_quantised(graph, stacked, quantised: dict, E: int, I: int, H: int):  # noqa: E741
    """w13, w2 and rubin.moe's scale arguments from the experts' quantised weights (stacked once, like the plain
    ones); the static activation scales, when every expert has them, as their maximum (what vLLM does with a
    checkpoint's per-expert input_scales: one scale that covers them all)."""
    fmt, calls = quantised["format"], quantised["calls"]
    gate_up = [c for row in calls for c in row[:2]]
    down = [row[2] for row in calls]
    fp4_kind = fmt in ("nvfp4", "mxfp4")
    pack = 2 if fp4_kind else 1
    w13 = stacked([c["weight"] for c in gate_up], [E, 2 * I, H // pack])
    w2 = stacked([c["weight"] for c in down], [E, H, I // pack])
    extra: dict = {}
    if fp4_kind:
        block = 16 if fmt == "nvfp4" else 32
        extra["w13_scale"] = stacked([c["scale"] for c in gate_up], [E, 2 * I, H // block])
        extra["w2_scale"] = stacked([c["scale"] for c in down], [E, H, I // block])
        if fmt == "nvfp4":
            extra["w13_scale_2"] = stacked([row[0]["scale_2"] for row in calls])
            extra["w2_scale_2"] = stacked([c["scale_2"] for c in down])
    elif fmt == "fp8_block":
        extra["w13_scale"] = stacked([c["scale"] for c in gate_up], [E, 2 * I // 128, -(-H // 128)])
        extra["w2_scale"] = stacked([c["scale"] for c in down], [E, -(-H // 128), -(-I // 128)])
        extra["block_shape"] = [128, 128]
    else:  # fp8_tensor: one scale per expert
        extra["w13_scale"] = stacked([row[0]["scale"] for row in calls])
        extra["w2_scale"] = stacked([c["scale"] for c in down])
    if fmt != "fp8_block" and all(c["input_scale"] is not None for c in gate_up + down):
        amax = torch.ops.aten.amax.default
        extra["a13_scale"] = call(graph, amax, (stacked([row[0]["input_scale"] for row in calls]),))
        extra["a2_scale"] = call(graph, amax, (stacked([c["input_scale"] for c in down]),))
    return w13, w2, extra
