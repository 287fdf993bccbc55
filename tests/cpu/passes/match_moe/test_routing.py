"""routing.py: the routing descriptions of the routers the other matcher tests do not cover, each stated in plain
PyTorch as the transformers family that writes it does (the families themselves, compiled from their tiny
configurations, are in test_match_moe.py); the router projection as Inductor decomposes it at one token; and near
misses that must not be read as what they resemble.

The graphs are traced with Inductor's own decompositions (``fwd_only``), as the matchers see them post-grad.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.pattern_matcher import fwd_only

from rubin_compile.passes.match_moe.routing import describe_routing

H, E, K = 32, 8, 2
aten = torch.ops.aten


def _describe(router, *args) -> dict:
    """describe_routing on the traced router's (weights, ids) outputs."""
    gm = fwd_only(router, list(args))
    weights, ids = gm.graph.output_node().args[0][:2]
    return describe_routing(weights, ids)


def _subset(info: dict, want: dict) -> dict:
    return {key: info.get(key) for key in want}


# --- routers stated in plain PyTorch --------------------------------------------------------------------------------


NORM_MIN, SCALE = 1e-12, 1.5


def ernie_router(x, w_r, corr):
    """ERNIE-4.5 (Ernie4_5_MoeTopKRouter): the correction bias for the choice, the weights renormalised with a floor."""
    probs = F.softmax(F.linear(x, w_r), dim=1, dtype=torch.float)
    ids = torch.topk(probs + corr, K, dim=-1)[1]
    w = torch.gather(probs, dim=-1, index=ids)
    return w / torch.clamp(w.sum(dim=-1, keepdim=True), min=NORM_MIN), ids


def _zero_fill_groups(sel, n_group: int, topk_group: int):
    """The group limit as transformers writes it for Mistral 4 and (before 5.17) DeepSeek-V3: each group scored by
    its two best values, the ``topk_group`` best kept, the others' experts filled with 0.0."""
    group_scores = sel.view(-1, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, E // n_group).reshape(-1, E)
    return sel.masked_fill(~score_mask.bool(), 0.0)


def mistral4_router(x, w_r):
    """Mistral 4 (Mistral4TopkRouter): softmax scores, a group mask filling 0.0, renormalised (+ 1e-20), scaled."""
    scores = F.linear(x, w_r).softmax(-1)
    ids = torch.topk(_zero_fill_groups(scores, n_group=2, topk_group=1), k=K, dim=-1, sorted=False)[1]
    w = scores.gather(1, ids)
    return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * SCALE, ids


def deepseek_zero_fill_router(x, w_r, corr):
    """DeepSeek-V3 / GLM-4-MoE as transformers wrote them before 5.17: the dropped groups filled with 0.0 over the
    sigmoid scores plus their correction bias (which may be negative: the 0.0 then competes)."""
    scores = torch.sigmoid(F.linear(x, w_r))
    ids = torch.topk(_zero_fill_groups(scores + corr, n_group=2, topk_group=1), k=K, dim=-1, sorted=False)[1]
    w = scores.gather(1, ids)
    return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * SCALE, ids


def zaya_router(x, w_r, bias):
    """ZAYA (ZayaRouter): a [B, S, E + 1] softmax with a skip class last; the skip class routes with weight 0."""
    probs = torch.softmax(x @ w_r.t(), dim=-1)
    ids = torch.topk(probs + bias, K, dim=-1)[1]
    w = torch.gather(probs, dim=2, index=ids)
    skip = ids == w_r.shape[0] - 1
    return w.masked_fill(skip, 0).reshape(-1, K), ids.masked_fill(skip, 0).reshape(-1, K)


def longcat_router(x, w_r, corr):
    """Longcat-Flash (LongcatFlashTopkRouter): softmax, a correction bias through a same-shape view, the top-k's
    values unused (the weights are gathered), scaled."""
    scores = F.linear(x, w_r).softmax(dim=-1)
    ids = torch.topk(scores.view(-1, w_r.shape[0]) + corr.unsqueeze(0), k=K, dim=-1, sorted=False)[1]
    return scores.gather(1, ids) * SCALE, ids


def deepseek_runtime_scale(x, w_r, corr, scale):
    """DeepSeek-V3's weights times a routed scaling factor that is a 0-d tensor input (Dynamo's dynamic=True)."""
    scores = torch.sigmoid(x @ w_r.t())
    ids = torch.topk(scores + corr, K, dim=-1, sorted=False)[1]
    w = scores.gather(1, ids)
    return w / (w.sum(-1, keepdim=True) + 1e-20) * scale.to(torch.float32), ids


def test_ernie_renormalised_with_a_floor():
    info = _describe(ernie_router, torch.randn(5, H), torch.randn(E, H), torch.randn(E))
    want = dict(order="softmax_then_topk", score_correction_bias=True, renormalize=True, top_k=K, num_experts=E)
    assert info["recognised"] and _subset(info, want) == want, info
    assert info["renormalize_eps"] == f"max(sum, {NORM_MIN:g})", info


def test_deepseek_group_mask_filling_zero_over_biased_sigmoid_scores():
    info = _describe(deepseek_zero_fill_router, torch.randn(5, H), torch.randn(E, H), torch.randn(E))
    want = dict(order="sigmoid_then_topk", group_limited=True, group_fill="0", score_correction_bias=True, scale=SCALE)
    assert info["recognised"] and _subset(info, want) == want, info


def _online_softmax(x):
    """Softmax as Inductor's post-grad patterns rewrite it on CUDA (``prepare_softmax_replacement``), which is what
    rubin's pass reads there: one pass for the max and the sum."""
    from torch._inductor import inductor_prims

    xmax, xsum = inductor_prims.prepare_softmax_online(x, -1)
    return (x - xmax).exp() / xsum


def test_online_softmax_routers_as_a_cuda_graph_holds_them():
    def qwen3(x, w_r):
        top, ids = torch.topk(_online_softmax(F.linear(x, w_r).float()), K, dim=-1)
        return top / top.sum(-1, keepdim=True), ids

    def gpt_oss(x, w_r, b):
        top, ids = torch.topk(F.linear(x, w_r, b), K, dim=-1)
        return _online_softmax(top), ids

    info = _describe(qwen3, torch.randn(5, H), torch.randn(E, H))
    want = dict(order="softmax_then_topk", scoring="softmax", renormalize=True, router="linear")
    assert info["recognised"] and _subset(info, want) == want, info
    info = _describe(gpt_oss, torch.randn(5, H), torch.randn(E, H), torch.randn(E))
    want = dict(order="topk_then_softmax", router="linear", router_bias=True)
    assert info["recognised"] and _subset(info, want) == want, info


def test_mistral4_group_mask_filling_zero():
    info = _describe(mistral4_router, torch.randn(5, H), torch.randn(E, H))
    want = dict(order="softmax_then_topk", group_limited=True, group_fill="0", renormalize=True, scale=SCALE)
    assert info["recognised"] and _subset(info, want) == want, info
    assert info["renormalize_eps"] == f"sum + {1e-20:g}" and not info["score_correction_bias"], info


def test_zaya_skip_class():
    info = _describe(zaya_router, torch.randn(2, 4, H), torch.randn(E + 1, H), torch.randn(E + 1))
    want = dict(order="softmax_then_topk", score_correction_bias=True, skip_expert=E, num_experts=E + 1, top_k=K)
    assert info["recognised"] and _subset(info, want) == want, info


def test_longcat_weights_gathered_values_unused():
    info = _describe(longcat_router, torch.randn(5, H), torch.randn(E + 2, H), torch.randn(E + 2))
    want = dict(order="softmax_then_topk", score_correction_bias=True, scale=SCALE, renormalize=False)
    assert info["recognised"] and _subset(info, want) == want, info


def test_runtime_scale_named_as_a_graph_input():
    info = _describe(
        deepseek_runtime_scale,
        torch.randn(5, H),
        torch.randn(E, H),
        torch.randn(E),
        torch.tensor(2.5, dtype=torch.float64),
    )
    want = dict(order="sigmoid_then_topk", score_correction_bias=True, renormalize=True)
    assert info["recognised"] and _subset(info, want) == want, info
    assert info["scale"].startswith("graph input scale"), info


# --- near misses ----------------------------------------------------------------------------------------------------


def zero_fill_over_biased_sigmoid(x, w_r, corr):
    """A mask filling 0.0 over sigmoid scores plus a bias, which can be below 0: no group limit that we know."""
    scores = torch.sigmoid(x @ w_r.t())
    keep = torch.arange(E) < E // 2
    ids = torch.topk((scores + corr).masked_fill(~keep, 0.0), K, dim=-1)[1]
    return scores.gather(1, ids), ids


def skip_ids_without_weights(x, w_r, bias):
    """The skip class sent to expert 0 with its weight kept: not ZAYA's idiom (expert 0 would get the weight)."""
    w, ids = zaya_router(x, w_r, bias)
    probs = torch.softmax(x @ w_r.t(), dim=-1)
    raw = torch.topk(probs + bias, K, dim=-1)[1]
    return torch.gather(probs, dim=2, index=raw).reshape(-1, K), ids


def test_zero_fill_over_other_scores_is_no_group_mask():
    info = _describe(zero_fill_over_biased_sigmoid, torch.randn(5, H), torch.randn(E, H), torch.randn(E))
    assert not info["group_limited"] and not info["recognised"], info


def test_skip_class_without_its_weights_zeroed_not_recognised():
    info = _describe(skip_ids_without_weights, torch.randn(2, 4, H), torch.randn(E + 1, H), torch.randn(E + 1))
    assert not info["recognised"] and "skip class" in info["why"], info


# --- the router projection at one token, as Inductor decomposes it on the CPU ---------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "hidden, experts, bias",
    [(8, 2, True), (16, 16, True), (8, 1, True), (8, 1, False), (64, 1, False), (64, 32, True), (8, 2, False)],
)
def test_router_projection_read_at_one_token(hidden, experts, bias, dtype):
    """addmm with H, E <= 16 becomes mul / sum / add, and addmm or mm with E = 1 a dot product (decomposition.py);
    the others stay mm / addmm. All of them are the linear router they are, with or without the bias."""

    def router(x, w_r, b_r):
        top, ids = torch.topk(F.linear(x, w_r, b_r if bias else None), 1, dim=-1)
        return torch.softmax(top.float(), dim=-1), ids

    args = [torch.randn(1, hidden), torch.randn(experts, hidden), torch.randn(experts)]
    gm = fwd_only(router, [a.to(dtype) for a in args])
    info = describe_routing(*gm.graph.output_node().args[0])
    assert (info["router"], info["router_bias"]) == ("linear", bias), (info, gm.code)
    assert info["recognised"] and info["num_experts"] == experts, info


def test_decomposition_look_alike_over_two_tokens_is_no_projection():
    """``(x.T * W).sum(0, keepdim=True) + b`` is the decomposed addmm only for one token; over two it sums products
    of the same column of x.T and W, no matrix product: the router stays unrecognised."""

    def look_alike(x, w, b):
        top, ids = torch.topk((x.t() * w).sum(0, keepdim=True) * 1 + b * 1, 1, dim=-1)
        return top, ids

    def look_alike_plain(x, w, b):
        top, ids = torch.topk((x.t() * w).sum(0, keepdim=True) + b, 1, dim=-1)
        return top, ids

    for fn in (look_alike, look_alike_plain):
        gm = fwd_only(fn, [torch.randn(2, 8), torch.randn(8, 2), torch.randn(2)])
        info = describe_routing(*gm.graph.output_node().args[0])
        assert info["router"].startswith("unrecognised"), (info, gm.code)
