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
(``has_bias=True``) become ``w13_bias`` / ``w2_bias``. The activation between the grouped mms may be any form
hf_activation.py recognises: ``act_fn(gate) * up`` (SiLU, GELU-tanh, GELU), GPT-OSS's clamped SwiGLU over
interleaved columns or halves (MiniMax-M3), the clamped SiLU of DeepSeek-V4 / GLM-5-Next / Hunyuan-V4, Step-3.7's
SwiGLU-step, or a non-gated ``act_fn(up)`` (``has_gate=False``: Nemotron-H's ReLU², ``up_proj`` [E, I, H] as w13),
with its constants as graph inputs under ``dynamic=True``. Left unchanged, with the reason: another activation or
constants rubin.moe does not take, mixed dtypes, an intermediate with a user outside the block, or any other
deviation from the idiom above.

transformers' expert-parallel sentinel masking (``where((ids_g >= E).unsqueeze(-1), 0, x)`` on the gathered hidden
states and on both projections' outputs, the bias gathered by ``ids_g.clamp(max=E - 1)``; in every experts block
of transformers 5.17, only with ``_is_expert_parallel`` from 5.19) zeroes the rows of ids >= E. When the ids
are the indices of a top-k over the E experts in the same graph there are no such rows and the masks are dropped
(the report says so, ``sentinel_masks``); ids from anywhere else (a dispatch that writes sentinels) are left
unchanged with that reason.

Why the block is walked by hand rather than with one ``register_replacement`` pattern: it has optional
parts (biases, dtype conversions that depend on the model and dtype, CPU / CUDA bookkeeping, two grouped
mm ops), a pattern per combination would be dozens of traced patterns, and a pattern that fails says
nothing a user can act on, where a near miss here must say why. The walk is anchored on the pair of
grouped mms that share one offsets tensor. The activation between them, which Inductor decomposes, is
matched with Inductor's pattern matcher from traced ``act(gate) * up`` functions, so it follows whatever
form the decomposition gives.
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Union

import torch

from rubin_compile.passes.base import GRADIENTS_REASON, PassContext, Rewrite, Unchanged
from rubin_compile.passes.fx import dtype_name, getitem_of, is_call, strip_converts, tensor_val
from rubin_compile.passes.match_moe.hf_experts import (
    Block,
    NoMatch,
    check_block,
    gpu_kernel_reason,
    ids_from_topk,
    is_zero_fill,
    match_activation,
    match_bias,
    match_sum_over_k,
    rewrite,
    same,
    sole_user,
    view_input,
)

IDIOM = "hf grouped_mm"
aten = torch.ops.aten
prims = torch.ops.prims

_FALLBACK = "transformers.grouped_mm_fallback.default"


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
        raise NoMatch(f"{node.name} passes {extra} to the grouped mm; Hugging Face's experts never do")
    return bound.get("input"), bound.get("weight"), bound.get("offs")


def _match_bookkeeping(b: Block, offs: Any) -> tuple[torch.fx.Node, torch.fx.Node]:
    """offsets = cumsum(histc(ids_g), dtype=int32); (ids_g, perm) = sort(topk_ids.reshape(-1))."""
    if not is_call(offs, aten.cumsum.default):
        raise NoMatch(
            f"the grouped mm offsets ({getattr(offs, 'name', offs)}) are not a cumsum of per-expert token counts"
        )
    histc = offs.args[0]
    if not is_call(histc, aten.histc.default):
        raise NoMatch(
            f"the offsets are a cumsum of {getattr(histc, 'name', histc)}, not of torch.histc "
            "(transformers 5.x counts tokens per expert with histc)"
        )
    given = dict(zip(("bins", "min", "max"), histc.args[1:]), **histc.kwargs)
    bins, lo, hi = given.get("bins", 100), given.get("min", 0), given.get("max", 0)
    hval = tensor_val(histc.args[0])
    b.extra_details["histc_input"] = dtype_name(hval.dtype) if hval is not None else None
    sort = getitem_of(strip_converts(histc.args[0]), 0, aten.sort.default, aten.sort.stable)
    if sort is None:
        raise NoMatch("histc does not count the sorted expert ids (sort(...)[0])")
    # aten.sort.default(self, dim=-1, descending=False); aten.sort.stable(self, *, stable, dim, descending)
    positional = dict(zip(("dim", "descending"), sort.args[1:])) if sort.target is aten.sort.default else {}
    if {**positional, **sort.kwargs}.get("descending", False):
        raise NoMatch("the expert ids are sorted in descending order")
    ids_g = perm = None
    for u in sort.users:
        if is_call(u, operator.getitem) and u.args[1] == 0:
            ids_g = u
        elif is_call(u, operator.getitem) and u.args[1] == 1:
            perm = u
    if perm is None:
        raise NoMatch("the sort permutation is unused; hidden states are not gathered by it")
    b.topk_ids = view_input(sort.args[0], "the sorted expert ids")
    ids_val = tensor_val(b.topk_ids)
    if ids_val is None or ids_val.dim() != 2:
        raise NoMatch("the sorted expert ids are not a reshape of a [T, k] top-k index tensor")
    if not (same(bins, tensor_val(b.w13).shape[0]) and lo == 0 and same(hi, bins - 1)):
        raise NoMatch(
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


def _match_weight(b: Block, weight: Any, which: str) -> tuple[torch.fx.Node, bool]:
    """The stored expert weight behind the grouped mm's [E, K, N] operand, and whether it is stored
    transposed (the canonical layout is [E, N, K], which HF stores and transposes per call)."""
    if is_call(weight, aten.permute.default) and list(weight.args[1]) in ([0, 2, 1], [0, -1, -2]):
        b.aux.append(weight)
        return weight.args[0], False
    if is_call(weight, aten.transpose.int) and sorted(a % 3 for a in weight.args[1:3]) == [1, 2]:
        b.aux.append(weight)
        return weight.args[0], False
    if tensor_val(weight) is None or tensor_val(weight).dim() != 3:
        raise NoMatch(f"the {which} weight of the grouped mm ({getattr(weight, 'name', weight)}) is not [E, K, N]")
    return weight, True


def _match_combine(b: Block, y: torch.fx.Node, perm: torch.fx.Node) -> None:
    """``(y * w[perm].unsqueeze(-1))[inv_perm].view(T, k, H).sum(1)`` [``.to(hidden.dtype)``]."""
    mul = sole_user(y, "the down grouped mm output")
    if not is_call(mul, aten.mul.Tensor):
        raise NoMatch(
            f"the down projection output feeds {mul.name} ({mul.target}), not the multiplication by the routing weights"
        )
    sw = mul.args[1] if mul.args[0] is y else mul.args[0]
    if not is_call(sw, aten.unsqueeze.default):
        raise NoMatch(
            "the down projection output is not multiplied by the routing weights gathered by the sort "
            "permutation (sample_weights_g.unsqueeze(-1))"
        )
    gathered = sw.args[0]
    if not (is_call(gathered, aten.index.Tensor) and len(gathered.args[1]) == 1 and gathered.args[1][0] is perm):
        raise NoMatch("the routing weights are not gathered by the sort permutation")
    b.topk_weights = view_input(gathered.args[0], "the flattened routing weights")
    b.flow += [mul, sw, gathered, gathered.args[0]]

    unperm = sole_user(mul, "the weighted expert output")
    if not (is_call(unperm, aten.index.Tensor) and len(unperm.args[1]) == 1):
        raise NoMatch("the weighted expert output is not put back in token order (weighted_out[inv_perm])")
    inv = unperm.args[1][0]
    ok = (
        is_call(inv, aten.index_put.default)
        and len(inv.args[1]) == 1
        and inv.args[1][0] is perm
        and is_call(inv.args[2], prims.iota.default, aten.arange.default, aten.arange.start)
    )
    if not ok:
        raise NoMatch(
            "the weighted expert output is gathered by something other than the inverse sort "
            "permutation (inv_perm[perm] = arange)"
        )
    b.flow += [unperm, inv]
    b.aux += [inv.args[0], inv.args[2]]

    match_sum_over_k(b, sole_user(unperm, "the expert output in token order"))


def _sentinel_mask(b: Block, node: Any, ids_g: torch.fx.Node, E: int) -> Optional[torch.fx.Node]:
    """If ``node`` is ``where((ids_g >= E).unsqueeze(-1), 0, x)`` -- transformers' expert-parallel sentinel masking
    (``masked_fill(sentinel_mask, 0.0)``; every experts block in transformers 5.17, only with
    ``_is_expert_parallel`` later) -- return ``x``, recording the mask nodes; else None."""
    if not (is_call(node, aten.where.self) and len(node.args) == 3):
        return None
    cond, zero, x = node.args
    if not (is_call(cond, aten.unsqueeze.default) and cond.args[1] in (-1, 1)):
        return None
    ge = cond.args[0]
    if not (is_call(ge, aten.ge.Scalar) and ge.args[0] is ids_g and ge.args[1] == E):
        return None
    if not is_zero_fill(zero) and not (isinstance(zero, (int, float)) and zero == 0):
        return None
    b.flow.append(node)
    b.aux += [cond, ge] + ([zero] if isinstance(zero, torch.fx.Node) else [])
    return x


def _unmask_output(b: Block, out: torch.fx.Node, ids_g: torch.fx.Node, E: int) -> torch.fx.Node:
    """``out``, or the sentinel-masked ``out`` when its only reader masks it (then that mask is part of the block)."""
    if not b.extra_details.get("sentinel_masks"):
        return out
    user = sole_user(out, "the grouped mm output")
    return user if _sentinel_mask(b, user, ids_g, E) is out else out


def _match_block(offs: torch.fx.Node, mms: list[torch.fx.Node], order: dict[torch.fx.Node, int]) -> Block:
    """Recognise the experts block around two grouped mms that share ``offs``; raise NoMatch(reason)."""
    forms = {_grouped_mm_form(m) for m in mms}
    if len(mms) != 2:
        raise NoMatch(
            f"{len(mms)} grouped mm(s) share the offsets {getattr(offs, 'name', offs)}; "
            "the Hugging Face experts block has exactly two (gate_up and down)"
        )
    if len(forms) != 1:
        raise NoMatch(f"the two grouped mms are of different kinds {sorted(forms)}")
    fc1, fc2 = sorted(mms, key=order.__getitem__)
    b = Block(form=forms.pop(), fc1=fc1, fc2=fc2)
    x1, wt1, _ = _gmm_operands(fc1)
    x2, wt2, _ = _gmm_operands(fc2)
    b.w13, b.w13_transposed = _match_weight(b, wt1, "gate_up")
    b.w2, b.w2_transposed = _match_weight(b, wt2, "down")
    ids_g, perm = _match_bookkeeping(b, offs)
    k = tensor_val(b.topk_ids).shape[1]

    # hidden_states[perm // k] (.to(weight.dtype): a cast here means mixed dtypes)
    if is_call(x1, prims.convert_element_type.default):
        raise NoMatch(
            f"mixed dtypes: the hidden states ({tensor_val(x1.args[0]).dtype}) are cast to the "
            f"expert weights' dtype ({tensor_val(x1).dtype}) before the grouped mm; rubin.moe computes "
            "in one dtype"
        )
    E = tensor_val(b.w13).shape[0]
    unmasked = _sentinel_mask(b, x1, ids_g, E)
    if unmasked is not None:
        # transformers' expert-parallel sentinel masking zeroes the rows of expert ids >= E; with ids from a top-k
        # over the E experts there are none, and the masks change nothing.
        why = ids_from_topk(b, E)
        if why is not None:
            raise NoMatch(
                "the gathered hidden states are masked before the grouped mm: transformers' expert-parallel "
                f"sentinel handling, whose out-of-range expert ids rubin.moe does not take ({why})"
            )
        b.extra_details["sentinel_masks"] = "expert-parallel sentinel masks dropped: the ids come from a top-k over E"
        x1 = unmasked
    elif is_call(x1, aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor):
        raise NoMatch(
            f"the gathered hidden states are masked ({x1.name}) before the grouped mm by something other than "
            "transformers' expert-parallel sentinel mask"
        )
    clamp = next(
        (u for u in ids_g.users if is_call(u, aten.clamp_max.default) and u.args[1] == E - 1),
        None,
    )
    ids_bias = clamp if clamp is not None and b.extra_details.get("sentinel_masks") else ids_g
    if ids_bias is not ids_g:
        b.aux.append(clamp)  # expert_ids_g.clamp_(max=E - 1): the identity on ids below E
    if not (is_call(x1, aten.index.Tensor) and len(x1.args[1]) == 1):
        raise NoMatch("the gate_up grouped mm input is not hidden_states gathered by token (hidden_states[perm // k])")
    q = x1.args[1][0]
    if (
        is_call(q, aten.div.Tensor_mode, aten.floor_divide.default)
        and q.args[0] is perm
        and q.args[1] == k
        and q.kwargs.get("rounding_mode", "floor") == "floor"
    ):
        b.flow.append(q)
    elif not (q is perm and k == 1):
        raise NoMatch("the hidden states are not gathered by perm // k (the token of each sorted slot)")
    b.hidden = x1.args[0]
    b.flow += [x1, fc1]

    h1, b.w13_bias = match_bias(b, fc1, ids_bias, "gate_up grouped mm")
    h1 = _unmask_output(b, h1, ids_g, E)
    match_activation(b, h1, x2, "down grouped mm")
    if sole_user(x2, "the activation output") is not fc2:
        raise NoMatch("the activation output does not feed the down grouped mm")
    b.flow.append(fc2)
    y, b.w2_bias = match_bias(b, fc2, ids_bias, "down grouped mm")
    y = _unmask_output(b, y, ids_g, E)
    _match_combine(b, y, perm)

    check_block(b)
    return b


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
        except NoMatch as e:
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
        except NoMatch as e:
            unchanged.append(Unchanged(min(mms, key=order.__getitem__).name, IDIOM, str(e)))
            continue
        reason = gpu_kernel_reason(block, ctx.target)
        if reason is not None:
            unchanged.append(Unchanged(block.fc1.name, IDIOM, reason))
            continue
        rewrites.append(rewrite(graph, block, IDIOM))
    return rewrites, unchanged
