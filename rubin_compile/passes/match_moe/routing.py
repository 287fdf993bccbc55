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

The router is walked by hand: the idiom is a chain of optional steps (bias, correction bias, group mask,
renormalisation, scale) that we *read* rather than rewrite, and the reading must say which steps were
present, which a pattern that either matches whole or fails cannot tell. Softmax itself, which Inductor
decomposes, is recognised with Inductor's pattern matcher from a traced ``torch.softmax``.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from rubin_compile.passes.fx import dtype_name, getitem_of, is_call, scalar, strip_converts, tensor_val

aten = torch.ops.aten


@functools.lru_cache(maxsize=None)
def _softmax_patterns() -> tuple:
    from torch._inductor.pattern_matcher import fwd_only, gen_pattern

    def softmax(x):
        return torch.softmax(x, dim=-1)

    # Integer and list arguments are ignored by generated patterns, so this matches a softmax over any
    # dim (GPT-OSS writes dim=1 for its [T, k] top-k values); a router's softmax is over its last dim.
    return (gen_pattern(softmax, [torch.empty(4, 8)], fwd_only),)


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


def _is_renorm(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """``w / w.sum(-1, keepdim=True)`` (optionally ``+ eps``): return ``w``."""
    if not is_call(node, aten.div.Tensor):
        return None
    num, den = node.args[0], node.args[1]
    if is_call(den, aten.add.Tensor) and scalar(den.args[1]) is not None:
        den = den.args[0]
    if is_call(den, aten.sum.dim_IntList) and den.args[0] is num and list(den.args[1]) in ([-1], [1]):
        return num
    return None


def _router_logits(node: Any, info: dict[str, Any]) -> None:
    """Describe the router projection that produced ``node`` (the logits)."""
    node = strip_converts(node)
    if is_call(node, aten.addmm.default):
        info["router"], info["router_bias"] = "linear", True
    elif is_call(node, aten.add.Tensor) and any(is_call(strip_converts(a), aten.mm.default) for a in node.args):
        info["router"], info["router_bias"] = "linear", True
    elif is_call(node, aten.mm.default):
        info["router"] = "linear"
    else:
        info["router"] = f"unrecognised ({getattr(node, 'name', node)})"


def describe_routing(topk_weights: torch.fx.Node, topk_ids: torch.fx.Node) -> dict[str, Any]:
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
        ("softmax", "sigmoid", "none"); ``renormalize``; ``router`` ("linear" or a note); ``router_bias``;
        ``score_correction_bias``; ``group_limited``; ``scale`` (a constant factor or None);
        ``per_expert_scale``; ``top_k``; ``num_experts``; ``weights_dtype``; and ``why`` when not recognised.

    Examples
    --------
    Mixtral gives ``{"order": "softmax_then_topk", "renormalize": True, "router_bias": False, ...}``.
    """
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
    topk = getitem_of(topk_ids, 1, aten.topk.default)
    if topk is None:
        info["why"] = f"topk_ids ({getattr(topk_ids, 'name', topk_ids)}) is not the indices output of aten.topk"
        return info
    k = topk.args[1] if len(topk.args) > 1 else topk.kwargs.get("k")
    info["top_k"] = k
    selected = topk.args[0]
    sval = selected.meta.get("val")
    if isinstance(sval, torch.Tensor) and isinstance(sval.shape[-1], int):
        info["num_experts"] = sval.shape[-1]

    # What top-k selects from: [group mask] -> [score-correction bias] -> softmax / sigmoid / raw logits.
    sel = strip_converts(selected)
    masked = is_call(sel, aten.where.self) and is_call(sel.args[1], aten.full.default)
    if masked and sel.args[1].args[1] == float("-inf"):
        info["group_limited"] = True  # masked_fill(~group_mask, -inf), as Inductor writes it
        sel = strip_converts(sel.args[2])
    if is_call(sel, aten.add.Tensor):
        scored = [
            a for a in sel.args if is_call(strip_converts(a), aten.sigmoid.default) or softmax_input(a) is not None
        ]
        if len(scored) == 1:
            info["score_correction_bias"] = True  # scores + e_score_correction_bias (selection only)
            sel = strip_converts(scored[0])
    scores = sel
    if softmax_input(sel) is not None:
        info["scoring"] = "softmax"
        _router_logits(softmax_input(sel), info)
    elif is_call(sel, aten.sigmoid.default):
        info["scoring"] = "sigmoid"
        _router_logits(sel.args[0], info)
    else:
        info["scoring"] = "none"
        _router_logits(sel, info)

    # The weights: peel scale, per-expert scale and renormalisation (outermost first), then see where the
    # values come from.
    w = strip_converts(topk_weights)
    for _ in range(8):
        if is_call(w, aten.mul.Tensor):
            a, b = w.args[0], w.args[1]
            if scalar(b) is not None or scalar(a) is not None:
                info["scale"] = scalar(b) if scalar(b) is not None else scalar(a)
                w = strip_converts(a if scalar(b) is not None else b)
                continue
            per_expert = [x for x in (a, b) if is_call(x, aten.index.Tensor) and list(x.args[1]) == [topk_ids]]
            if len(per_expert) == 1:
                info["per_expert_scale"] = True
                w = strip_converts(b if per_expert[0] is a else a)
                continue
        if softmax_input(w) is not None:  # a decomposed softmax is also exp / exp.sum(): not a renorm
            break
        base = _is_renorm(w) if isinstance(w, torch.fx.Node) else None
        if base is not None:
            info["renormalize"] = True
            w = strip_converts(base)
            continue
        break

    values_of_topk = getitem_of(w, 0, aten.topk.default) is topk
    if values_of_topk and info["scoring"] in ("softmax", "sigmoid"):
        info["order"] = f"{info['scoring']}_then_topk"
    elif values_of_topk:
        info["order"] = "topk_of_logits"
    elif is_call(w, aten.gather.default) and w.args[2] is topk_ids and strip_converts(w.args[0]) is scores:
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
        info["why"] = f"the routing weights ({getattr(w, 'name', w)}) are not derived from the same top-k"
        return info
    info["recognised"] = True
    return info
