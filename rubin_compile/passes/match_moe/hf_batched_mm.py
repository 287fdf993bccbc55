"""Matcher (d): Hugging Face transformers 5.x experts in their ``batched_mm`` form.

Source idiom (``transformers/integrations/moe.py``, ``batched_mm_experts_forward``, transformers 5.19):
``generate()`` switches every ``grouped_mm`` experts block of a model on a GPU to this form for its decode
steps (``GenerationMixin._optimize_model_for_decode``), so it is what a compiled decode step holds; a model can
also ask for it (``experts_implementation="batched_mm"``). Every (token, expert) pair gathers its expert's
weights and multiplies them as one batched matmul::

    x = hidden_states.repeat_interleave(k, dim=0)                      # [T*k, H]
    ids = top_k_index.reshape(-1)                                      # [T*k]
    h = torch.bmm(gate_up_proj[ids], x.unsqueeze(-1)).squeeze(-1)      # [T*k, 2I]   (+ gate_up_proj_bias[ids])
    gate, up = h.chunk(2, dim=-1);  a = act_fn(gate) * up              # _default_apply_gate
    y = torch.bmm(down_proj[ids], a.unsqueeze(-1)).squeeze(-1)         # [T*k, H]    (+ down_proj_bias[ids])
    out = (y * top_k_weights.reshape(-1).unsqueeze(-1)).view(T, k, H).sum(dim=1).to(hidden_states.dtype)

(with ``is_transposed=True``: ``torch.bmm(x.unsqueeze(1), W[ids]).squeeze(1)``). Post-grad ATen keeps that
shape: ``aten.index(W, [reshape(ids, [-1])])``, ``aten.bmm``, ``aten.squeeze.dim``; the repeat is
``reshape(clone(expand(unsqueeze(hidden, 1), [T, k, H])), [T*k, H])``.

Why it is worth a rewrite: ``gate_up_proj[ids]`` copies k experts' weights per token before reading them
again in the bmm -- three passes over the routed weights where the fused kernel makes one, and decode is
bound by exactly those bytes. One ``rubin.moe`` replaces the block (weights as stored: no gather, no copy).
The activations are hf_grouped_mm.py's (hf_activation.py). Left unchanged, with the reason: what hf_grouped_mm.py
leaves (activations and constants rubin.moe does not take, mixed dtypes, outside users), and the expert-parallel form (``expert_ids.clamp(0, E - 1)`` and routing
weights masked where ``ids >= E``) unless the ids are a top-k over the E experts in the graph -- then the clamp and
the mask change nothing and are dropped (transformers 5.17 clamps in every experts block).

Versions: as written above from transformers 5.8 (5.8 clamps the ids in place, 5.10 to 5.17 out of place, 5.18+ only
with ``_is_expert_parallel`` and masking the routing weights). 5.3 to 5.7 gather the rows by a token index
(``hidden_states[token_idx]``, ``token_idx = arange(T).unsqueeze(1).expand(-1, k).reshape(-1)``), clamp the ids and
mask the weighted output where the unclamped ids are >= E (``weighted_out.masked_fill_``); both dropped as above.
Before 5.3 the block differs in more than bookkeeping (5.1 compares the routing weights' sum with 0, a graph break;
5.0 / 5.2 multiply by the weights without ``unsqueeze`` / by a validity mask) and is left unchanged with the reason.

Walked by hand, anchored on the pair of bmms whose weights are gathered by one ids tensor, for the reasons in
hf_grouped_mm.py; the shared parts are in hf_experts.py.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from rubin_compile.passes.base import GRADIENTS_REASON, PassContext, Rewrite, Unchanged
from rubin_compile.passes.fx import RESHAPES, is_call, single_user, tensor_val
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

IDIOM = "hf batched_mm"
FORM = "aten.bmm"
aten = torch.ops.aten


def _gathered_weight(node: Any) -> Optional[tuple[torch.fx.Node, torch.fx.Node]]:
    """For ``aten.index(W, [ids])`` with W 3-D and ids 1-D: (W, ids); else None."""
    if not (is_call(node, aten.index.Tensor) and len(node.args[1]) == 1 and isinstance(node.args[1][0], torch.fx.Node)):
        return None
    w, ids = node.args[0], node.args[1][0]
    wv, iv = tensor_val(w), tensor_val(ids)
    if wv is None or iv is None or wv.dim() != 3 or iv.dim() != 1:
        return None
    return w, ids


def _bmm_operands(bmm: torch.fx.Node) -> Optional[tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node, bool]]:
    """(stored weight W, ids, the vector operand, transposed) of ``bmm(W[ids], v.unsqueeze(-1))`` or
    ``bmm(v.unsqueeze(1), W[ids])`` (W stored transposed); None when neither operand is a gathered weight."""
    a, b = bmm.args[:2]
    ga, gb = _gathered_weight(a), _gathered_weight(b)
    if ga is not None:
        return ga[0], ga[1], b, False
    if gb is not None:
        return gb[0], gb[1], a, True
    return None


def _projection(b: Block, bmm: torch.fx.Node, which: str) -> tuple[torch.fx.Node, torch.fx.Node, bool]:
    """For one projection's bmm: (its input [S, K], its output [S, N] after the squeeze, W stored transposed)."""
    w, ids, vec, transposed = _bmm_operands(bmm)
    dim = 1 if transposed else -1
    if not (is_call(vec, aten.unsqueeze.default) and vec.args[1] % 3 == dim % 3):
        raise NoMatch(
            f"the {which} bmm multiplies the gathered weights by {getattr(vec, 'name', vec)}, not by the rows "
            f"unsqueezed to a {'row' if transposed else 'column'} (x.unsqueeze({dim}))"
        )
    squeeze = sole_user(bmm, f"the {which} bmm")
    if not (is_call(squeeze, aten.squeeze.dim) and squeeze.args[1] % 3 == dim % 3):
        raise NoMatch(f"the {which} bmm output is not squeezed back to [S, N] (squeeze({dim}))")
    gather = bmm.args[1] if transposed else bmm.args[0]
    b.flow += [gather, vec, bmm, squeeze]
    return vec.args[0], squeeze, transposed


def _repeated_hidden(b: Block, x: Any, k: int) -> torch.fx.Node:
    """The hidden states under ``hidden_states.repeat_interleave(k, dim=0)``."""
    if is_call(x, aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor):
        raise NoMatch("the repeated hidden states are masked before the gate_up bmm: not this idiom")
    if is_call(x, *RESHAPES):
        chain = [x]
        inner = x.args[0]
        if is_call(inner, aten.clone.default):
            chain.append(inner)
            inner = inner.args[0]
        if is_call(inner, aten.expand.default) and is_call(inner.args[0], aten.unsqueeze.default):
            unsq = inner.args[0]
            base, ev = unsq.args[0], tensor_val(inner)
            bv = tensor_val(base)
            if (
                unsq.args[1] % 3 == 1
                and bv is not None
                and bv.dim() == 2
                and ev.dim() == 3
                and same(ev.shape[1], k)
                and same(ev.shape[0], bv.shape[0])
            ):
                b.flow += chain + [inner, unsq]
                return base
    if is_call(x, aten.index.Tensor) and len(x.args[1]) == 1 and tensor_val(x.args[0]) is not None:
        # transformers 5.3 to 5.7: hidden_states[token_idx], token_idx = arange(T).unsqueeze(1).expand(-1, k).reshape(-1)
        if token_of_slots(b, x.args[1][0], tensor_val(x.args[0]).shape[0], k):
            b.flow.append(x)
            return x.args[0]
    xv = tensor_val(x)
    if k == 1 and xv is not None and xv.dim() == 2:
        return x  # repeat_interleave(1) is the tensor itself
    raise NoMatch(
        f"the gate_up bmm input ({getattr(x, 'name', x)}) is not the hidden states repeated k={k} times per "
        "token (hidden_states.repeat_interleave(k, dim=0), or hidden_states[token_idx] before transformers 5.8)"
    )


def _regenerated_views(b: Block, node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that hold ``node``'s value for its readers. ``_batched_linear`` adds the bias in place
    (``out.add_(bias)`` on the bmm output squeezed): functionalization writes ``add``, then the squeezed view
    again from the restored base, once per reader: ``squeeze(unsqueeze(add, d), d)`` (d = -1, or 1 transposed)."""
    user = single_user(node)
    if not (is_call(user, aten.unsqueeze.default) and user.args[1] % 3 in (1, 2) and user.users):
        return [node]
    views = list(user.users)
    if not all(is_call(v, aten.squeeze.dim) and v.args[1] % 3 == user.args[1] % 3 for v in views):
        return [node]
    b.flow += [user, *views]
    return views


def _match_block(fc1: torch.fx.Node, fc2: torch.fx.Node, ids: torch.fx.Node) -> Block:
    """Recognise the experts block around its two bmms (weights gathered by ``ids``); raise NoMatch(reason)."""
    b = Block(form=FORM, fc1=fc1, fc2=fc2)
    w13, _, _, _ = _bmm_operands(fc1)
    w2, _, _, _ = _bmm_operands(fc2)
    flat, clamps, bounds = sentinel_clamps(ids)
    if clamps:
        E = tensor_val(w13).shape[0]
        b.topk_ids = view_input(flat, "the flattened expert ids")
        in_range = bounds.get("min", 0) == 0 and bounds.get("max") == E - 1
        why = ids_from_topk(b, E) if in_range else f"clamped to {bounds}, not [0, {E - 1}]"
        if why is not None:
            raise NoMatch(
                "the expert ids are clamped before the weights are gathered: transformers' expert-parallel "
                f"sentinel handling, whose out-of-range expert ids rubin.moe does not take ({why})"
            )
        b.extra_details["sentinel_clamp"] = "expert-parallel sentinel clamp dropped: the ids come from a top-k over E"
        b.flow += clamps
    b.topk_ids = view_input(flat, "the flattened expert ids")
    ids_val = tensor_val(b.topk_ids)
    if ids_val is None or ids_val.dim() != 2:
        raise NoMatch("the expert ids are not a reshape of a [T, k] top-k index tensor")
    k = ids_val.shape[1]
    b.flow.append(flat)

    x, h1, b.w13_transposed = _projection(b, fc1, "gate_up")
    b.w13 = w13
    b.hidden = _repeated_hidden(b, x, k)
    h1, b.w13_bias = match_bias(b, h1, ids, "gate_up bmm")
    views = _regenerated_views(b, h1)
    a, y, b.w2_transposed = _projection(b, fc2, "down")
    b.w2 = w2
    match_activation(b, views, a, "down bmm")
    y, b.w2_bias = match_bias(b, y, ids, "down bmm")
    views = _regenerated_views(b, y)
    if len(views) != 1:
        raise NoMatch(f"the down projection output ({y.name}) is read {len(views)} times; the idiom reads it once")
    y = views[0]

    # (y * top_k_weights.reshape(-1).unsqueeze(-1)).view(T, k, H).sum(dim=1)
    mul = sole_user(y, "the down projection output")
    if not is_call(mul, aten.mul.Tensor):
        raise NoMatch(
            f"the down projection output feeds {mul.name} ({mul.target}), not the multiplication by the routing weights"
        )
    sw = mul.args[1] if mul.args[0] is y else mul.args[0]
    if clamps and is_call(sw, aten.unsqueeze.default) and is_call(sw.args[0], aten.where.self):
        # the routing weights of sentinel slots zeroed (transformers >= 5.19 with _is_expert_parallel): there are
        # none when the ids are a top-k over E (checked above)
        masked = sw.args[0]
        cond, zero, w = masked.args
        ok = (
            is_call(cond, aten.ge.Scalar)
            and cond.args[0] is flat
            and cond.args[1] == tensor_val(w13).shape[0]
            and is_zero_fill(zero)
        )
        if not ok:
            raise NoMatch("the routing weights are masked by something other than transformers' sentinel mask")
        b.flow.append(masked)
        b.aux += [cond] + ([zero] if isinstance(zero, torch.fx.Node) else [])
        weights = w
    else:
        weights = sw.args[0] if is_call(sw, aten.unsqueeze.default) else None
    if not (is_call(sw, aten.unsqueeze.default) and is_call(weights, *RESHAPES)):
        raise NoMatch(
            "the down projection output is not multiplied by the flattened routing weights "
            "(top_k_weights.reshape(-1).unsqueeze(-1))"
        )
    b.topk_weights = view_input(weights, "the flattened routing weights")
    b.flow += [mul, sw, weights]
    weighted = mul
    user = sole_user(mul, "the weighted expert output")
    if clamps and is_call(user, aten.where.self) and len(user.args) == 3 and user.args[2] is mul:
        # transformers 5.3 to 5.7: weighted_out.masked_fill_((expert_ids >= E).unsqueeze(-1), 0.0), the ids taken
        # before the clamp; no id is >= E when they are a top-k over E (checked above)
        cond, zero = user.args[0], user.args[1]
        ge = cond.args[0] if is_call(cond, aten.unsqueeze.default) and cond.args[1] in (-1, 1) else None
        ok = (
            is_call(ge, aten.ge.Scalar)
            and ge.args[0] is flat
            and ge.args[1] == tensor_val(w13).shape[0]
            and (is_zero_fill(zero) or (isinstance(zero, (int, float)) and zero == 0))
        )
        if not ok:
            raise NoMatch("the weighted expert output is masked by something other than transformers' sentinel mask")
        b.flow.append(user)
        b.aux += [cond, ge] + ([zero] if isinstance(zero, torch.fx.Node) else [])
        weighted = user
    match_sum_over_k(b, sole_user(weighted, "the weighted expert output"))
    check_block(b)
    return b


def match(graph: torch.fx.Graph, ctx: PassContext) -> tuple[list[Rewrite], list[Unchanged]]:
    """Rewrite every Hugging Face batched-mm experts block in ``graph`` into ``rubin.moe``."""
    rewrites: list[Rewrite] = []
    unchanged: list[Unchanged] = []
    by_ids: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if is_call(node, aten.bmm.default):
            operands = _bmm_operands(node)
            if operands is not None:
                by_ids.setdefault(operands[1], []).append(node)
    for ids, bmms in by_ids.items():
        if ctx.gradients:
            unchanged.append(Unchanged(bmms[0].name, IDIOM, GRADIENTS_REASON))
            continue
        if len(bmms) != 2:
            unchanged.append(
                Unchanged(
                    bmms[0].name,
                    IDIOM,
                    f"{len(bmms)} bmm(s) read weights gathered by {ids.name}; the Hugging Face experts block has "
                    "exactly two (gate_up and down)",
                )
            )
            continue
        try:
            block = _match_block(bmms[0], bmms[1], ids)  # graph order: gate_up first
        except NoMatch as e:
            unchanged.append(Unchanged(bmms[0].name, IDIOM, str(e)))
            continue
        reason = gpu_kernel_reason(block, ctx.target)
        if reason is not None:
            unchanged.append(Unchanged(block.fc1.name, IDIOM, reason))
            continue
        rewrites.append(rewrite(graph, block, IDIOM))
    return rewrites, unchanged
