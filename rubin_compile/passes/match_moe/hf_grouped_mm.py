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
    inv = aten.index_put(aten.empty([S]), [perm], prims.iota(S))          # S = 1: aten.reshape(prims.iota(1), [])
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
of transformers 5.17, only with ``_is_expert_parallel`` from 5.19; transformers 5.8 to 5.16 mask the gathered hidden
states and the weighted output ``proj_out * sample_weights_g`` instead of the projections', in every experts block)
zeroes the rows of ids >= E. When the ids are the indices of a top-k over the E experts in the same graph there are
no such rows and the masks are dropped (the report says so, ``sentinel_masks``); ids from anywhere else (a dispatch
that writes sentinels) are left unchanged with that reason.

Versions: the walk above is transformers 5.8's ``grouped_mm_experts_forward`` onwards (5.8 to 5.25 compared line by
line: they differ only in where the sentinel masks sit; 5.25 adds an optional norm after the down projection,
``has_post_expert_norm``, Muse Spark's, which the walk does not take: such a block is left unchanged with the reason).
5.4 to 5.7 sort with ``perm = argsort(expert_ids)`` and
gather by it (``expert_ids[perm]`` counted by histc, ``hidden_states[token_idx[perm]]``, in 5.4
``hidden_states[token_idx][perm]``, with ``token_idx = arange(T).unsqueeze(1).expand(-1, k).reshape(-1)``); 5.6 and
5.7 clamp the ids to [0, E - 1] before the argsort and mask the weighted output where ``expert_ids >= E`` (dropped
as above, ``sentinel_clamp``). 5.3 inverts ``perm`` with a second ``argsort``: left unchanged with the reason. Before
5.3 transformers calls ``torch._grouped_mm`` for every dtype, which torch 2.13 refuses for fp32 under torch.compile
(its fake kernel takes bf16 only), with or without rubin; torch 2.15 takes it (seen with backend="inductor"), and those
releases invert ``perm`` with ``argsort`` as 5.3 does.

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
from rubin_compile.passes.fx import RESHAPES, dtype_name, getitem_of, is_call, single_user, strip_converts, tensor_val
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
    sentinel_clamps,
    sole_user,
    token_of_slots,
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


def _argsorted_ids(node: Any) -> Optional[torch.fx.Node]:
    """For ``ids[perm]`` with ``perm = argsort(ids)`` (``aten.index(ids, [sort(ids)[1]])``, transformers 5.4 to 5.7):
    the sort node; else None."""
    if not (is_call(node, aten.index.Tensor) and len(node.args[1]) == 1):
        return None
    sort = getitem_of(node.args[1][0], 1, aten.sort.default, aten.sort.stable)
    return sort if sort is not None and sort.args[0] is node.args[0] else None


def _match_bookkeeping(b: Block, offs: Any) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]:
    """offsets = cumsum(histc(ids_g), dtype=int32); (ids_g, perm) = sort(topk_ids.reshape(-1)), or (transformers 5.4
    to 5.7) perm = argsort(ids), ids_g = ids[perm], ids = topk_ids.reshape(-1) [.clamp(0, E - 1)]. Returns (ids_g,
    perm, the flattened ids before any clamp)."""
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
    counted = strip_converts(histc.args[0])
    sort = getitem_of(counted, 0, aten.sort.default, aten.sort.stable)
    argsorted = _argsorted_ids(counted) if sort is None else None
    if sort is None and argsorted is None:
        raise NoMatch(
            "histc does not count the sorted expert ids (sort(...)[0], or ids[argsort(ids)] as transformers 5.4 "
            "to 5.7 write it)"
        )
    sort = sort if argsorted is None else argsorted
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
    E = tensor_val(b.w13).shape[0]
    flat, clamps = sort.args[0], []
    if argsorted is not None:
        ids_g = counted
        flat, clamps = _clamped(sort.args[0], E)
    b.topk_ids = view_input(flat, "the sorted expert ids")
    ids_val = tensor_val(b.topk_ids)
    if ids_val is None or ids_val.dim() != 2:
        raise NoMatch("the sorted expert ids are not a reshape of a [T, k] top-k index tensor")
    if clamps:
        # transformers 5.6 / 5.7: expert_ids.clamp(0, E - 1) before the argsort (expert-parallel sentinels)
        why = ids_from_topk(b, E)
        if why is not None:
            raise NoMatch(
                "the expert ids are clamped before they are sorted: transformers' expert-parallel sentinel "
                f"handling, whose out-of-range expert ids rubin.moe does not take ({why})"
            )
        b.extra_details["sentinel_clamp"] = "expert-parallel sentinel clamp dropped: the ids come from a top-k over E"
        b.flow += clamps
    if argsorted is not None:
        b.extra_details["sort"] = "argsort, the sorted ids gathered by the permutation (transformers 5.4 to 5.7)"
    if not (same(bins, E) and lo == 0 and same(hi, bins - 1)):
        raise NoMatch(f"histc(bins={bins}, min={lo}, max={hi}) does not count experts 0..E-1 for E={E}")
    b.flow += [flat, sort, ids_g, perm, offs, histc]
    b.flow += [n for n in _converts_between(histc.args[0], ids_g)]
    return ids_g, perm, flat


def _clamped(node: Any, E: int) -> tuple[Any, list[torch.fx.Node]]:
    """``node`` under ``.clamp(0, E - 1)`` (Inductor splits it into clamp_min and clamp_max), and the clamp nodes;
    ``(node, [])`` when it is not clamped. A clamp to other bounds is a NoMatch."""
    node, clamps, bounds = sentinel_clamps(node)
    if clamps and not (bounds.get("min", 0) == 0 and bounds.get("max") == E - 1):
        raise NoMatch(f"the expert ids are clamped to {bounds} before they are sorted, not to [0, {E - 1}]")
    return node, clamps


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


def _match_combine(
    b: Block, y: torch.fx.Node, perm: torch.fx.Node, ids_g: torch.fx.Node, flat_ids: torch.fx.Node, E: int
) -> None:
    """``(y * w[perm].unsqueeze(-1))[inv_perm].view(T, k, H).sum(1)`` [``.to(hidden.dtype)``]; transformers 5.6 to
    5.16 mask the weighted output (``weighted_out.masked_fill_(sentinel_mask, 0.0)``) instead of the projections'."""
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

    weighted = _unmask_output(b, mul, ids_g, E)
    if weighted is mul and b.extra_details.get("sentinel_clamp"):
        weighted = _invalid_slots_mask(b, mul, perm, flat_ids, E)
    unperm = sole_user(weighted, "the weighted expert output")
    if is_call(unperm, aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor):
        raise NoMatch(
            f"the weighted expert output is masked ({unperm.name}) by something other than transformers' "
            "expert-parallel sentinel mask over the gathered hidden states"
        )
    if not (is_call(unperm, aten.index.Tensor) and len(unperm.args[1]) == 1):
        raise NoMatch("the weighted expert output is not put back in token order (weighted_out[inv_perm])")
    inv = unperm.args[1][0]
    positions = None
    if is_call(inv, aten.index_put.default) and len(inv.args[1]) == 1 and inv.args[1][0] is perm:
        positions = _arange_of(inv.args[2], tensor_val(perm).shape[0])
    if positions is None:
        raise NoMatch(
            "the weighted expert output is gathered by something other than the inverse sort "
            "permutation (inv_perm[perm] = arange)"
        )
    b.flow += [unperm, inv]
    b.aux += [inv.args[0], *positions]

    match_sum_over_k(b, sole_user(unperm, "the expert output in token order"))


def _arange_of(node: Any, size: Any) -> Optional[list[torch.fx.Node]]:
    """If ``node`` is ``arange(size)`` (0, 1, ..., size - 1), the nodes that make it; else None.

    ``inv_perm[perm] = torch.arange(S)`` reaches the graph as ``prims.iota(S, start=0, step=1)``, except at S = 1
    (one token, top-1: the decode step of a top-1 model), where the decomposition of ``index_put`` reads the one
    value as a scalar: ``reshape(iota(1), [])``, which broadcast over the one index is the same permutation."""
    nodes = []
    if is_call(node, *RESHAPES) and list(node.args[1]) == [] and same(size, 1):
        nodes.append(node)
        node = node.args[0]
    if is_call(node, prims.iota.default):
        given = dict(zip(("length", "start", "step"), node.args), **node.kwargs)
        length, start, step = given.get("length"), given.get("start"), given.get("step")
    elif is_call(node, aten.arange.default):
        length, start, step = node.args[0], 0, 1
    elif is_call(node, aten.arange.start):
        length, start, step = node.args[1], node.args[0], 1  # arange(0, S)
    else:
        return None
    if isinstance(length, torch.fx.Node):  # a symbolic size (dynamic shapes) is a node of the graph
        length = length.meta.get("val")
    if not (start == 0 and step == 1 and length is not None and same(length, size)):
        return None
    return [*nodes, node]


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


def _invalid_slots_mask(
    b: Block, out: torch.fx.Node, perm: torch.fx.Node, flat_ids: torch.fx.Node, E: int
) -> torch.fx.Node:
    """transformers 5.6 / 5.7: ``weighted_out.masked_fill_(invalid_mask[perm].unsqueeze(-1), 0.0)`` with ``invalid_mask
    = expert_ids >= E`` taken before the clamp (post-grad: ``where(unsqueeze(index(ge(ids, E), [perm]), -1), 0, out)``):
    the mask node, part of the block, when ``out``'s only reader is it (the clamp was dropped: no id is >= E); else
    ``out``."""
    user = single_user(out)
    if not (is_call(user, aten.where.self) and len(user.args) == 3 and user.args[2] is out):
        return out
    cond, zero = user.args[0], user.args[1]
    if not (is_call(cond, aten.unsqueeze.default) and cond.args[1] in (-1, 1)):
        return out
    gathered = cond.args[0]
    if not (is_call(gathered, aten.index.Tensor) and len(gathered.args[1]) == 1 and gathered.args[1][0] is perm):
        return out
    ge = gathered.args[0]
    if not (is_call(ge, aten.ge.Scalar) and ge.args[0] is flat_ids and ge.args[1] == E):
        return out
    if not is_zero_fill(zero) and not (isinstance(zero, (int, float)) and zero == 0):
        return out
    b.flow.append(user)
    b.aux += [cond, gathered, ge] + ([zero] if isinstance(zero, torch.fx.Node) else [])
    return user


def _unmask_output(b: Block, out: torch.fx.Node, ids_g: torch.fx.Node, E: int) -> torch.fx.Node:
    """``out``, or the sentinel-masked ``out`` when its only reader masks it (then that mask is part of the block).
    Where the mask is (transformers 5.17+: both projections' outputs; 5.8 to 5.16: the weighted output) differs by
    version, so ``out`` with several readers (an in-place bias add's views regenerated per reader) is left as is."""
    if not b.extra_details.get("sentinel_masks"):
        return out
    user = single_user(out)
    return user if user is not None and _sentinel_mask(b, user, ids_g, E) is out else out


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
    ids_g, perm, flat_ids = _match_bookkeeping(b, offs)
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
    q, b.hidden = x1.args[1][0], x1.args[0]
    inner = b.hidden  # transformers 5.4: hidden_states[token_idx][perm]
    inner_ok = is_call(inner, aten.index.Tensor) and len(inner.args[1]) == 1 and tensor_val(inner.args[0]) is not None
    if (
        is_call(q, aten.div.Tensor_mode, aten.floor_divide.default)
        and q.args[0] is perm
        and q.args[1] == k
        and q.kwargs.get("rounding_mode", "floor") == "floor"
    ):
        b.flow.append(q)
    elif (  # transformers 5.5 to 5.7: hidden_states[token_idx[perm]]
        is_call(q, aten.index.Tensor)
        and len(q.args[1]) == 1
        and q.args[1][0] is perm
        and token_of_slots(b, q.args[0], tensor_val(b.hidden).shape[0], k)
    ):
        b.flow.append(q)
    elif q is perm and inner_ok and token_of_slots(b, inner.args[1][0], tensor_val(inner.args[0]).shape[0], k):
        b.flow.append(inner)
        b.hidden = inner.args[0]
    elif not (q is perm and k == 1):
        raise NoMatch(
            "the hidden states are not gathered by perm // k (the token of each sorted slot; before transformers "
            "5.8: token_idx[perm] with token_idx = arange(T).repeat_interleave(k))"
        )
    b.flow += [x1, fc1]

    h1, b.w13_bias = match_bias(b, fc1, ids_bias, "gate_up grouped mm")
    h1 = _unmask_output(b, h1, ids_g, E)
    match_activation(b, h1, x2, "down grouped mm")
    if sole_user(x2, "the activation output") is not fc2:
        raise NoMatch("the activation output does not feed the down grouped mm")
    b.flow.append(fc2)
    y, b.w2_bias = match_bias(b, fc2, ids_bias, "down grouped mm")
    y = _unmask_output(b, y, ids_g, E)
    _match_combine(b, y, perm, ids_g, flat_ids, E)

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
