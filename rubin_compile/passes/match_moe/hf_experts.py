"""What the Hugging Face experts matchers share (hf_grouped_mm.py, hf_batched_mm.py): the block found, the gate /
up split and its activation, biases gathered per row, the checks before a rewrite, and the rewrite itself.

transformers computes one experts block in several ways (``config._experts_implementation``; ``generate()``
switches a model on a GPU from ``grouped_mm`` to ``batched_mm`` for its decode steps), and the forms share
everything but how rows reach their experts: the same ``gate_up_proj`` / ``down_proj`` parameters, the same
``_default_apply_gate`` (``act_fn(gate) * up`` on ``chunk(2)``), the same biases and the same combine by the
routing weights. Each form module walks its own bookkeeping and calls these for the rest.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from rubin_compile.ops.moe import ACTIVATIONS, MoEArgs, MoEArgumentError, call_features, swigluoai_activation
from rubin_compile.passes.base import Rewrite
from rubin_compile.passes.fx import (
    RESHAPES,
    call,
    dtype_name,
    getitem_of,
    inherit_source,
    is_call,
    report_value,
    single_user,
    tensor_val,
)
from rubin_compile.passes.match_moe.emit import emit_moe, reference_only_reason
from rubin_compile.passes.match_moe.routing import describe_routing

aten = torch.ops.aten
prims = torch.ops.prims
SIZE_OPS = (aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int)


class NoMatch(Exception):
    """The block deviates from the idiom; the message is the reason recorded in the report."""


def _silu_mul(gate, up):
    return F.silu(gate) * up


def _gelu_tanh_mul(gate, up):
    return F.gelu(gate, approximate="tanh") * up


def _gelu_mul(gate, up):  # exact GELU: recognised so that the report can name it
    return F.gelu(gate) * up


def _relu_mul(gate, up):
    return F.relu(gate) * up


def _sigmoid_mul(gate, up):
    return torch.sigmoid(gate) * up


def _swigluoai_mul(gate, up):
    """GPT-OSS's ``_apply_gate`` after its interleaved split (any constants: generated patterns ignore them;
    ``_swigluoai_constants`` reads them off a match)."""
    gate = gate.clamp(min=None, max=7.0)
    up = up.clamp(min=-7.0, max=7.0)
    return (up + 1) * (gate * torch.sigmoid(gate * 1.702))


# Gated activations (``_default_apply_gate``: ``act_fn(gate) * up``), supported ones first.
_GATES = {
    "silu": _silu_mul,
    "gelu_tanh": _gelu_tanh_mul,
    "gelu": _gelu_mul,
    "relu": _relu_mul,
    "sigmoid": _sigmoid_mul,
    "swigluoai": _swigluoai_mul,
}


@functools.lru_cache(maxsize=None)
def _gate_pattern(activation: str, low_precision: bool):
    """``act(gate) * up`` as Inductor decomposes it (bf16/fp16 add upcasts around the activation), and the
    numbers in it: generated patterns ignore scalar arguments, so a match is checked against these."""
    from torch._inductor.pattern_matcher import fwd_only, gen_pattern_and_search_gm

    dtype = torch.bfloat16 if low_precision else torch.float32
    pattern, search_gm = gen_pattern_and_search_gm(
        _GATES[activation], [torch.empty(4, 8, dtype=dtype), torch.empty(4, 8, dtype=dtype)], fwd_only
    )
    return pattern, _constants(n for n in search_gm.graph.nodes if n.op == "call_function")


def _constants(nodes) -> list[float]:
    """The Python numbers among the arguments of ``nodes``, sorted."""
    out = []
    for n in nodes:
        for a in list(n.args) + list(n.kwargs.values()):
            if isinstance(a, (int, float)) and not isinstance(a, bool):
                out.append(float(a))
    return sorted(out)


@dataclass
class Block:
    """One Hugging Face experts block found in the graph (either form)."""

    form: str
    fc1: torch.fx.Node
    fc2: torch.fx.Node
    hidden: Optional[torch.fx.Node] = None
    topk_ids: Optional[torch.fx.Node] = None
    topk_weights: Optional[torch.fx.Node] = None
    w13: Optional[torch.fx.Node] = None  # as stored: [E, 2I, H], or [E, H, 2I] when w13_transposed
    w2: Optional[torch.fx.Node] = None  # as stored: [E, H, I], or [E, I, H] when w2_transposed
    w13_transposed: bool = False
    w2_transposed: bool = False
    w13_bias: Optional[torch.fx.Node] = None
    w2_bias: Optional[torch.fx.Node] = None
    activation: Optional[str] = None
    interleaved: bool = False  # gate and up are the even and odd columns of the gate-up product (GPT-OSS)
    apply_router_weight_on_input: bool = False  # the routing weight scales each expert's input (Llama 4)
    extra_details: dict[str, Any] = field(default_factory=dict)  # form-specific report details
    final: Optional[torch.fx.Node] = None
    # Nodes of the block's data flow: replaced, so none may have a user outside the block.
    flow: list[torch.fx.Node] = field(default_factory=list)
    # Constant-like nodes (weight transposes, iota, the index_put base): erased only once unused.
    aux: list[torch.fx.Node] = field(default_factory=list)


def sole_user(node: torch.fx.Node, what: str) -> torch.fx.Node:
    """The only user of ``node``; ``NoMatch`` naming ``what`` and its users otherwise."""
    user = single_user(node)
    if user is None:
        users = list(node.users)
        raise NoMatch(
            f"{what} ({node.name}) has {len(users)} users ({', '.join(u.name for u in users)}) "
            "where the idiom has one: a user outside the experts block, or not this idiom"
        )
    return user


def same(a: Any, b: Any) -> bool:
    """Sizes equal without adding guards (sizes may be symbolic under dynamic shapes)."""
    return bool(statically_known_true(a == b))


def view_input(node: Any, what: str) -> torch.fx.Node:
    if not is_call(node, *RESHAPES):
        raise NoMatch(f"{what} ({getattr(node, 'name', node)}) is not a reshape/view")
    return node.args[0]


def is_zero_fill(node: Any) -> bool:
    """Whether ``node`` is the scalar 0 a decomposed ``masked_fill(mask, 0.0)`` fills with: ``aten.full([], 0)`` (CPU
    graphs) or ``aten.scalar_tensor(0)`` (CUDA / meta graphs)."""
    return (is_call(node, aten.full.default) and node.args[1] == 0) or (
        is_call(node, aten.scalar_tensor.default) and node.args[0] == 0
    )


def ids_from_topk(b: Block, E: int) -> Optional[str]:
    """None when the block's routed expert ids (``b.topk_ids``) are the indices of a top-k over E scores in this
    graph, so every id is below E and transformers' expert-parallel sentinel handling (ids >= E masked or clamped)
    changes nothing; else why that cannot be shown."""
    node = b.topk_ids
    while is_call(node, *RESHAPES, prims.convert_element_type.default):
        node = node.args[0]
    topk = getitem_of(node, 1, aten.topk.default)
    if topk is None:
        return (
            f"the expert ids ({getattr(b.topk_ids, 'name', b.topk_ids)}) are not the indices of a top-k in this graph"
        )
    scores = tensor_val(topk.args[0])
    if scores is None or scores.shape[-1] != E:
        return f"the expert ids come from a top-k over {None if scores is None else scores.shape[-1]} scores, not {E}"
    return None


def token_of_slots(b: Block, node: Any, T: Any, k: int) -> bool:
    """Whether ``node`` is the token of each of the T * k (token, expert) slots, as transformers before 5.8 writes it:
    ``torch.arange(T).unsqueeze(1).expand(-1, k).reshape(-1)`` (post-grad: ``reshape([clone](expand(unsqueeze(iota(T),
    1), [-1, k])), [T * k])``); records its nodes when it is."""
    if not is_call(node, *RESHAPES):
        return False
    chain = [node]
    inner = node.args[0]
    if is_call(inner, aten.clone.default):
        chain.append(inner)
        inner = inner.args[0]
    if not (is_call(inner, aten.expand.default) and is_call(inner.args[0], aten.unsqueeze.default)):
        return False
    unsq = inner.args[0]
    iota, ev = unsq.args[0], tensor_val(inner)
    if not (
        unsq.args[1] % 2 == 1 and ev is not None and ev.dim() == 2 and same(ev.shape[1], k) and same(ev.shape[0], T)
    ):
        return False
    if is_call(iota, prims.iota.default):
        ok = iota.kwargs.get("start", 0) == 0 and iota.kwargs.get("step", 1) == 1
    else:
        ok = is_call(iota, aten.arange.default) or (is_call(iota, aten.arange.start) and iota.args[0] == 0)
    iv = tensor_val(iota)
    if ok and iv is not None and iv.dim() == 1 and same(iv.shape[0], T):
        b.flow += chain + [inner, unsq]
        b.aux.append(iota)  # an iota of T may be shared with another arange of T (CSE)
        return True
    return False


def match_bias(
    b: Block, out: torch.fx.Node, ids: torch.fx.Node, what: str
) -> tuple[torch.fx.Node, Optional[torch.fx.Node]]:
    """``out + bias[ids]`` after an expert projection (``has_bias=True``; ``ids``: the expert of each row, the
    sorted ids of the grouped mm form): (node after it, bias [E, N]). ``what``: the projection, for reasons."""
    user = sole_user(out, f"the {what} output")
    if is_call(user, aten.add.Tensor):
        other = user.args[1] if user.args[0] is out else user.args[0]
        if is_call(other, aten.index.Tensor) and len(other.args[1]) == 1 and other.args[1][0] is ids:
            b.flow += [user, other]
            return user, other.args[0]
        raise NoMatch(
            f"the {what} output is added to {getattr(other, 'name', other)}, "
            f"not to a per-expert bias gathered by {getattr(ids, 'name', ids)} (the expert of each row)"
        )
    return out, None


def split_gate_up(b: Block, h: Union[torch.fx.Node, list[torch.fx.Node]]) -> tuple[torch.fx.Node, torch.fx.Node]:
    """``gate, up = h.chunk(2, dim=-1)``: an aten.split into two halves (or two slices). ``h`` may be several
    nodes of one value (functionalization regenerates a view after an in-place bias add once per use)."""
    sources = h if isinstance(h, list) else [h]
    val = tensor_val(sources[0])
    two_i = val.shape[-1]
    users = [u for src in sources for u in src.users]
    # One split, or (seen with biased experts, where Inductor does not merge them) one split per half.
    if users and all(is_call(u, aten.split.Tensor, aten.split_with_sizes.default) for u in users):
        parts: dict[int, list[torch.fx.Node]] = {}
        for split in users:
            size, dim = split.args[1], split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
            halves = size == [two_i // 2] * 2 if isinstance(size, (list, tuple)) else same(size * 2, two_i)
            if dim % val.dim() != val.dim() - 1 or not halves:
                raise NoMatch(
                    f"the gate_up output is split by {size} along dim {dim}, not into two halves of the last dim"
                )
            for g in split.users:
                if not is_call(g, operator.getitem):
                    raise NoMatch(f"the gate_up split has a user {g.name} that is not gate or up")
                parts.setdefault(g.args[1], []).append(g)
        if sorted(parts) != [0, 1] or any(len(v) != 1 for v in parts.values()):
            raise NoMatch("the gate_up split is not used as exactly (gate, up)")
        b.flow += users + [parts[0][0], parts[1][0]]
        return parts[0][0], parts[1][0]
    slices = [u for u in users if is_call(u, aten.slice.Tensor)]
    if len(slices) == 2 and len(users) == 2:

        def bounds(s):
            a = list(s.args) + [0, None, None, 1][len(s.args) - 1 :]
            return a[1] % val.dim(), a[2], a[3], a[4]

        steps = {bounds(s)[3] for s in slices}
        if steps == {2}:
            # gate_up[..., ::2], gate_up[..., 1::2]: GPT-OSS's interleaved rows, which rubin.moe's swigluoai reads
            # as stored (match_activation then requires that activation)
            g, u = sorted(slices, key=lambda s: 0 if bounds(s)[1] in (0, None) else 1)
            (g_dim, g_start, g_end, _), (u_dim, u_start, u_end, _) = bounds(g), bounds(u)
            ends = all(e is None or (isinstance(e, int) and e >= two_i) or same(e, two_i) for e in (g_end, u_end))
            if g_dim == u_dim == val.dim() - 1 and g_start in (0, None) and u_start == 1 and ends:
                b.flow += [g, u]
                b.interleaved = True
                b.extra_details["gate_up"] = "interleaved (gate_up[..., ::2], gate_up[..., 1::2]), read as stored"
                return g, u
            raise NoMatch(
                f"gate and up are strided slices of gate_up that are not its even and odd columns "
                f"(starts {g_start}, {u_start})"
            )
        if steps != {1}:
            raise NoMatch(f"gate and up are slices of gate_up with steps {sorted(steps)}, not halves or interleaved")
        g, u = sorted(slices, key=lambda s: 0 if bounds(s)[1] in (0, None) else 1)
        (g_dim, g_start, g_end, _), (u_dim, u_start, _, _) = bounds(g), bounds(u)
        if (
            g_dim == u_dim == val.dim() - 1
            and g_start in (0, None)
            and same(g_end, two_i // 2)
            and same(u_start, two_i // 2)
        ):
            b.flow += [g, u]
            return g, u
    raise NoMatch(
        "the gate_up output is not split into gate and up halves (chunk(2, dim=-1)); "
        "non-gated experts (has_gate=False) and custom _apply_gate functions are not this idiom"
    )


def match_activation(b: Block, gate: torch.fx.Node, up: torch.fx.Node, act_out: Any, down: str) -> None:
    """``act_out = act(gate) * up`` with act one of rubin.moe's activations; ``down``: what reads ``act_out``."""
    from torch._inductor.pattern_matcher import Match

    gval = tensor_val(gate)
    low = gval is not None and gval.dtype in (torch.bfloat16, torch.float16)
    name_of = getattr(act_out, "name", act_out)
    extra_user = False
    for name in _GATES:
        pattern, constants = _gate_pattern(name, low)
        m = pattern.match(act_out)
        if not isinstance(m, Match):
            # The pattern matcher refuses a pattern node with a user outside the pattern; say so.
            extra_user = extra_user or str(m).startswith("multiple_users")
            continue
        if m.kwargs.get("gate") is not gate or m.kwargs.get("up") is not up:
            continue
        if name == "swigluoai":
            activation = _swigluoai_constants(m.nodes)
        elif _constants(m.nodes) == constants:
            activation = name
        else:
            continue
        if name not in ACTIVATIONS:
            raise NoMatch(f"the experts' activation is {name}(gate) * up; rubin.moe implements {list(ACTIVATIONS)}")
        if (name == "swigluoai") != b.interleaved:
            raise NoMatch(
                f"the experts' activation is {name} over {'interleaved' if b.interleaved else 'halved'} gate / up "
                "columns; rubin.moe's swigluoai reads interleaved ones (GPT-OSS, vLLM's swigluoai) and its other "
                "activations gate rows then up rows (vLLM's swigluoai_uninterleave is not implemented)"
            )
        b.activation = activation
        b.flow += [n for n in m.nodes if n not in (gate, up)]
        return
    if extra_user:
        raise NoMatch(f"an intermediate of the gate/up activation ({name_of}) has a user outside the experts block")
    raise NoMatch(
        f"the input of the {down} ({name_of}) is not act(gate) * up with a recognised "
        f"activation (rubin.moe implements {list(ACTIVATIONS)}); a custom _apply_gate?"
    )


def _swigluoai_constants(nodes) -> str:
    """The ``activation`` string of a matched GPT-OSS clamped SwiGLU: its ``alpha`` (the scalar of
    ``gate * alpha``) and ``limit`` (``gate.clamp(max=limit)``, ``up.clamp(-limit, limit)``); ``NoMatch`` when
    the clamps disagree or the offset on up is not one."""
    by_op: dict[Any, list[float]] = {}
    for n in nodes:
        for a in n.args[1:]:
            if isinstance(a, (int, float)) and not isinstance(a, bool):
                by_op.setdefault(n.target, []).append(float(a))
    lows, highs = by_op.get(aten.clamp_min.default, []), by_op.get(aten.clamp_max.default, [])
    scales, offsets = by_op.get(aten.mul.Tensor, []), by_op.get(aten.add.Tensor, [])
    if len(lows) != 1 or len(highs) != 2 or len(scales) != 1 or offsets != [1.0]:
        raise NoMatch(
            f"a clamped SwiGLU whose constants are not one alpha, one limit and up + 1 (clamp_min {lows}, "
            f"clamp_max {highs}, scale {scales}, offset {offsets})"
        )
    limit = highs[0]
    if highs[1] != limit or lows[0] != -limit or limit <= 0:
        raise NoMatch(f"a clamped SwiGLU with different limits for gate and up (clamp_min {lows}, clamp_max {highs})")
    return swigluoai_activation(scales[0], limit)


def check_block(b: Block) -> None:
    """What every experts form must hold before it is rewritten: one compute dtype, operands rubin.moe's fake
    implementation accepts, and no intermediate read from outside the block; ``NoMatch(reason)`` otherwise."""
    # dtypes: one compute dtype for hidden states and weights (and biases)
    hv, w13v, w2v = tensor_val(b.hidden), tensor_val(b.w13), tensor_val(b.w2)
    biases = [tensor_val(x).dtype for x in (b.w13_bias, b.w2_bias) if x is not None]
    if len({hv.dtype, w13v.dtype, w2v.dtype, *biases}) != 1:
        raise NoMatch(
            f"mixed dtypes: hidden states {hv.dtype}, gate_up {w13v.dtype}, down {w2v.dtype}, "
            f"biases {biases}; rubin.moe computes in the hidden states' dtype"
        )
    w13c = w13v.transpose(1, 2) if b.w13_transposed else w13v
    w2c = w2v.transpose(1, 2) if b.w2_transposed else w2v
    try:  # what rubin.moe's fake implementation will check, before the graph is touched
        MoEArgs(
            hv,
            w13c,
            w2c,
            tensor_val(b.topk_weights),
            tensor_val(b.topk_ids),
            b.activation,
            tensor_val(b.w13_bias),
            tensor_val(b.w2_bias),
            apply_router_weight_on_input=b.apply_router_weight_on_input,
        )
    except MoEArgumentError as e:
        raise NoMatch(f"the matched operands do not fit rubin.moe: {e}") from None

    # Nothing inside the block may be read from outside it: the rewrite would drop what that reader sees
    # and recompute the experts, and the idiom says the block is self-contained.
    # Under dynamic shapes the graph reads sizes off block nodes (``sym_size(view, 0)`` for
    # ``empty_like(perm)``); such a read belongs to the block when only the block uses it.
    b.flow += [u for n in list(b.flow) for u in n.users if is_call(u, *SIZE_OPS)]
    inside = set(b.flow) | set(b.aux)
    for n in b.flow:
        if n is b.final:
            continue
        outside = [u for u in n.users if u not in inside]
        if outside:
            raise NoMatch(
                f"intermediate {n.name} of the experts block has a user outside it "
                f"({', '.join(u.name for u in outside)})"
            )


def gpu_kernel_reason(b: Block, target: Any) -> Optional[str]:
    """``emit.reference_only_reason`` for this block (None: rewrite it)."""
    hv, w13v, idv = tensor_val(b.hidden), tensor_val(b.w13), tensor_val(b.topk_ids)
    two_i = w13v.shape[2 if b.w13_transposed else 1]
    sizes = {"E": w13v.shape[0], "H": hv.shape[1], "I": two_i // 2, "k": idv.shape[1]}
    features = call_features(b.apply_router_weight_on_input, False)
    return reference_only_reason(target, dtype_name(hv.dtype), dtype_name(w13v.dtype), sizes, b.activation, features)


def module_path(node: torch.fx.Node) -> Optional[str]:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    path, cls = list(stack.values())[-1]
    path = path.replace("L['self'].", "").replace("L['self']", "self")
    return f"{path} ({getattr(cls, '__name__', cls)})"


def rewrite(graph: torch.fx.Graph, b: Block, idiom: str) -> Rewrite:
    """Replace the block by one ``rubin.moe`` node (weights stored transposed become ``permute`` views)."""
    routing = describe_routing(b.topk_weights, b.topk_ids)
    notes = []
    with graph.inserting_before(b.final):
        w13, w2 = b.w13, b.w2
        if b.w13_transposed:
            w13 = call(graph, aten.permute.default, (b.w13, [0, 2, 1]))
            notes.append("gate_up_proj is stored [E, H, 2I]; w13 is its permute(0, 2, 1) view (no copy)")
        if b.w2_transposed:
            w2 = call(graph, aten.permute.default, (b.w2, [0, 2, 1]))
            notes.append("down_proj is stored [E, I, H]; w2 is its permute(0, 2, 1) view (no copy)")
        moe = emit_moe(
            graph,
            b.hidden,
            w13,
            w2,
            b.topk_weights,
            b.topk_ids,
            activation=b.activation,
            w13_bias=b.w13_bias,
            w2_bias=b.w2_bias,
            apply_router_weight_on_input=b.apply_router_weight_on_input,
        )
    inherit_source([n for n in (w13, w2, moe) if n not in (b.w13, b.w2)], b.fc1)
    b.final.replace_all_uses_with(moe)
    replaced = []
    doomed = set(b.flow) | set(b.aux)
    for n in reversed(list(graph.nodes)):  # users before producers
        if n in doomed and not n.users:
            replaced.append(n.name)
            graph.erase_node(n)
    hv, w13v = tensor_val(b.hidden), tensor_val(b.w13)
    E = w13v.shape[0]
    inter = tensor_val(b.w2).shape[2 if not b.w2_transposed else 1]
    details: dict[str, Any] = {
        "form": b.form,
        "module": module_path(b.fc1),
        "T": report_value(hv.shape[0]),
        "H": report_value(hv.shape[1]),
        "E": E,
        "I": inter,
        "k": tensor_val(b.topk_ids).shape[1],
        "dtype": dtype_name(hv.dtype),
        "activation": b.activation,
        "bias": b.w13_bias is not None,
        **b.extra_details,
        "weights": "as stored, no copy" if not notes else "; ".join(notes),
        "routing": routing,
    }
    return Rewrite(
        node=moe.name,
        canonical_op="rubin.moe",
        source_idiom=f"{idiom} ({b.form})",
        replaced=sorted(replaced),
        details=details,
    )


def match_sum_over_k(b: Block, view: torch.fx.Node) -> None:
    """``weighted.view(T, k, H).sum(dim=1)`` [``.to(hidden_states.dtype)``] from the view on: sets ``b.final``."""
    if not is_call(view, *RESHAPES):
        raise NoMatch("the expert output in token order is not viewed as [T, k, H]")
    total = sole_user(view, "the [T, k, H] expert outputs")
    keepdim = total.args[2] if len(total.args) > 2 else total.kwargs.get("keepdim", False)
    if not (is_call(total, aten.sum.dim_IntList) and list(total.args[1]) in ([1], [-2]) and not keepdim):
        raise NoMatch("the [T, k, H] expert outputs are not summed over k")
    b.flow += [view, total]
    b.final = total
    hidden_dtype = tensor_val(b.hidden).dtype
    if tensor_val(total).dtype != hidden_dtype:
        cast = sole_user(total, "the summed expert outputs")
        if not (is_call(cast, torch.ops.prims.convert_element_type.default) and tensor_val(cast).dtype == hidden_dtype):
            raise NoMatch(f"the block returns {tensor_val(total).dtype}, not the hidden states' {hidden_dtype}")
        b.flow.append(cast)
        b.final = cast
