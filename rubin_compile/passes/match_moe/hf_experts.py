"""What the Hugging Face experts matchers share (hf_grouped_mm.py, hf_batched_mm.py): the block found, the gate /
up split and its activation (hf_activation.py), biases gathered per row, the checks before a rewrite, and the
rewrite itself.

transformers computes one experts block in several ways (``config._experts_implementation``; ``generate()``
switches a model on a GPU from ``grouped_mm`` to ``batched_mm`` for its decode steps), and the forms share
everything but how rows reach their experts: the same ``gate_up_proj`` (``up_proj`` when ``has_gate=False``) /
``down_proj`` parameters, the same ``_apply_gate`` (``_default_apply_gate``: ``act_fn(gate) * up`` on ``chunk(2)``;
or a model's own: GPT-OSS's clamped SwiGLU, ...), the same biases and the same combine by the routing weights. Each
form module walks its own bookkeeping and calls these for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from rubin_compile.ops.moe import MoEArgs, MoEArgumentError, call_features
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
from rubin_compile.passes.match_moe import hf_activation
from rubin_compile.passes.match_moe.emit import emit_moe, reference_only_reason
from rubin_compile.passes.match_moe.hf_activation import NoMatch  # the form modules import it from here
from rubin_compile.passes.match_moe.routing import describe_routing

aten = torch.ops.aten
prims = torch.ops.prims
SIZE_OPS = (aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int)


@dataclass
class Block:
    """One Hugging Face experts block found in the graph (either form)."""

    form: str
    fc1: torch.fx.Node
    fc2: torch.fx.Node
    hidden: Optional[torch.fx.Node] = None
    topk_ids: Optional[torch.fx.Node] = None
    topk_weights: Optional[torch.fx.Node] = None
    w13: Optional[torch.fx.Node] = None  # as stored: [E, N, H] (N = 2I, or I not gated), [E, H, N] when w13_transposed
    w2: Optional[torch.fx.Node] = None  # as stored: [E, H, I], or [E, I, H] when w2_transposed
    w13_transposed: bool = False
    w2_transposed: bool = False
    w13_bias: Optional[torch.fx.Node] = None
    w2_bias: Optional[torch.fx.Node] = None
    activation: Optional[str] = None
    gated: bool = True  # False: has_gate=False experts (an up_proj, the activation on its whole output)
    interleaved: bool = False  # gate and up are the even and odd columns of the gate-up product (GPT-OSS)
    apply_router_weight_on_input: bool = False  # the routing weight scales each expert's input (Llama 4)
    # the activation's constants as run-time values (numbers or 0-d nodes), or None: its string holds them
    activation_constants: Optional[list] = None
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


def sentinel_clamps(node: Any) -> tuple[Any, list[torch.fx.Node], dict[str, Any]]:
    """Walk up the clamps over ``node``: transformers' expert-parallel sentinel clamp of the expert ids (every experts
    block in 5.17, only with ``_is_expert_parallel`` later; Inductor splits ``clamp(0, E - 1)`` into clamp_min and
    clamp_max). Returns the unclamped node, the clamp nodes and the bounds they give (``{}`` when not clamped)."""
    clamps: list[torch.fx.Node] = []
    bounds: dict[str, Any] = {}
    while is_call(node, aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default):
        given = dict(zip(("min", "max"), node.args[1:]), **node.kwargs)
        if node.target is aten.clamp_max.default:
            given = {"max": node.args[1]}
        bounds.update({key: v for key, v in given.items() if v is not None})
        clamps.append(node)
        node = node.args[0]
    return node, clamps, bounds


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
    sorted ids of the grouped mm form): (node after it, bias [E, N]). ``what``: the projection, for reasons.
    An output read several times has no bias: a non-gated activation reads its input twice (SiLU as
    ``x / (1 + exp(-x))``); a reader outside the block is named by the activation's match or ``check_block``."""

    def gathered_bias(add: Any) -> Optional[torch.fx.Node]:
        other = add.args[1] if add.args[0] is out else add.args[0]
        if is_call(other, aten.index.Tensor) and len(other.args[1]) == 1 and other.args[1][0] is ids:
            return other
        return None

    if single_user(out) is None and not any(
        is_call(u, aten.add.Tensor) and gathered_bias(u) is not None for u in out.users
    ):
        return out, None
    user = sole_user(out, f"the {what} output")
    if is_call(user, aten.add.Tensor):
        other = gathered_bias(user)
        if other is not None:
            b.flow += [user, other]
            return user, other.args[0]
        other = user.args[1] if user.args[0] is out else user.args[0]
        raise NoMatch(
            f"the {what} output is added to {getattr(other, 'name', other)}, "
            f"not to a per-expert bias gathered by {getattr(ids, 'name', ids)} (the expert of each row)"
        )
    return out, None


def match_activation(b: Block, h: Union[torch.fx.Node, list[torch.fx.Node]], act_out: Any, down: str) -> None:
    """The gate / up split (or none: ``has_gate=False``) of the first projection's output ``h`` and the activation
    that makes ``act_out``, the input of the down projection (``down`` names it); hf_activation.py says which
    forms are recognised. Sets the block's activation, its layout and its run-time constants."""
    found = hf_activation.match(h, act_out, down)
    b.activation, b.gated, b.interleaved = found.activation, found.gated, found.interleaved
    b.activation_constants = found.constants
    b.extra_details["gate_up"] = found.layout
    if found.constants_report is not None:
        b.extra_details["activation_constants"] = {
            **found.constants_report,
            "passed as": "activation_constants (run-time values: Dynamo made the float attributes graph inputs)",
        }
    b.flow += found.flow
    b.aux += found.aux


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
            activation_constants=None if b.activation_constants is None else _constants_val(b.activation_constants),
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


def _constants_val(constants: list) -> torch.Tensor:
    """What the ``activation_constants`` tensor the rewrite builds will be, for MoEArgs' checks."""
    return torch.empty(len(constants), dtype=torch.float32, device="meta")


def gpu_kernel_reason(b: Block, target: Any) -> Optional[str]:
    """``emit.reference_only_reason`` for this block (None: rewrite it)."""
    hv, w13v, idv = tensor_val(b.hidden), tensor_val(b.w13), tensor_val(b.topk_ids)
    n = w13v.shape[2 if b.w13_transposed else 1]
    sizes = {"E": w13v.shape[0], "H": hv.shape[1], "I": n // 2 if b.gated else n, "k": idv.shape[1]}
    features = call_features(b.apply_router_weight_on_input, b.activation_constants is not None)
    return reference_only_reason(target, dtype_name(hv.dtype), dtype_name(w13v.dtype), sizes, b.activation, features)


def _emit_constants(graph: torch.fx.Graph, constants: list) -> torch.fx.Node:
    """The 1-D float32 ``activation_constants`` tensor, built at the graph's insertion point from the values the
    activation read: 0-d nodes (converted to float32 where they are not) and numbers (``aten.full``, on the
    nodes' device), each unsqueezed and concatenated."""
    nodes = [c for c in constants if isinstance(c, torch.fx.Node)]
    val = tensor_val(nodes[0])
    parts = []
    for c in constants:
        if isinstance(c, torch.fx.Node):
            if tensor_val(c).dtype != torch.float32:
                c = call(graph, prims.convert_element_type.default, (c, torch.float32))
        else:
            c = call(graph, aten.full.default, ([], float(c)), {"dtype": torch.float32, "device": val.device})
            if "val" not in c.meta and isinstance(val, torch._subclasses.FakeTensor):
                with val.fake_mode:
                    c.meta["val"] = torch.full([], float(c.args[1]), dtype=torch.float32, device=val.device)
        parts.append(call(graph, aten.unsqueeze.default, (c, 0)))
    # not aten.stack: it has a decomposition, and Inductor lowers a post-grad graph without decomposing it again
    return parts[0] if len(parts) == 1 else call(graph, aten.cat.default, (parts,))


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
    new = []
    with graph.inserting_before(b.final):
        w13, w2 = b.w13, b.w2
        if b.w13_transposed:
            w13 = call(graph, aten.permute.default, (b.w13, [0, 2, 1]))
            stored = "gate_up_proj is stored [E, H, 2I]" if b.gated else "up_proj is stored [E, H, I]"
            notes.append(f"{stored}; w13 is its permute(0, 2, 1) view (no copy)")
            new.append(w13)
        if b.w2_transposed:
            w2 = call(graph, aten.permute.default, (b.w2, [0, 2, 1]))
            notes.append("down_proj is stored [E, I, H]; w2 is its permute(0, 2, 1) view (no copy)")
            new.append(w2)
        constants = None
        if b.activation_constants is not None:
            constants = _emit_constants(graph, b.activation_constants)
            new.append(constants)
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
            activation_constants=constants,
        )
    inherit_source(new + [moe], b.fc1)
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
