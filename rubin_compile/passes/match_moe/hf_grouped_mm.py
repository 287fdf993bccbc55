"""Matcher (c): Hugging Face transformers 5.x experts in their default ``grouped_mm`` form.

Source idiom (``transformers/integrations/moe.py``, ``grouped_mm_experts_forward``, transformers 5.19;
the default ``config._experts_implementation`` of every experts class decorated with
``@use_experts_implementation``: Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V2/V3, GLM-4-MoE, Gemma 4, GPT-OSS...)::

    expert_ids_g, perm = torch.sort(top_k_index.reshape(-1))
    selected_hidden_states_g = hidden_states[perm // num_top_k]
    sample_weights_g = top_k_weights.reshape(-1)[perm]
    histc_input = expert_ids_g.float() if device.type in ("cpu", "mps") else expert_ids_g.int()
    offsets = torch.cumsum(torch.histc(histc_input, bins=E, min=0, max=E - 1), dim=0, dtype=torch.int32)
    proj_out = _grouped_mm(selected_hidden_states_g, gate_up_proj.transpose(-2, -1), offsets)  # [+ bias[expert_ids_g]]
    gate, up = proj_out.chunk(2, dim=-1);  proj_out = act_fn(gate) * up                       # _default_apply_gate
    proj_out = _grouped_mm(proj_out, down_proj.transpose(-2, -1), offsets)                     # [+ bias[expert_ids_g]]
    weighted_out = proj_out * sample_weights_g.unsqueeze(-1)
    inv_perm = torch.empty_like(perm);  inv_perm[perm] = torch.arange(perm.size(0))
    final = weighted_out[inv_perm].view(T, k, H).sum(dim=1).to(hidden_states.dtype)

``_grouped_mm`` is ``torch.nn.functional.grouped_mm`` (``aten._grouped_mm``) where transformers may use it
(CUDA sm80+, and CPU with torch > 2.10; under torch.compile only for bf16 weights) and the custom op
``transformers.grouped_mm_fallback`` otherwise (so under torch.compile: every non-bf16 dtype, on any device).
Post-grad ATen, as Inductor gives it (fp32 on CPU)::

    sort = aten.sort(aten.reshape(topk_ids, [-1]));  ids_g = sort[0];  perm = sort[1]
    x_g = aten.index(hidden, [aten.div.Tensor_mode(perm, k, rounding_mode="floor")])
    offs = aten.cumsum(aten.histc(convert_element_type(ids_g, float32), E, 0, E - 1), 0, dtype=int32)
    h = transformers.grouped_mm_fallback(x_g, aten.permute(gate_up_proj, [0, 2, 1]), offs)
    gate, up = aten.split(h, I, -1);  a = div(gate, add(exp(neg(gate)), 1)) * up        # SiLU, decomposed
    y = transformers.grouped_mm_fallback(a, aten.permute(down_proj, [0, 2, 1]), offs)
    yw = aten.mul(y, aten.unsqueeze(aten.index(aten.reshape(topk_weights, [-1]), [perm]), -1))
    inv = aten.index_put(aten.empty([S]), [perm], prims.iota(S))
    out = aten.sum(aten.reshape(aten.index(yw, [inv]), [T, k, H]), [1])                  # [+ convert_element_type]

The CUDA form differs only in ``aten._grouped_mm`` and ``convert_element_type(ids_g, int32)`` before
``histc``; the tests obtain it for real by compiling the model on the ``meta`` device, which takes
transformers' non-CPU branch (``device.type not in ("cpu", "mps")``) and F.grouped_mm.

Rewritten into one ``rubin.moe(hidden, gate_up_proj, down_proj, topk_weights, topk_ids, activation)``:
HF's ``gate_up_proj`` [E, 2I, H] (gate rows, then up rows: ``chunk(2)``) and ``down_proj`` [E, H, I] are the
canonical layout as stored, so no weight is copied. Experts stored transposed (``is_transposed=True``:
[E, H, 2I] and [E, I, H], e.g. Aria) get a ``permute`` *view*, noted in the report. Biases
(``has_bias=True``) become ``w13_bias`` / ``w2_bias``. Left unchanged, with the reason: an activation other
than SiLU / GELU-tanh, interleaved gate/up columns (GPT-OSS's clamped SwiGLU), non-gated experts, mixed
dtypes, an intermediate with a user outside the block, the expert-parallel sentinel masking, or any other
deviation from the idiom above.

Why the block is walked by hand rather than with one ``register_replacement`` pattern: it has optional
parts (biases, dtype conversions that depend on the model and dtype, CPU / CUDA bookkeeping, two grouped
mm ops), a pattern per combination would be dozens of traced patterns, and a pattern that fails says
nothing a user can act on, where a near miss here must say why. The walk is anchored on the pair of
grouped mms that share one offsets tensor. The activation between them, which Inductor decomposes, is
matched with Inductor's pattern matcher from traced ``act(gate) * up`` functions, so it follows whatever
form the decomposition gives.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F

from torch.fx.experimental.symbolic_shapes import statically_known_true

from rubin_compile.ops.moe import ACTIVATIONS, MoEArgs, MoEArgumentError
from rubin_compile.passes.base import GRADIENTS_REASON, PassContext, Rewrite, Unchanged
from rubin_compile.passes.fx import (
    RESHAPES,
    call,
    dtype_name,
    getitem_of,
    inherit_source,
    is_call,
    report_value,
    single_user,
    strip_converts,
    tensor_val,
)
from rubin_compile.passes.match_moe.emit import emit_moe
from rubin_compile.passes.match_moe.routing import describe_routing

IDIOM = "hf grouped_mm"
aten = torch.ops.aten
prims = torch.ops.prims

_SIZE_OPS = (aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int)
_FALLBACK = "transformers.grouped_mm_fallback.default"


class _NoMatch(Exception):
    """The block deviates from the idiom; the message is the reason recorded in the report."""


def _grouped_mm_form(node: Any) -> Optional[str]:
    """Which grouped mm a node is: "aten._grouped_mm", "transformers.grouped_mm_fallback" or None.

    The transformers op is compared by name so that this module does not import transformers."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if node.target is aten._grouped_mm.default:
        return "aten._grouped_mm"
    if str(node.target) == _FALLBACK:
        return "transformers.grouped_mm_fallback"
    return None


def _gmm_operands(node: torch.fx.Node) -> tuple[Any, Any, Any]:
    """(input, weight, offs) of a grouped mm; other arguments (bias, out_dtype) must be unset."""
    names = ("input", "weight", "offs", "bias", "out_dtype")
    bound = dict(zip(names, node.args))
    bound.update({("input" if k == "self" else "weight" if k == "mat2" else k): v for k, v in node.kwargs.items()})
    extra = [k for k in ("bias", "out_dtype") if bound.get(k) is not None]
    if extra:
        raise _NoMatch(f"{node.name} passes {extra} to the grouped mm; Hugging Face's experts never do")
    return bound.get("input"), bound.get("weight"), bound.get("offs")


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


# Gated activations (``_default_apply_gate``: ``act_fn(gate) * up``), supported ones first.
_GATES = {"silu": _silu_mul, "gelu_tanh": _gelu_tanh_mul, "gelu": _gelu_mul, "relu": _relu_mul, "sigmoid": _sigmoid_mul}


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
class _Block:
    """One Hugging Face experts block found in the graph."""

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
    histc_input: Optional[str] = None
    final: Optional[torch.fx.Node] = None
    # Nodes of the block's data flow: replaced, so none may have a user outside the block.
    flow: list[torch.fx.Node] = field(default_factory=list)
    # Constant-like nodes (weight transposes, iota, the index_put base): erased only once unused.
    aux: list[torch.fx.Node] = field(default_factory=list)


def _sole_user(node: torch.fx.Node, what: str) -> torch.fx.Node:
    """The only user of ``node``; ``_NoMatch`` naming ``what`` and its users otherwise."""
    user = single_user(node)
    if user is None:
        users = list(node.users)
        raise _NoMatch(
            f"{what} ({node.name}) has {len(users)} users ({', '.join(u.name for u in users)}) "
            "where the idiom has one: a user outside the experts block, or not this idiom"
        )
    return user


def _same(a: Any, b: Any) -> bool:
    """Sizes equal without adding guards (sizes may be symbolic under dynamic shapes)."""
    return bool(statically_known_true(a == b))


def _view_input(node: Any, what: str) -> torch.fx.Node:
    if not is_call(node, *RESHAPES):
        raise _NoMatch(f"{what} ({getattr(node, 'name', node)}) is not a reshape/view")
    return node.args[0]


def _match_bookkeeping(b: _Block, offs: Any) -> tuple[torch.fx.Node, torch.fx.Node]:
    """offsets = cumsum(histc(ids_g), dtype=int32); (ids_g, perm) = sort(topk_ids.reshape(-1))."""
    if not is_call(offs, aten.cumsum.default):
        raise _NoMatch(
            f"the grouped mm offsets ({getattr(offs, 'name', offs)}) are not a cumsum of per-expert token counts"
        )
    histc = offs.args[0]
    if not is_call(histc, aten.histc.default):
        raise _NoMatch(
            f"the offsets are a cumsum of {getattr(histc, 'name', histc)}, not of torch.histc "
            "(transformers 5.x counts tokens per expert with histc)"
        )
    given = dict(zip(("bins", "min", "max"), histc.args[1:]), **histc.kwargs)
    bins, lo, hi = given.get("bins", 100), given.get("min", 0), given.get("max", 0)
    hval = tensor_val(histc.args[0])
    b.histc_input = dtype_name(hval.dtype) if hval is not None else None
    sort = getitem_of(strip_converts(histc.args[0]), 0, aten.sort.default, aten.sort.stable)
    if sort is None:
        raise _NoMatch("histc does not count the sorted expert ids (sort(...)[0])")
    # aten.sort.default(self, dim=-1, descending=False); aten.sort.stable(self, *, stable, dim, descending)
    positional = dict(zip(("dim", "descending"), sort.args[1:])) if sort.target is aten.sort.default else {}
    if {**positional, **sort.kwargs}.get("descending", False):
        raise _NoMatch("the expert ids are sorted in descending order")
    ids_g = perm = None
    for u in sort.users:
        if is_call(u, operator.getitem) and u.args[1] == 0:
            ids_g = u
        elif is_call(u, operator.getitem) and u.args[1] == 1:
            perm = u
    if perm is None:
        raise _NoMatch("the sort permutation is unused; hidden states are not gathered by it")
    b.topk_ids = _view_input(sort.args[0], "the sorted expert ids")
    ids_val = tensor_val(b.topk_ids)
    if ids_val is None or ids_val.dim() != 2:
        raise _NoMatch("the sorted expert ids are not a reshape of a [T, k] top-k index tensor")
    if not (_same(bins, tensor_val(b.w13).shape[0]) and lo == 0 and _same(hi, bins - 1)):
        raise _NoMatch(
            f"histc(bins={bins}, min={lo}, max={hi}) does not count experts 0..E-1 for E={tensor_val(b.w13).shape[0]}"
        )
    b.flow += [sort.args[0], sort, ids_g, perm, offs, histc]
    b.flow += [n for n in _converts_between(histc.args[0], ids_g)]
    return ids_g, perm


def _converts_between(top: Any, bottom: torch.fx.Node) -> list[torch.fx.Node]:
    out = []
    while top is not bottom and isinstance(top, torch.fx.Node):
        out.append(top)
        top = top.args[0]
    return out


def _match_weight(b: _Block, weight: Any, which: str) -> tuple[torch.fx.Node, bool]:
    """The stored expert weight behind the grouped mm's [E, K, N] operand, and whether it is stored
    transposed (the canonical layout is [E, N, K], which HF stores and transposes per call)."""
    if is_call(weight, aten.permute.default) and list(weight.args[1]) in ([0, 2, 1], [0, -1, -2]):
        b.aux.append(weight)
        return weight.args[0], False
    if is_call(weight, aten.transpose.int) and sorted(a % 3 for a in weight.args[1:3]) == [1, 2]:
        b.aux.append(weight)
        return weight.args[0], False
    if tensor_val(weight) is None or tensor_val(weight).dim() != 3:
        raise _NoMatch(f"the {which} weight of the grouped mm ({getattr(weight, 'name', weight)}) is not [E, K, N]")
    return weight, True


def _match_bias(
    b: _Block, out: torch.fx.Node, ids_g: torch.fx.Node, what: str
) -> tuple[torch.fx.Node, Optional[torch.fx.Node]]:
    """``out + bias[ids_g]`` after a grouped mm (``has_bias=True``): (node after it, bias [E, N])."""
    user = _sole_user(out, f"the {what} grouped mm output")
    if is_call(user, aten.add.Tensor):
        other = user.args[1] if user.args[0] is out else user.args[0]
        if is_call(other, aten.index.Tensor) and len(other.args[1]) == 1 and other.args[1][0] is ids_g:
            b.flow += [user, other]
            return user, other.args[0]
        raise _NoMatch(
            f"the {what} grouped mm output is added to {getattr(other, 'name', other)}, "
            "not to a per-expert bias gathered by the sorted expert ids"
        )
    return out, None


def _split_gate_up(b: _Block, h: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    """``gate, up = h.chunk(2, dim=-1)``: an aten.split into two halves (or two slices)."""
    val = tensor_val(h)
    two_i = val.shape[-1]
    users = list(h.users)
    # One split, or (seen with biased experts, where Inductor does not merge them) one split per half.
    if users and all(is_call(u, aten.split.Tensor, aten.split_with_sizes.default) for u in users):
        parts: dict[int, list[torch.fx.Node]] = {}
        for split in users:
            size, dim = split.args[1], split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
            halves = size == [two_i // 2] * 2 if isinstance(size, (list, tuple)) else _same(size * 2, two_i)
            if dim % val.dim() != val.dim() - 1 or not halves:
                raise _NoMatch(
                    f"the gate_up output is split by {size} along dim {dim}, not into two halves of the last dim"
                )
            for g in split.users:
                if not is_call(g, operator.getitem):
                    raise _NoMatch(f"the gate_up split has a user {g.name} that is not gate or up")
                parts.setdefault(g.args[1], []).append(g)
        if sorted(parts) != [0, 1] or any(len(v) != 1 for v in parts.values()):
            raise _NoMatch("the gate_up split is not used as exactly (gate, up)")
        b.flow += users + [parts[0][0], parts[1][0]]
        return parts[0][0], parts[1][0]
    slices = [u for u in users if is_call(u, aten.slice.Tensor)]
    if len(slices) == 2 and len(users) == 2:

        def bounds(s):
            a = list(s.args) + [0, None, None, 1][len(s.args) - 1 :]
            return a[1] % val.dim(), a[2], a[3], a[4]

        steps = {bounds(s)[3] for s in slices}
        if steps != {1}:
            raise _NoMatch(
                "gate and up are interleaved columns of gate_up (gate_up[..., ::2], gate_up[..., 1::2], "
                "as GPT-OSS stores them); rubin.moe takes gate rows then up rows, and reordering would "
                "copy every expert's weights on every call"
            )
        g, u = sorted(slices, key=lambda s: 0 if bounds(s)[1] in (0, None) else 1)
        (g_dim, g_start, g_end, _), (u_dim, u_start, _, _) = bounds(g), bounds(u)
        if (
            g_dim == u_dim == val.dim() - 1
            and g_start in (0, None)
            and _same(g_end, two_i // 2)
            and _same(u_start, two_i // 2)
        ):
            b.flow += [g, u]
            return g, u
    raise _NoMatch(
        "the gate_up output is not split into gate and up halves (chunk(2, dim=-1)); "
        "non-gated experts (has_gate=False) and custom _apply_gate functions are not this idiom"
    )


def _match_activation(b: _Block, gate: torch.fx.Node, up: torch.fx.Node, act_out: Any) -> None:
    """``act_out = act(gate) * up`` with act one of rubin.moe's activations."""
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
        if m.kwargs.get("gate") is gate and m.kwargs.get("up") is up and _constants(m.nodes) == constants:
            if name not in ACTIVATIONS:
                raise _NoMatch(
                    f"the experts' activation is {name}(gate) * up; rubin.moe implements {list(ACTIVATIONS)}"
                )
            b.activation = name
            b.flow += [n for n in m.nodes if n not in (gate, up)]
            return
    if extra_user:
        raise _NoMatch(f"an intermediate of the gate/up activation ({name_of}) has a user outside the experts block")
    raise _NoMatch(
        f"the input of the down grouped mm ({name_of}) is not act(gate) * up with a recognised "
        f"activation (rubin.moe implements {list(ACTIVATIONS)}); a custom _apply_gate?"
    )


def _match_combine(b: _Block, y: torch.fx.Node, perm: torch.fx.Node) -> None:
    """``(y * w[perm].unsqueeze(-1))[inv_perm].view(T, k, H).sum(1)`` [``.to(hidden.dtype)``]."""
    mul = _sole_user(y, "the down grouped mm output")
    if not is_call(mul, aten.mul.Tensor):
        raise _NoMatch(
            f"the down projection output feeds {mul.name} ({mul.target}), not the multiplication by the routing weights"
        )
    sw = mul.args[1] if mul.args[0] is y else mul.args[0]
    if not is_call(sw, aten.unsqueeze.default):
        raise _NoMatch(
            "the down projection output is not multiplied by the routing weights gathered by the sort "
            "permutation (sample_weights_g.unsqueeze(-1))"
        )
    gathered = sw.args[0]
    if not (is_call(gathered, aten.index.Tensor) and len(gathered.args[1]) == 1 and gathered.args[1][0] is perm):
        raise _NoMatch("the routing weights are not gathered by the sort permutation")
    b.topk_weights = _view_input(gathered.args[0], "the flattened routing weights")
    b.flow += [mul, sw, gathered, gathered.args[0]]

    unperm = _sole_user(mul, "the weighted expert output")
    if not (is_call(unperm, aten.index.Tensor) and len(unperm.args[1]) == 1):
        raise _NoMatch("the weighted expert output is not put back in token order (weighted_out[inv_perm])")
    inv = unperm.args[1][0]
    ok = (
        is_call(inv, aten.index_put.default)
        and len(inv.args[1]) == 1
        and inv.args[1][0] is perm
        and is_call(inv.args[2], prims.iota.default, aten.arange.default, aten.arange.start)
    )
    if not ok:
        raise _NoMatch(
            "the weighted expert output is gathered by something other than the inverse sort "
            "permutation (inv_perm[perm] = arange)"
        )
    b.flow += [unperm, inv]
    b.aux += [inv.args[0], inv.args[2]]

    view = _sole_user(unperm, "the expert output in token order")
    if not is_call(view, *RESHAPES):
        raise _NoMatch("the expert output in token order is not viewed as [T, k, H]")
    total = _sole_user(view, "the [T, k, H] expert outputs")
    keepdim = total.args[2] if len(total.args) > 2 else total.kwargs.get("keepdim", False)
    if not (is_call(total, aten.sum.dim_IntList) and list(total.args[1]) in ([1], [-2]) and not keepdim):
        raise _NoMatch("the [T, k, H] expert outputs are not summed over k")
    b.flow += [view, total]
    b.final = total
    hidden_dtype = tensor_val(b.hidden).dtype
    if tensor_val(total).dtype != hidden_dtype:
        cast = _sole_user(total, "the summed expert outputs")
        if not (is_call(cast, prims.convert_element_type.default) and tensor_val(cast).dtype == hidden_dtype):
            raise _NoMatch(f"the block returns {tensor_val(total).dtype}, not the hidden states' {hidden_dtype}")
        b.flow.append(cast)
        b.final = cast


def _match_block(offs: torch.fx.Node, mms: list[torch.fx.Node], order: dict[torch.fx.Node, int]) -> _Block:
    """Recognise the experts block around two grouped mms that share ``offs``; raise _NoMatch(reason)."""
    forms = {_grouped_mm_form(m) for m in mms}
    if len(mms) != 2:
        raise _NoMatch(
            f"{len(mms)} grouped mm(s) share the offsets {getattr(offs, 'name', offs)}; "
            "the Hugging Face experts block has exactly two (gate_up and down)"
        )
    if len(forms) != 1:
        raise _NoMatch(f"the two grouped mms are of different kinds {sorted(forms)}")
    fc1, fc2 = sorted(mms, key=order.__getitem__)
    b = _Block(form=forms.pop(), fc1=fc1, fc2=fc2)
    x1, wt1, _ = _gmm_operands(fc1)
    x2, wt2, _ = _gmm_operands(fc2)
    b.w13, b.w13_transposed = _match_weight(b, wt1, "gate_up")
    b.w2, b.w2_transposed = _match_weight(b, wt2, "down")
    ids_g, perm = _match_bookkeeping(b, offs)
    k = tensor_val(b.topk_ids).shape[1]

    # hidden_states[perm // k] (.to(weight.dtype): a cast here means mixed dtypes)
    if is_call(x1, prims.convert_element_type.default):
        raise _NoMatch(
            f"mixed dtypes: the hidden states ({tensor_val(x1.args[0]).dtype}) are cast to the "
            f"expert weights' dtype ({tensor_val(x1).dtype}) before the grouped mm; rubin.moe computes "
            "in one dtype"
        )
    if is_call(x1, aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor):
        raise _NoMatch(
            "the gathered hidden states are masked before the grouped mm: transformers' "
            "expert-parallel sentinel handling (_is_expert_parallel), whose out-of-range expert ids "
            "rubin.moe does not take"
        )
    if not (is_call(x1, aten.index.Tensor) and len(x1.args[1]) == 1):
        raise _NoMatch("the gate_up grouped mm input is not hidden_states gathered by token (hidden_states[perm // k])")
    q = x1.args[1][0]
    if (
        is_call(q, aten.div.Tensor_mode, aten.floor_divide.default)
        and q.args[0] is perm
        and q.args[1] == k
        and q.kwargs.get("rounding_mode", "floor") == "floor"
    ):
        b.flow.append(q)
    elif not (q is perm and k == 1):
        raise _NoMatch("the hidden states are not gathered by perm // k (the token of each sorted slot)")
    b.hidden = x1.args[0]
    b.flow += [x1, fc1]

    h1, b.w13_bias = _match_bias(b, fc1, ids_g, "gate_up")
    gate, up = _split_gate_up(b, h1)
    _match_activation(b, gate, up, x2)
    if _sole_user(x2, "the activation output") is not fc2:
        raise _NoMatch("the activation output does not feed the down grouped mm")
    b.flow.append(fc2)
    y, b.w2_bias = _match_bias(b, fc2, ids_g, "down")
    _match_combine(b, y, perm)

    # dtypes: one compute dtype for hidden states and weights (and biases)
    hv, w13v, w2v = tensor_val(b.hidden), tensor_val(b.w13), tensor_val(b.w2)
    biases = [tensor_val(x).dtype for x in (b.w13_bias, b.w2_bias) if x is not None]
    if len({hv.dtype, w13v.dtype, w2v.dtype, *biases}) != 1:
        raise _NoMatch(
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
        )
    except MoEArgumentError as e:
        raise _NoMatch(f"the matched operands do not fit rubin.moe: {e}") from None

    # Nothing inside the block may be read from outside it: the rewrite would drop what that reader sees
    # and recompute the experts, and the idiom says the block is self-contained.
    # Under dynamic shapes the graph reads sizes off block nodes (``sym_size(view, 0)`` for
    # ``empty_like(perm)``); such a read belongs to the block when only the block uses it.
    b.flow += [u for n in list(b.flow) for u in n.users if is_call(u, *_SIZE_OPS)]
    inside = set(b.flow) | set(b.aux)
    for n in b.flow:
        if n is b.final:
            continue
        outside = [u for u in n.users if u not in inside]
        if outside:
            raise _NoMatch(
                f"intermediate {n.name} of the experts block has a user outside it "
                f"({', '.join(u.name for u in outside)})"
            )
    return b


def _module_path(node: torch.fx.Node) -> Optional[str]:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    path, cls = list(stack.values())[-1]
    path = path.replace("L['self'].", "").replace("L['self']", "self")
    return f"{path} ({getattr(cls, '__name__', cls)})"


def _rewrite(graph: torch.fx.Graph, b: _Block) -> Rewrite:
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
        "module": _module_path(b.fc1),
        "T": report_value(hv.shape[0]),
        "H": report_value(hv.shape[1]),
        "E": E,
        "I": inter,
        "k": tensor_val(b.topk_ids).shape[1],
        "dtype": dtype_name(hv.dtype),
        "activation": b.activation,
        "bias": b.w13_bias is not None,
        "histc_input": b.histc_input,
        "weights": "as stored, no copy" if not notes else "; ".join(notes),
        "routing": routing,
    }
    return Rewrite(
        node=moe.name,
        canonical_op="rubin.moe",
        source_idiom=f"{IDIOM} ({b.form})",
        replaced=sorted(replaced),
        details=details,
    )


def match(graph: torch.fx.Graph, ctx: PassContext) -> tuple[list[Rewrite], list[Unchanged]]:
    """Rewrite every Hugging Face grouped-mm experts block in ``graph`` into ``rubin.moe``."""
    rewrites: list[Rewrite] = []
    unchanged: list[Unchanged] = []
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups: dict[Union[torch.fx.Node, str], list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if _grouped_mm_form(node) is None:
            continue
        try:
            offs = _gmm_operands(node)[2]
        except _NoMatch as e:
            unchanged.append(Unchanged(node.name, IDIOM, str(e)))
            continue
        groups.setdefault(offs if isinstance(offs, torch.fx.Node) else f"<{offs!r}>", []).append(node)
    for offs, mms in groups.items():
        if not isinstance(offs, torch.fx.Node):
            unchanged.append(Unchanged(mms[0].name, IDIOM, "grouped mm without an offsets tensor"))
            continue
        if ctx.gradients:
            unchanged.append(Unchanged(min(mms, key=order.__getitem__).name, IDIOM, GRADIENTS_REASON))
            continue
        try:
            block = _match_block(offs, mms, order)
        except _NoMatch as e:
            unchanged.append(Unchanged(min(mms, key=order.__getitem__).name, IDIOM, str(e)))
            continue
        rewrites.append(_rewrite(graph, block))
    return rewrites, unchanged
