"""ops/route.py: rubin.route's reference against each routing idiom written as its model family writes it in eager
PyTorch (fresh random inputs, ids equal, weights to float32 rounding), the options the idioms need (bf16 logits,
a group fill of 0, a floored renormalisation, the weights' dtype), every argument error, and the op's registration
(``torch.library.opcheck``, the fake on a symbolic T)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rubin_compile.ops  # noqa: F401
from rubin_compile.ops.route import RouteArgs, RouteArgumentError, reference

T, H, E, K = 7, 48, 16, 4


def _data(seed: int = 0, dtype=torch.float32, t: int = T, e: int = E):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, H, generator=g).to(dtype), (torch.randn(e, H, generator=g) / H**0.5).to(dtype)


def _route(x, w, **kw):
    return torch.ops.rubin.route(x, w, kw.pop("top_k", K), **kw)


def _same_set(ids_a: torch.Tensor, ids_b: torch.Tensor) -> None:
    assert torch.equal(ids_a.long().sort(-1).values, ids_b.long().sort(-1).values)


def test_qwen3_and_mixtral_softmax_topk_renormalised_in_bf16_logits():
    """Qwen3-MoE / Mixtral: a bf16 nn.Linear writes bf16 logits, softmax in float32, top-k, renormalised, cast to
    the hidden states' dtype: ``logits_dtype`` and ``weights_dtype`` reproduce it."""
    x, w = _data(1, torch.bfloat16)
    logits = F.linear(x, w)
    probs = F.softmax(logits, dim=1, dtype=torch.float)
    top, ids = torch.topk(probs, K, dim=-1)
    top = (top / top.sum(dim=-1, keepdim=True)).to(torch.bfloat16)
    got_w, got_ids = _route(x, w, renormalize=True, logits_dtype=torch.bfloat16, weights_dtype=torch.bfloat16)
    assert got_w.dtype == torch.bfloat16 and got_ids.dtype == torch.int32
    assert torch.equal(got_ids.long(), ids)  # distinct values here: the order is the descending one, as topk's
    torch.testing.assert_close(got_w, top, rtol=0, atol=0)
    # without the rounding the logits are float32 and the weights differ in the low bits
    w32, _ = _route(x, w, renormalize=True)
    assert w32.dtype == torch.float32


def test_deepseek_v3_grouped_sigmoid_with_correction_bias_and_scale():
    """DeepSeek-V3 (transformers' DeepseekV3TopkRouter / vLLM grouped_topk), float32 router, group fill 0.0 as
    Hugging Face writes it and -inf as vLLM does."""
    x, w = _data(2)
    n_group, topk_group, scale = 4, 2, 2.5
    corr = torch.randn(E) * 0.1
    for fill in ("0", "-inf"):
        scores = (x @ w.t()).sigmoid()
        sfc = scores + corr
        group_scores = sfc.view(-1, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        mask = mask.unsqueeze(-1).expand(-1, n_group, E // n_group).reshape(-1, E)
        sfc = sfc.masked_fill(~mask.bool(), 0.0 if fill == "0" else float("-inf"))
        ids = torch.topk(sfc, k=K, dim=-1, sorted=False)[1]
        wts = scores.gather(1, ids)
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20) * scale
        got_w, got_ids = _route(
            x, w, scoring="sigmoid", renormalize=True, renorm_eps=1e-20, correction_bias=corr, n_group=n_group,
            topk_group=topk_group, group_fill=fill, scale=scale,
        )  # fmt: skip
        _same_set(got_ids, ids)
        order = got_ids.long().argsort(-1)
        torch.testing.assert_close(
            got_w.gather(1, order), wts.gather(1, ids.argsort(-1)), rtol=1e-6, atol=1e-6
        )  # the same (id, weight) pairs


def test_group_fill_zero_differs_from_minus_inf_when_kept_values_are_negative():
    """With negative selection values in the kept groups, the dropped groups' 0.0 outranks them (the Hugging Face
    form), -inf never does (vLLM's): the op reproduces each, including the unbiased score as the weight."""
    x, w = _data(3)
    corr = torch.full((E,), -5.0)  # every selection value below 0
    kw = dict(scoring="sigmoid", correction_bias=corr, n_group=4, topk_group=1)
    w0, ids0 = _route(x, w, group_fill="0", **kw)
    wi, idsi = _route(x, w, group_fill="-inf", **kw)
    kept_group = idsi.long() // (E // 4)
    assert (kept_group == kept_group[:, :1]).all()  # -inf: all k from the one kept group
    assert not torch.equal(ids0, idsi)  # 0.0: dropped experts (value 0 > negative) are chosen
    scores = (x @ w.t()).sigmoid()
    torch.testing.assert_close(w0, scores.gather(1, ids0.long()))  # their weights are their scores, not 0


def test_gpt_oss_topk_then_softmax_with_router_bias():
    x, w = _data(4)
    b = torch.randn(E)
    logits = F.linear(x, w, b)
    top, ids = torch.topk(logits, K, dim=-1)
    got_w, got_ids = _route(x, w, order="topk_then_softmax", router_bias=b)
    assert torch.equal(got_ids.long(), ids)
    torch.testing.assert_close(got_w, F.softmax(top, dim=1))


def test_ernie_floored_renormalisation_and_a_runtime_scale():
    x, w = _data(5)
    probs = F.softmax(x @ w.t(), dim=-1)
    top, ids = torch.topk(probs, K)
    s = torch.tensor(1.75)
    want = top / torch.clamp(top.sum(-1, keepdim=True), min=0.5) * s
    got_w, got_ids = _route(x, w, renormalize=True, renorm_eps=0.5, renorm_floor=True, scale_tensor=s)
    assert torch.equal(got_ids.long(), ids)
    torch.testing.assert_close(got_w, want)


def test_ties_go_to_the_lower_id_in_descending_order():
    x = torch.zeros(3, H)  # every logit 0: every expert ties
    w = torch.randn(E, H)
    _, ids = _route(x, w)
    assert ids.tolist() == [list(range(K))] * 3


def test_t_zero_and_any_t():
    for t in (0, 1, 65, 200):
        x, w = _data(6, t=t)
        wts, ids = _route(x, w)
        assert wts.shape == ids.shape == (t, K)


BAD = {
    "1-D hidden": (dict(hidden_states=torch.randn(H)), "hidden_states must be a 2-D [T, H] tensor"),
    "H mismatch": (dict(router_weight=torch.randn(E, H + 1)), "router_weight must be [E, H]"),
    "int dtype": (dict(hidden_states=torch.zeros(T, H, dtype=torch.int32)), "hidden_states dtype torch.int32"),
    "bias shape": (dict(router_bias=torch.randn(E + 1)), "router_bias must be a [E] = [16] tensor"),
    "scoring": (dict(scoring="relu"), "scoring='relu' is not one of"),
    "order": (dict(order="random"), "order='random' is not one of"),
    "fill": (dict(group_fill="nan"), "group_fill='nan' is not one of"),
    "top_k 0": (dict(top_k=0), "top_k must be a positive int"),
    "top_k > E": (dict(top_k=E + 1), "top_k=17 is larger than the number of experts E=16"),
    "n_group": (dict(n_group=3), "n_group=3 does not divide the number of experts E=16"),
    "topk_group": (dict(n_group=4, topk_group=5), "topk_group=5 must be an int in [1, n_group=4]"),
    "k > kept": (dict(n_group=4, topk_group=1, top_k=5), "top_k=5 is larger than the 4 experts of the 1 groups kept"),
    "topk_then_softmax sigmoid": (dict(order="topk_then_softmax", scoring="sigmoid"), "takes scoring='softmax'"),
    "eps < 0": (dict(renorm_eps=-1.0), "renorm_eps must be a float >= 0"),
    "scale tensor shape": (dict(scale_tensor=torch.ones(1)), "scale_tensor must be a 0-d float tensor"),
    "both scales": (dict(scale=2.0, scale_tensor=torch.tensor(2.0)), "give scale (2.0) or scale_tensor, not both"),
    "logits dtype": (dict(logits_dtype=torch.float64), "logits_dtype=torch.float64 is not one of"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_arguments_name_the_problem(case):
    x, w = _data(7)
    kw, msg = BAD[case]
    kw = dict(dict(hidden_states=x, router_weight=w, top_k=K), **kw)
    with pytest.raises(RouteArgumentError, match=msg.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        RouteArgs(**kw)


def test_opcheck_and_the_fake_on_a_symbolic_t():
    x, w = _data(8)
    corr = torch.randn(E)
    torch.library.opcheck(
        torch.ops.rubin.route.default,
        (x, w, K),
        {"scoring": "sigmoid", "correction_bias": corr, "n_group": 4, "topk_group": 2, "weights_dtype": torch.bfloat16},
    )

    def f(x, w):
        return torch.ops.rubin.route(x, w, K, renormalize=True)

    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="symbolic")(x, w)
    (node,) = [n for n in gm.graph.nodes if n.target is torch.ops.rubin.route.default]
    weights, ids = node.meta["val"]
    assert not isinstance(weights.shape[0], int) and weights.shape[1] == K and ids.dtype == torch.int32


def test_reference_is_the_op():
    x, w = _data(9)
    a = RouteArgs(x, w, K, renormalize=True)
    for got, want in zip(_route(x, w, renormalize=True), reference(a)):
        assert torch.equal(got, want)
