"""Reading the router upstream of an MoE block: which routing idiom produced ``topk_weights`` / ``topk_ids``.

Routing stays in the graph as ATen ops (Inductor fuses it well); matchers only *describe* it, so that the
report says what a kernel choice must respect (a fused-routing kernel, for one, must implement exactly
this idiom). The idioms recognised, as post-grad ATen after Inductor's decompositions (softmax becomes
``amax / sub / exp / sum / div``; an in-place ``/=`` becomes a functional ``div``)::

    # softmax then top-k (Mixtral; Qwen2/3-MoE, OLMoE with norm_topk_prob True or False)
    probs = softmax(x @ W_r.T, dim=-1, dtype=float32)
    w, ids = topk(probs, k);  w /= w.sum(-1, keepdim=True)       # renormalisation, optional

    # top-k then softmax, router bias (GPT-OSS)
    logits = x @ W_r.T + b_r
    top, ids = topk(logits, k);  w = softmax(top, dim=1)

    # sigmoid, score-correction bias, group-limited top-k, renormalised and scaled (DeepSeek-V3, GLM-4-MoE)
    s = sigmoid(x @ W_r.T);  ids = topk(masked(s + e_bias), k)[1]
    w = s.gather(1, ids);  w /= w.sum(-1, keepdim=True) + 1e-20;  w = w * routed_scaling_factor

    # top-k then sigmoid (Llama 4); per-expert scale on the weights (Gemma 4)
    w = sigmoid(topk(logits, k)[0]);   w = w * per_expert_scale[ids]

    # softmax, correction bias, renormalised with a floor (ERNIE-4.5); group mask filling 0 (Mistral 4)
    w = p.gather(1, ids);  w = w / clamp(w.sum(-1, keepdim=True), min=norm_min)
    ids = topk(p.masked_fill(~score_mask, 0.0), k)[1]

    # a skip class after the E experts (ZAYA): picked, it routes to expert 0 with weight 0
    w, ids = w.masked_fill(ids == E, 0), ids.masked_fill(ids == E, 0)

The scale may be a run-time value: under ``dynamic=True`` Dynamo makes a float attribute (DeepSeek-V3's
``routed_scaling_factor``) a 0-d tensor input of the graph; the description then names that input. A top-k
whose selection reads a router but whose weights are in no form above is described as not recognised, with
what was read of its selection.

The router is walked by hand: the idiom is a chain of optional steps (bias, correction bias, group mask,
renormalisation, scale) that we *read* rather than rewrite, and the reading must say which steps were
present, which a pattern that either matches whole or fails cannot tell. Softmax itself, which Inductor
decomposes, is recognised with Inductor's pattern matcher from a traced ``torch.softmax``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Optional

import torch

from rubin_compile.passes.fx import (
    RESHAPES,
    dtype_name,
    getitem_of,
    is_call,
    same_shape,
    scalar,
    strip_converts,
    tensor_val,
)

aten = torch.ops.aten


@functools.lru_cache(maxsize=None)
def _softmax_patterns() -> tuple:
    """A decomposed softmax, in both forms a post-grad graph holds: Inductor's decomposition (amax / sub / exp /
    sum / div), and on CUDA (rubin runs after Inductor's own post-grad patterns) the online form those patterns
    make of it, ``prepare_softmax_online`` giving the max and the sum in one pass
    (torch/_inductor/fx_passes/post_grad.py: ``prepare_softmax_replacement``, when ``config.online_softmax``)."""
    from torch._inductor import inductor_prims
    from torch._inductor.pattern_matcher import fwd_only, gen_pattern

    def softmax(x):
        return torch.softmax(x, dim=-1)

    def online_softmax(x):
        xmax, xsum = inductor_prims.prepare_softmax_online(x, -1)
        return (x - xmax).exp() / xsum

    # Integer and list arguments are ignored by generated patterns, so these match a softmax over any
    # dim (GPT-OSS writes dim=1 for its [T, k] top-k values); a router's softmax is over its last dim.
    return tuple(gen_pattern(fn, [torch.empty(4, 8)], fwd_only) for fn in (softmax, online_softmax))


def softmax_input(node: Any) -> Optional[torch.fx.Node]:
    """If ``node`` is a (decomposed) softmax, its input (under dtype conversions); else None."""
    from torch._inductor.pattern_matcher import Match

    node = strip_converts(node)
    if not isinstance(node, torch.fx.Node):
        return None
    if is_call(node, aten._softmax.default):
        return strip_converts(node.args[0])
    for pattern in _softmax_patterns():
        m = pattern.match(node)
        if isinstance(m, Match):
            return strip_converts(m.kwargs["x"])
    return None


def _is_renorm(node: torch.fx.Node) -> tuple[Optional[torch.fx.Node], Optional[str]]:
    """``w / w.sum(-1, keepdim=True)``, the sum optionally ``+ eps`` (DeepSeek-V3) or floored by
    ``clamp(min=eps)`` (ERNIE-4.5): ``(w, how eps enters or None)``; ``(None, None)`` otherwise."""
    if not is_call(node, aten.div.Tensor):
        return None, None
    num, den = node.args[0], node.args[1]
    eps = None
    if is_call(den, aten.add.Tensor) and scalar(den.args[1]) is not None:
        den, eps = den.args[0], f"sum + {scalar(den.args[1]):g}"
    elif is_call(den, aten.clamp_min.default) and scalar(den.args[1]) is not None:
        den, eps = den.args[0], f"max(sum, {scalar(den.args[1]):g})"
    if is_call(den, aten.sum.dim_IntList) and den.args[0] is num and list(den.args[1]) in ([-1], [1]):
        return num, eps
    return None, None


def _fill_value(node: Any) -> Optional[float]:
    """The value a decomposed ``masked_fill(mask, value)`` fills with: a number, ``aten.full([], value)`` (CPU
    graphs) or ``aten.scalar_tensor(value)`` (CUDA / meta graphs); else None."""
    if scalar(node) is not None:
        return scalar(node)
    if is_call(node, aten.full.default) and list(node.args[0]) == []:
        return scalar(node.args[1])
    if is_call(node, aten.scalar_tensor.default):
        return scalar(node.args[0])
    return None


def _is_zero(node: Any) -> bool:
    return _fill_value(node) == 0


def _graph_input(node: Any) -> Optional[str]:
    """The name of a 0-d tensor input of the graph (under dtype conversions): a run-time scalar."""
    node = strip_converts(node)
    val = tensor_val(node) if isinstance(node, torch.fx.Node) else None
    if isinstance(node, torch.fx.Node) and node.op == "placeholder" and val is not None and val.dim() == 0:
        return node.name
    return None


def _skip_mask(node: Any, ids: torch.fx.Node) -> tuple[Any, Optional[int]]:
    """``where(ids == S, 0, x)`` (``x.masked_fill(ids == S, 0)``): ``(x, S)``; else ``(node, None)``."""
    if is_call(node, aten.where.self) and len(node.args) == 3:
        cond, fill, x = node.args
        if is_call(cond, aten.eq.Scalar) and cond.args[0] is ids and isinstance(cond.args[1], int) and _is_zero(fill):
            return x, cond.args[1]
    return node, None


def _same_shape_views(node: Any) -> Any:
    """``node`` under reshapes that keep its shape (Longcat-Flash's ``scores.view(-1, E)`` of [T, E] scores)."""
    while is_call(node, *RESHAPES):
        a, b = tensor_val(node), tensor_val(node.args[0])
        if a is None or b is None or not same_shape(a, b):
            break
        node = node.args[0]
    return node


def _under_reshapes(node: Any) -> Any:
    while is_call(node, *RESHAPES):
        node = node.args[0]
    return node


def _selected_ids(topk_ids: Any) -> tuple[Any, Optional[int]]:
    """The ``aten.topk`` indices behind the ids an experts block reads, under reshapes ([B, S, k] -> [T, k]) and a
    skip-class mask (ZAYA): ``(indices, skip class or None)``."""
    node = _under_reshapes(topk_ids)
    if is_call(node, aten.where.self) and len(node.args) == 3:
        inner = node.args[2]
        x, skip = _skip_mask(node, inner)
        if skip is not None and getitem_of(inner, 1, aten.topk.default) is not None:
            return x, skip
    return node, None


@functools.lru_cache(maxsize=None)
def _decomposed_linear_patterns() -> tuple:
    """Inductor's CPU decompositions of a router's projection at one token (torch/_inductor/decomposition.py,
    ``addmm`` / ``mm``), as (pattern, has a bias) pairs::

        addmm(b, x, W), T = 1, H <= 16 and E <= 16:  (x.T * W).sum(0, keepdim=True) * alpha + b * beta
        addmm(b, x, W) or mm(x, W), T = 1, E = 1:    sum(x.squeeze(0) * W.squeeze(-1), 0, keepdim=True).unsqueeze(0)
                                                     [* alpha + b * beta]

    traced from ``addmm`` / ``mm`` through Inductor's decompositions at shapes that take those branches, so they
    follow the installed torch; each also after Inductor's own no-op removal (``joint_graph.remove_no_ops``), which
    drops the ``* 1`` in some pipelines (torch 2.15's) and not in others (2.13's inference graphs). Unlike the generated
    patterns elsewhere, integer and list arguments are kept: the permutation, squeeze and reduction dims are what make
    the ``mul`` / ``sum`` a matrix product, and alpha / beta must be 1. A bf16 / fp16 projection has dtype
    conversions on its inputs and output only (``pw_cast_for_opmath``): the pattern's inputs take them in, and
    ``strip_converts`` removes the output's."""
    from torch._inductor.fx_passes.joint_graph import remove_no_ops
    from torch._inductor.pattern_matcher import fwd_only, fx_to_pattern
    from torch.utils._ordered_set import OrderedSet

    def addmm(b, x, w):
        return torch.addmm(b, x, w)

    def mm(x, w):
        return torch.mm(x, w)

    traced = [
        (addmm, [torch.randn(2), torch.randn(1, 8), torch.randn(8, 2)], True),  # H, E <= 16
        (addmm, [torch.randn(1), torch.randn(1, 8), torch.randn(8, 1)], True),  # E = 1
        (mm, [torch.randn(1, 8), torch.randn(8, 1)], False),  # E = 1
    ]
    patterns: dict[str, tuple] = {}
    for fn, args, bias in traced:
        for no_ops_removed in (False, True):
            gm = fwd_only(fn, args)
            if no_ops_removed:
                remove_no_ops(gm, OrderedSet(), OrderedSet())
            pattern = fx_to_pattern(gm, (torch.device, torch.dtype), list(inspect.signature(fn).parameters))
            patterns.setdefault(str(pattern), (pattern, bias))
    return tuple(patterns.values())


def _decomposed_linear(node: Any) -> Optional[bool]:
    """If ``node`` is a router projection ``x @ W [+ b]`` at one token as Inductor decomposes it on the CPU
    (see ``_decomposed_linear_patterns``), whether it has a bias; else None."""
    from torch._inductor.pattern_matcher import Match

    for pattern, bias in _decomposed_linear_patterns():
        m = pattern.match(node)
        if not isinstance(m, Match):
            continue
        x, w, out = (
            tensor_val(strip_converts(m.kwargs["x"])),
            tensor_val(strip_converts(m.kwargs["w"])),
            tensor_val(node),
        )
        # [1, H] @ [H, E] -> [1, E]: the shapes for which the decomposition's mul / sum is the product
        if x is not None and w is not None and out is not None and x.dim() == w.dim() == out.dim() == 2:
            if x.shape[0] == 1 and x.shape[1] == w.shape[0] and tuple(out.shape) == (1, w.shape[1]):
                return bias
    return None


def _is_product(node: Any) -> bool:
    """``x @ W`` without a bias: an mm, or Inductor's one-token decomposition of one."""
    node = strip_converts(node)
    return is_call(node, aten.mm.default) or _decomposed_linear(node) is False


def _router_logits(node: Any, info: dict[str, Any]) -> Any:
    """Describe the router projection that produced ``node`` (the logits), under reshapes: a [B, S, E] router (ZAYA),
    or logits regrouped before the top-k (Doge's two halves of product keys), are still a linear projection's.
    Returns the projection's node."""
    node = strip_converts(_under_reshapes(strip_converts(node)))
    decomposed = _decomposed_linear(node) if isinstance(node, torch.fx.Node) else None
    if is_call(node, aten.addmm.default):
        info["router"], info["router_bias"] = "linear", True
    elif decomposed is not None:  # a one-token addmm / mm on the CPU, as Inductor rewrote it
        info["router"], info["router_bias"] = "linear", decomposed
    elif is_call(node, aten.add.Tensor) and any(_is_product(a) for a in node.args):
        info["router"], info["router_bias"] = "linear", True
    elif is_call(node, aten.mm.default):
        info["router"] = "linear"
    else:
        info["router"] = f"unrecognised ({getattr(node, 'name', node)})"
    return node


def group_choice(mask: Any, num_experts: Any) -> Optional[torch.fx.Node]:
    """The top-k over [T, n_group] group scores a group mask is made from (DeepSeek-V3's ``group_idx =
    topk(group_scores, topk_group)``: n_group divides E), found among the mask's inputs; None when there is none."""
    todo, seen = [mask], set()
    while todo and len(seen) < 64:
        n = todo.pop()
        if not isinstance(n, torch.fx.Node) or n in seen:
            continue
        seen.add(n)
        if is_call(n, aten.topk.default):
            val = tensor_val(n.args[0])
            groups = val.shape[1] if val is not None and val.dim() == 2 else None
            # one group (GLM-4-MoE's n_group = 1: a mask of ones) up to fewer groups than experts
            if isinstance(groups, int) and isinstance(num_experts, int) and 1 <= groups < num_experts:
                if num_experts % groups == 0:
                    return n
        todo.extend(n.all_input_nodes)
    return None


def _scores_or_biased(node: Any) -> bool:
    """A softmax / sigmoid of the logits, or one plus a correction bias."""

    def scored(n: Any) -> bool:
        n = strip_converts(_same_shape_views(strip_converts(n)))
        return softmax_input(n) is not None or is_call(n, aten.sigmoid.default)

    node = strip_converts(_same_shape_views(strip_converts(node)))
    return scored(node) or (is_call(node, aten.add.Tensor) and sum(scored(a) for a in node.args) == 1)


def read_selection(topk: torch.fx.Node) -> tuple[dict[str, Any], Any]:
    """What an ``aten.topk`` (or ``aten.argmax`` / ``aten.max.dim``, a top-1) selects from, and the router projection's node: the keys
    of ``describe_routing`` that the selection decides (the scoring: softmax, sigmoid or none; the router projection
    and its bias; a score-correction bias; a group mask). ``router`` is "linear" when the scores come from a linear
    projection, which is what makes a top-k a router's."""
    info, _, projection = _read_selection(topk)
    return info, projection


def _read_selection(topk: torch.fx.Node, found: Optional[dict[str, Any]] = None) -> tuple[dict[str, Any], Any, Any]:
    """``read_selection``'s description, the scores the top-k reads under its correction bias and group mask, and the
    router projection. ``found``, when given, receives the nodes read: ``group_mask`` (the mask's condition),
    ``correction_bias`` (the tensor added to the scores)."""
    found = {} if found is None else found
    top1 = is_call(topk, aten.argmax.default, aten.max.dim)
    k = 1 if top1 else topk.args[1] if len(topk.args) > 1 else topk.kwargs.get("k")
    info: dict[str, Any] = {
        "scoring": None,
        "router": None,
        "router_bias": False,
        "score_correction_bias": False,
        "group_limited": False,
        "top_k": k,
        "num_experts": None,
    }
    selected = topk.args[0]
    sval = selected.meta.get("val")
    if isinstance(sval, torch.Tensor) and isinstance(sval.shape[-1], int):
        info["num_experts"] = sval.shape[-1]

    # What top-k selects from: [group mask] -> [score-correction bias] -> softmax / sigmoid / raw logits.
    sel = strip_converts(_same_shape_views(strip_converts(selected)))
    if is_call(sel, aten.where.self) and _fill_value(sel.args[1]) is not None:
        fill, kept = _fill_value(sel.args[1]), strip_converts(sel.args[2])
        # masked_fill(~group_mask, -inf) (DeepSeek-V3), as Inductor writes it; or masked_fill(~group_mask, 0.0)
        # straight over softmax probabilities (Mistral 4) or over sigmoid scores plus their correction bias
        # (DeepSeek-V3 / GLM-4-MoE in transformers before 5.17): a group limit there too, whose dropped experts
        # compete with 0.0 (group_fill "0")
        choice = group_choice(sel.args[0], info["num_experts"])
        if fill == float("-inf") or (
            fill == 0 and (softmax_input(kept) is not None or (choice is not None and _scores_or_biased(kept)))
        ):
            info["group_limited"], info["group_fill"] = True, "-inf" if fill == float("-inf") else "0"
            found["group_mask"], found["group_choice"] = sel.args[0], choice
            sel = kept
    found["selected"] = sel  # what the top-k selects from under the group mask: the scores (+ correction bias)
    if is_call(sel, aten.add.Tensor):
        under = [strip_converts(_same_shape_views(strip_converts(a))) for a in sel.args]
        scored = [a for a in under if is_call(a, aten.sigmoid.default) or softmax_input(a) is not None]
        if len(scored) == 1:
            info["score_correction_bias"] = True  # scores + e_score_correction_bias (selection only)
            found["correction_bias"] = next(a for a, u in zip(sel.args, under) if u is not scored[0])
            sel = scored[0]
    if softmax_input(sel) is not None:
        info["scoring"] = "softmax"
        projection = _router_logits(softmax_input(sel), info)
    elif is_call(sel, aten.sigmoid.default):
        info["scoring"] = "sigmoid"
        projection = _router_logits(sel.args[0], info)
    else:
        info["scoring"] = "none"
        projection = _router_logits(sel, info)
    return info, sel, projection


def describe_routing(
    topk_weights: torch.fx.Node, topk_ids: torch.fx.Node, found: Optional[dict[str, Any]] = None
) -> dict[str, Any]:
    """Describe the routing idiom upstream of an MoE block's ``topk_weights`` [T, k] and ``topk_ids`` [T, k].

    Parameters
    ----------
    topk_weights, topk_ids:
        The graph nodes the experts block reads as its routing weights and expert ids.

    Returns
    -------
    dict
        JSON-able. ``recognised`` (bool); ``order`` ("softmax_then_topk", "topk_then_softmax",
        "sigmoid_then_topk", "topk_then_sigmoid", "topk_of_logits" or "unknown"); ``scoring``
        ("softmax", "sigmoid", "none"); ``renormalize`` (and ``renormalize_eps``, how an epsilon enters the sum, when
        one does); ``router`` ("linear" or a note); ``router_bias``; ``score_correction_bias``; ``group_limited``
        (and ``group_fill``, what the mask fills with: "-inf" or "0"); ``scale`` (a constant factor, "graph input
        <name>" for a run-time one, or None); ``per_expert_scale``; ``skip_expert`` (the id of a skip class that
        routes with weight 0, or None); ``top_k``; ``num_experts`` (what the top-k chooses among, a skip class
        included); ``weights_dtype``; and ``why`` when not recognised.

    ``found``, when given, receives the nodes the description was read from (passes/match_routing.py rewrites
    from them): ``topk`` (the choice), ``ids`` (its indices), ``projection`` (the router's mm / addmm / add),
    ``scores`` (the scores under the correction bias and group mask), ``selected`` (under the group mask only),
    ``group_mask``, ``correction_bias``,
    ``scale_input`` (a run-time scale's graph input), ``renorm_eps`` (a number).

    Examples
    --------
    Mixtral gives ``{"order": "softmax_then_topk", "renormalize": True, "router_bias": False, ...}``.
    """
    found = {} if found is None else found
    info: dict[str, Any] = {
        "recognised": False,
        "order": "unknown",
        "scoring": None,
        "renormalize": False,
        "router": None,
        "router_bias": False,
        "score_correction_bias": False,
        "group_limited": False,
        "scale": None,
        "per_expert_scale": False,
        "top_k": None,
        "num_experts": None,
        "weights_dtype": None,
    }
    wval = tensor_val(topk_weights)
    if wval is not None:
        info["weights_dtype"] = dtype_name(wval.dtype)
    ids, skip = _selected_ids(topk_ids)
    topk = getitem_of(ids, 1, aten.topk.default)
    if topk is None:
        info["why"] = f"topk_ids ({getattr(topk_ids, 'name', topk_ids)}) is not the indices output of aten.topk"
        return info
    selection, scores, projection = _read_selection(topk, found)
    found.update(topk=topk, ids=ids, projection=projection, scores=scores)
    info.update(selection)
    if skip is not None:
        info["skip_expert"] = skip

    # The weights: peel reshapes, the skip mask, scale, per-expert scale and renormalisation (outermost first),
    # then see where the values come from.
    w = strip_converts(_under_reshapes(topk_weights))
    if skip is not None:
        w, weights_skip = _skip_mask(w, ids)
        if weights_skip != skip:
            info["why"] = f"the ids of skip class {skip} are sent to expert 0 without their weights set to 0"
            return info
        w = strip_converts(w)
    for _ in range(8):
        if is_call(w, aten.mul.Tensor):
            a, b = w.args[0], w.args[1]
            if scalar(b) is not None or scalar(a) is not None:
                info["scale"] = scalar(b) if scalar(b) is not None else scalar(a)
                w = strip_converts(a if scalar(b) is not None else b)
                continue
            runtime = [x for x in (a, b) if _graph_input(x) is not None]
            if len(runtime) == 1:  # dynamic=True: the float attribute is a 0-d input of the graph
                info["scale"] = f"graph input {_graph_input(runtime[0])}"
                found["scale_input"] = strip_converts(runtime[0])
                w = strip_converts(b if runtime[0] is a else a)
                continue
            per_expert = [x for x in (a, b) if is_call(x, aten.index.Tensor) and list(x.args[1]) in ([topk_ids], [ids])]
            if len(per_expert) == 1:
                info["per_expert_scale"] = True
                w = strip_converts(b if per_expert[0] is a else a)
                continue
        if softmax_input(w) is not None:  # a decomposed softmax is also exp / exp.sum(): not a renorm
            break
        base, eps = _is_renorm(w) if isinstance(w, torch.fx.Node) else (None, None)
        if base is not None:
            info["renormalize"] = True
            if eps is not None:
                info["renormalize_eps"] = eps
                found["renorm_eps"] = scalar(w.args[1].args[1])
            w = strip_converts(base)
            continue
        break

    values_of_topk = getitem_of(w, 0, aten.topk.default) is topk
    if values_of_topk and info["scoring"] in ("softmax", "sigmoid"):
        info["order"] = f"{info['scoring']}_then_topk"
    elif values_of_topk:
        info["order"] = "topk_of_logits"
    elif is_call(w, aten.gather.default) and w.args[2] is ids and strip_converts(w.args[0]) is scores:
        info["order"] = f"{info['scoring']}_then_topk"  # weights gathered from the unbiased scores
    elif info["scoring"] == "none" and getitem_of(softmax_input(w), 0, aten.topk.default) is topk:
        info["order"] = "topk_then_softmax"
    elif (
        info["scoring"] == "none"
        and is_call(w, aten.sigmoid.default)
        and getitem_of(strip_converts(w.args[0]), 0, aten.topk.default) is topk
    ):
        info["order"] = "topk_then_sigmoid"
    else:
        info["why"] = (  # read under any scale, per-expert scale and renormalisation (peeled above)
            f"the routing weights ({getattr(w, 'name', w)}) are no form read from the top-k (its values, their "
            "softmax / sigmoid, the scores gathered at its indices)"
        )
        return info
    info["recognised"] = True
    return info
