"""The fused decode routing (rubin_compile/kernels/triton/route.py) on a CPU.

- ``route_reference`` against independent formulations: DeepSeek-V3's ``MoEGate`` (noaux_tc), Mixtral's and
  Qwen3-MoE's softmax / top-k / renormalisation and GPT-OSS's top-k / softmax written out as the models write
  them, and a per-token Python selection (sorted by (-value, id)) that pins the tie rule.
- The two kernels under Triton's interpreter (a subprocess: Triton must see TRITON_INTERPRET=1 before it is
  first imported; float32 inputs, as the interpreter's bf16 dots are wrong) against ``route_reference``: ids
  equal, weights within 1e-5, for each routing idiom, non-power-of-two E, H not a multiple of the tile, split
  H and E tiles, T = 1 / 5 / 16 / 64 (both forms of the logits kernel), exact ties of experts and of groups.
- Arguments that are not valid raise ``RouteArgumentError`` (a ValueError) naming the problem.
- Both kernels compiled ahead of time for sm_90 (Triton's own ptxas) at DeepSeek-V3- and Qwen3-like
  configurations: one griddepcontrol.wait each with GDC on, none with it off, the router weight's loads
  issued before the wait."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tests.cpu.kernels.triton_interp import run_file

ROOT = Path(__file__).resolve().parents[3]
MOD = "rubin_compile.kernels.triton.route"

pytest.importorskip("triton", reason="the routing kernels need the triton package")


def _route_module():
    import importlib

    return importlib.import_module(MOD)


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------

QWEN = dict(E=128, k=8, kw=dict(renormalize=True))
DSV3 = dict(
    E=256,
    k=8,
    corr=True,
    kw=dict(scoring="sigmoid", renormalize=True, n_group=8, topk_group=4, routed_scaling_factor=2.5),
)

# name -> T, E, H, k, routing kwargs, and: config (RouteConfig's fields) or None (the heuristic), router / correction
# bias (True, or a shift of all values: negative logits / selection values), a 0-d scale tensor, a tie pattern,
# strided hidden states, given output buffers, the inputs' dtype.
CASES = {
    "qwen-softmax-T1": dict(QWEN, T=1, H=64, kw={}),
    "qwen-renorm-T5": dict(QWEN, T=5, H=64),
    "qwen-renorm-T5-split": dict(QWEN, T=5, H=64, config=(16, 16)),
    "qwen-renorm-T64-split": dict(QWEN, T=64, H=72, config=(32, 32)),
    "dsv3-T1": dict(DSV3, T=1, H=48),
    "dsv3-T1-mma": dict(DSV3, T=1, H=48, config=(16, 16, 4, 4, True)),  # tl.dot at one token
    "dsv3-T16-fma": dict(DSV3, T=16, H=48, config=(16, 16, 4, 4, False)),  # multiply-adds at 16 tokens
    "dsv3-T5-split": dict(DSV3, T=5, H=48, config=(64, 16)),
    "dsv3-T64": dict(DSV3, T=64, H=40, config=(32, 16)),
    "dsv3-noscale-norenorm-T3": dict(DSV3, T=3, H=32, kw=dict(scoring="sigmoid", n_group=8, topk_group=4)),
    "gptoss-topk-softmax-bias-T5": dict(T=5, E=32, H=40, k=4, bias=True, kw=dict(order="topk_then_softmax")),
    "gptoss-topk-softmax-bias-T16": dict(
        T=16, E=32, H=40, k=4, bias=True, config=(16, 16), kw=dict(order="topk_then_softmax")
    ),
    "gptoss-negative-logits-T3": dict(T=3, E=32, H=40, k=4, bias=-40.0, kw=dict(order="topk_then_softmax")),
    "gptoss-negative-logits-T16": dict(T=16, E=32, H=40, k=4, bias=-40.0, kw=dict(order="topk_then_softmax")),
    "sigmoid-negative-selection-T3": dict(
        T=3, E=64, H=40, k=8, corr=-2.0, kw=dict(scoring="sigmoid", renormalize=True, n_group=4, topk_group=2)
    ),
    "softmax-bias-renorm-T3": dict(T=3, E=64, H=48, k=6, bias=True, kw=dict(renormalize=True)),
    "sigmoid-tensor-scale-T2": dict(
        T=2, E=64, H=48, k=6, corr=True, scale_tensor=True, kw=dict(scoring="sigmoid", renormalize=True)
    ),
    "E60-T5": dict(T=5, E=60, H=100, k=4, config=(16, 32), kw=dict(renormalize=True)),
    "E60-T64": dict(T=64, E=60, H=100, k=4, kw=dict(renormalize=True)),
    "E160-grouped-T16": dict(
        T=16,
        E=160,
        H=72,
        k=6,
        corr=True,
        config=(16, 64),
        kw=dict(scoring="sigmoid", renormalize=True, n_group=8, topk_group=3),
    ),
    "E160-grouped-T1": dict(T=1, E=160, H=72, k=6, corr=True, kw=dict(scoring="sigmoid", n_group=5, topk_group=2)),
    "mixtral-k2-T1": dict(T=1, E=8, H=64, k=2, kw=dict(renormalize=True)),
    "mixtral-k2-T9": dict(T=9, E=8, H=64, k=2, kw=dict(renormalize=True)),
    "k1-T3": dict(T=3, E=8, H=24, k=1),
    "E1-k1-T2": dict(T=2, E=1, H=24, k=1),  # one expert: the top-k's width is its one lane
    "E2-k2-T3": dict(T=3, E=2, H=24, k=2, kw=dict(renormalize=True)),
    "k16-T2": dict(T=2, E=40, H=24, k=16, kw=dict(renormalize=True)),
    "strided-hidden-T4": dict(T=4, E=32, H=48, k=4, strided=True, kw=dict(renormalize=True)),
    "out-buffers-T4": dict(T=4, E=32, H=48, k=4, out=True, kw=dict(scoring="sigmoid")),
    "bf16-inputs-T2": dict(T=2, E=32, H=64, k=4, dtype="bfloat16", kw=dict(renormalize=True)),
    "bf16-inputs-T16": dict(T=16, E=32, H=64, k=4, dtype="bfloat16", kw=dict(renormalize=True)),
    # exact ties (dyadic inputs: every sum is exact in any order), expected leading ids
    "tie-experts-T2": dict(T=2, E=16, H=32, k=4, tie="experts"),
    "tie-experts-T16": dict(T=16, E=16, H=32, k=4, tie="experts", config=(16, 16)),
    "tie-boundary-T2": dict(T=2, E=16, H=32, k=2, tie="boundary"),
    "tie-groups-keep1-T2": dict(
        T=2, E=32, H=32, k=2, tie="groups", kw=dict(scoring="sigmoid", n_group=4, topk_group=1)
    ),
    "tie-groups-keep2-T16": dict(
        T=16, E=32, H=32, k=4, tie="groups", config=(16, 16), kw=dict(scoring="sigmoid", n_group=4, topk_group=2)
    ),
    "tie-groups-bias-T2": dict(
        T=2,
        E=32,
        H=32,
        k=4,
        tie="groups",
        corr=True,
        kw=dict(scoring="sigmoid", renormalize=True, n_group=4, topk_group=2),
    ),
}
TIE_EXPECTED = {  # the ids every token must get, in order
    "tie-experts-T2": [3, 5, 11],
    "tie-experts-T16": [3, 5, 11],
    "tie-boundary-T2": [0, 2],
    "tie-groups-keep1-T2": [9, 12],
    "tie-groups-keep2-T16": [9, 12, 17, 20],
    "tie-groups-bias-T2": [9, 12, 17, 20],
}


def _shift(v) -> float:
    return 0.0 if v is True else float(v)


def make_inputs(name: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(hidden_states, router_weight, routing kwargs) of a case, from a generator seeded by its name."""
    c = CASES[name]
    T, E, H = c["T"], c["E"], c["H"]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    dtype = getattr(torch, c.get("dtype", "float32"))
    kw = dict(c.get("kw", {}))
    tie = c.get("tie")
    if tie is None:
        x = torch.randn((T, 2 * H if c.get("strided") else H), generator=g)
        w = torch.randn((E, H), generator=g) / H**0.5
    else:
        # multiples of 1/4 times multiples of 1/64, at most 32 terms: every partial sum is exact in float32
        x = torch.randint(1, 5, (T, H), generator=g).float() / 4
        w = torch.randint(-8, 9, (E, H), generator=g).float() / 64
        if tie == "experts":  # experts 3, 5, 11 equal and far above the rest
            w[3] = w[5] = w[11] = 0.5
        elif tie == "boundary":  # expert 0 first; 2 and 9 tie for the second slot
            w[0] = 1.0
            w[2] = w[9] = 0.5
        else:  # groups 1 and 2 equal and best; experts 1 and 4 of each tie at their top
            w = torch.full((E, H), -1 / 64)
            c8 = torch.tensor([1, 8, 0, 2, 8, 1, 3, 4]) / 64
            w[8:16] = w[16:24] = c8[:, None].expand(8, H)
    rb = torch.randn((E,), generator=g) + _shift(c["bias"]) if c.get("bias") else None
    if c.get("corr"):
        cb = torch.randn((E,), generator=g) / 64 + _shift(c["corr"])
        if tie == "groups":  # the same bias within groups 1 and 2 (they stay equal), none elsewhere
            cb = torch.zeros(E)
            cb[8:16] = cb[16:24] = torch.tensor([0, 1, 0, 0, 1, 0, 0, 0]) / 64
        kw["correction_bias"] = cb
    if rb is not None:
        kw["router_bias"] = rb
    if c.get("scale_tensor"):
        kw["routed_scaling_factor"] = torch.tensor(1.75)
    x, w = x.to(dtype), w.to(dtype)
    if c.get("strided"):
        x = x[:, ::2]  # stride (2H, 2)
    return x, w, kw


# ------------------------------------------------------------------------------------------------
# the reference against independent formulations
# ------------------------------------------------------------------------------------------------


def deepseek_v3_moegate(x, weight, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor):
    """DeepSeek-V3's ``MoEGate.forward`` (modeling_deepseek.py, scoring_func "sigmoid", topk_method "noaux_tc"),
    as written there: (topk_idx, topk_weight)."""
    n_routed_experts = weight.shape[0]
    logits = F.linear(x.type(torch.float32), weight.type(torch.float32), None)
    scores = logits.sigmoid()
    scores_for_choice = scores.view(x.shape[0], -1) + bias.unsqueeze(0)
    group_scores = scores_for_choice.view(x.shape[0], n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (
        group_mask.unsqueeze(-1).expand(x.shape[0], n_group, n_routed_experts // n_group).reshape(x.shape[0], -1)
    )
    tmp_scores = scores_for_choice.masked_fill(~score_mask.bool(), 0.0)
    _, topk_idx = torch.topk(tmp_scores, k=top_k, dim=-1, sorted=False)
    topk_weight = scores.gather(1, topk_idx)
    if top_k > 1 and norm_topk_prob:
        denominator = topk_weight.sum(dim=-1, keepdim=True) + 1e-20
        topk_weight = topk_weight / denominator
    topk_weight = topk_weight * routed_scaling_factor
    return topk_idx, topk_weight


def mixtral_qwen3_router(x, weight, top_k, norm_topk_prob):
    """Mixtral's / Qwen3-MoE's sparse block: softmax in float32, top-k, optional renormalisation."""
    router_logits = F.linear(x, weight)
    routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
    routing_weights, selected_experts = torch.topk(routing_weights, top_k, dim=-1)
    if norm_topk_prob:
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
    return selected_experts, routing_weights


def gpt_oss_router(x, weight, bias, top_k):
    """GPT-OSS's ``GptOssTopKRouter``: top-k of the biased logits, softmax over the k."""
    router_logits = F.linear(x, weight, bias)
    router_top_value, router_indices = torch.topk(router_logits, top_k, dim=-1)
    router_top_value = torch.nn.functional.softmax(router_top_value, dim=1, dtype=router_top_value.dtype)
    return router_indices, router_top_value


def _by_id(ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), w.gather(1, order)


def test_reference_is_deepseek_v3_moegate():
    R = _route_module()
    g = torch.Generator().manual_seed(1)
    T, E, H = 24, 256, 64
    x, w = torch.randn((T, H), generator=g), torch.randn((E, H), generator=g) / 8
    bias = torch.rand((E,), generator=g) / 32  # positive: HF's 0.0 fill and our -inf agree
    want_ids, want_w = deepseek_v3_moegate(x, w, bias, 8, 8, 4, True, 2.5)
    got_w, got_ids = R.route_reference(
        x,
        w,
        top_k=8,
        scoring="sigmoid",
        renormalize=True,
        correction_bias=bias,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
    )
    assert got_w.dtype == torch.float32 and got_ids.dtype == torch.int32 and got_ids.shape == (T, 8)
    a_ids, a_w = _by_id(got_ids.long(), got_w)
    b_ids, b_w = _by_id(want_ids, want_w)
    assert torch.equal(a_ids, b_ids)
    torch.testing.assert_close(a_w, b_w, rtol=1e-6, atol=1e-6)
    # the unbiased scores are the weights, and the chosen experts lie in topk_group groups
    assert all(len(set(r.tolist())) <= 4 for r in got_ids // 32)
    # listed by descending selection value
    sel = torch.sigmoid(x @ w.t()) + bias
    v = sel.gather(1, got_ids.long())
    assert (v[:, :-1] >= v[:, 1:]).all()


@pytest.mark.parametrize("renorm", [False, True])
def test_reference_is_mixtral_qwen3_routing(renorm):
    R = _route_module()
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn((16, 64), generator=g), torch.randn((128, 64), generator=g) / 8
    want_ids, want_w = mixtral_qwen3_router(x, w, 8, renorm)
    got_w, got_ids = R.route_reference(x, w, top_k=8, renormalize=renorm)
    assert torch.equal(got_ids.long(), want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)


def test_reference_is_gpt_oss_routing():
    R = _route_module()
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn((16, 64), generator=g), torch.randn((32, 64), generator=g) / 8, torch.randn(32, generator=g)
    want_ids, want_w = gpt_oss_router(x, w, b, 4)
    got_w, got_ids = R.route_reference(x, w, top_k=4, router_bias=b, order="topk_then_softmax")
    assert torch.equal(got_ids.long(), want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)


def python_route(x, w, top_k, scoring="softmax", renormalize=False, correction_bias=None, n_group=1, topk_group=1, scale=1.0, router_bias=None, order="score_then_topk"):  # fmt: skip
    """The routing token by token in Python: every choice by ``sorted(..., key=(-value, id))``."""
    logits = x.float() @ w.float().t()
    if router_bias is not None:
        logits = logits + router_bias.float()
    E = w.shape[0]
    per = E // n_group
    out_w, out_ids = [], []
    for t in range(x.shape[0]):
        row = logits[t]
        if order == "topk_then_softmax":
            ids = sorted(range(E), key=lambda e: (-row[e].item(), e))[:top_k]
            wt = torch.softmax(row[ids], dim=0)
        else:
            s = torch.softmax(row, dim=0) if scoring == "softmax" else torch.sigmoid(row)
            sel = s if correction_bias is None else s + correction_bias.float()
            vals = [sel[e].item() for e in range(E)]
            allowed = range(E)
            if n_group > 1:
                gscore = []
                for gi in range(n_group):
                    top2 = sorted(vals[gi * per : (gi + 1) * per], reverse=True)[:2]
                    gscore.append(top2[0] + top2[1])
                kept = sorted(range(n_group), key=lambda gi: (-gscore[gi], gi))[:topk_group]
                allowed = [e for e in range(E) if e // per in kept]
            ids = sorted(allowed, key=lambda e: (-vals[e], e))[:top_k]
            wt = s[ids]
        if renormalize:
            wt = wt / (wt.sum() + (1e-20 if scoring == "sigmoid" else 0.0))
        out_w.append(wt * scale)
        out_ids.append(ids)
    return torch.stack(out_w), torch.tensor(out_ids, dtype=torch.int32)


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n].get("tie") or n in ("dsv3-T5-split", "E160-grouped-T1")])
def test_reference_is_the_python_selection(name):
    """Including exact ties of experts and of groups: the lower id wins, and is listed first."""
    R = _route_module()
    x, w, kw = make_inputs(name)
    c = CASES[name]
    got_w, got_ids = R.route_reference(x, w, top_k=c["k"], **kw)
    kw = dict(kw)
    scale = kw.pop("routed_scaling_factor", 1.0)
    want_w, want_ids = python_route(x, w, c["k"], scale=float(scale), **kw)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)
    if name in TIE_EXPECTED:
        lead = TIE_EXPECTED[name]
        assert (got_ids[:, : len(lead)] == torch.tensor(lead, dtype=torch.int32)).all(), got_ids


def test_tie_inputs_really_tie():
    """The tie cases hold exactly equal logits (else the tie tests would test nothing)."""
    x, w, _ = make_inputs("tie-experts-T2")
    lg = x @ w.t()
    assert torch.equal(lg[:, 3], lg[:, 5]) and torch.equal(lg[:, 3], lg[:, 11])
    x, w, _ = make_inputs("tie-groups-keep1-T2")
    lg = x @ w.t()
    assert torch.equal(lg[:, 8:16], lg[:, 16:24]) and torch.equal(lg[:, 9], lg[:, 12])


# ------------------------------------------------------------------------------------------------
# bad arguments
# ------------------------------------------------------------------------------------------------


def _bad(**over):
    x = over.pop("x", torch.randn(4, 32))
    w = over.pop("w", torch.randn(16, 32))
    kw = dict(top_k=4)
    kw.update(over)
    return x, w, kw


BAD = {
    "k > E": (_bad(top_k=17), "top_k=17 is larger than the number of experts E=16"),
    "k = 0": (_bad(top_k=0), "top_k must be a positive int"),
    "n_group does not divide E": (_bad(n_group=3), "n_group=3 does not divide the number of experts E=16"),
    "one expert per group": (_bad(n_group=16), "1 expert per group"),
    "topk_group > n_group": (_bad(n_group=4, topk_group=5), "topk_group=5 must be an int in [1, n_group=4]"),
    "k > kept experts": (_bad(top_k=5, n_group=4, topk_group=1), "top_k=5 is larger than the 4 experts"),
    "int hidden states": (
        _bad(x=torch.ones(4, 32, dtype=torch.int32)),
        "hidden_states dtype torch.int32 is not supported",
    ),
    "float64 weight": (
        _bad(w=torch.randn(16, 32, dtype=torch.float64)),
        "router_weight dtype torch.float64 is not supported",
    ),
    "fp8 weight": (_bad(w=torch.randn(16, 32).to(torch.float8_e4m3fn)), "router_weight dtype torch.float8_e4m3fn"),
    "3-D hidden states": (_bad(x=torch.randn(1, 4, 32)), "hidden_states must be a 2-D [T, H] tensor"),
    "H mismatch": (_bad(w=torch.randn(16, 31)), "router_weight is (16, 31) but hidden_states has H=32"),
    "bias shape": (_bad(router_bias=torch.randn(15)), "router_bias must be a [E] = [16] tensor"),
    "correction bias dtype": (
        _bad(correction_bias=torch.zeros(16, dtype=torch.int64)),
        "correction_bias dtype torch.int64",
    ),
    "unknown scoring": (_bad(scoring="relu"), "scoring='relu' is not one of"),
    "unknown order": (_bad(order="softmax_then_topk"), "order='softmax_then_topk' is not one of"),
    "topk_then_softmax with sigmoid": (
        _bad(order="topk_then_softmax", scoring="sigmoid"),
        "order='topk_then_softmax' takes scoring='softmax'",
    ),
    "topk_then_softmax with groups": (
        _bad(order="topk_then_softmax", n_group=2),
        "takes no correction_bias and n_group=1",
    ),
    "scale tensor not 0-d": (_bad(routed_scaling_factor=torch.ones(1)), "must be a 0-d float tensor"),
    "scale a string": (_bad(routed_scaling_factor="2.5"), "routed_scaling_factor must be a float or a 0-d tensor"),
}
LIMITS = {
    "T > 64": (_bad(x=torch.randn(65, 32)), "T=65 tokens exceeds the kernel's limit of 64"),
    "E > 512": (_bad(w=torch.randn(513, 32)), "E=513 experts exceeds the kernel's limit of 512"),
    "H > 8192": (_bad(x=torch.randn(1, 8193), w=torch.randn(16, 8193)), "H=8193 exceeds the kernel's limit of 8192"),
    "k > 16": (_bad(w=torch.randn(32, 32), top_k=17), "top_k=17 exceeds the kernel's limit of 16"),
    "out_weights dtype": (
        _bad(out_weights=torch.empty(4, 4, dtype=torch.float16)),
        "out_weights must be a [4, 4] torch.float32",
    ),
    "out_ids shape": (_bad(out_ids=torch.empty(4, 5, dtype=torch.int32)), "out_ids must be a [4, 4] torch.int32"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_arguments_raise_a_value_error_naming_the_problem(case):
    R = _route_module()
    (x, w, kw), msg = BAD[case]
    for fn in (R.route_reference, R.route):
        with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")) as e:
            fn(x, w, **kw)
        assert isinstance(e.value, R.RouteArgumentError)


@pytest.mark.parametrize("case", list(LIMITS), ids=list(LIMITS))
def test_kernel_limits_raise_and_the_reference_has_none(case):
    R = _route_module()
    (x, w, kw), msg = LIMITS[case]
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        R.route(x, w, **kw)
    kw = {n: v for n, v in kw.items() if not n.startswith("out_")}
    weights, ids = R.route_reference(x, w, **kw)
    assert ids.shape == (x.shape[0], kw["top_k"])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter runs CPU tensors")
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cpu_tensors_are_refused_without_the_interpreter():
    R = _route_module()
    with pytest.raises(ValueError, match="the kernels need CUDA tensors, got cpu"):
        R.route(torch.randn(2, 32), torch.randn(16, 32), top_k=2)


def test_heuristic_tiles():
    """Powers of two, >= 16 experts for tl.dot, and about one program per SM for DeepSeek-V3's router."""
    R = _route_module()
    for T in (1, 8, 9, 64):
        for E, H in ((256, 7168), (128, 2048), (8, 4096), (60, 100), (512, 8192), (160, 5120)):
            c = R.heuristic(T, E, H)
            for v in (c.block_e, c.block_k):
                assert v >= 8 and v & (v - 1) == 0
            assert c.block_e * c.block_k <= 8192
            if T > R.FMA_MAX_T:
                assert c.block_e >= 16
            assert -(-H // c.block_k) <= 128  # the top-k kernel's unrolled partial loads
    c = R.heuristic(1, 256, 7168)
    programs = -(-256 // c.block_e) * -(-7168 // c.block_k)
    assert 132 <= programs <= 264, programs


# ------------------------------------------------------------------------------------------------
# the kernels under the interpreter
# ------------------------------------------------------------------------------------------------


def _interp_case(R, name: str) -> dict:
    c = CASES[name]
    x, w, kw = make_inputs(name)
    k = c["k"]
    cfg = R.RouteConfig(*c["config"]) if c.get("config") else None
    extra = {}
    if c.get("out"):  # rows of wider buffers: a row stride that is not k
        bw = torch.full((x.shape[0], k + 3), float("nan"))
        bi = torch.full((x.shape[0], k + 3), -1, dtype=torch.int32)
        extra = dict(out_weights=bw[:, 1 : k + 1], out_ids=bi[:, 1 : k + 1])
    got_w, got_ids = R.route(x, w, top_k=k, config=cfg, **kw, **extra)
    want_w, want_ids = R.route_reference(x, w, top_k=k, **kw)
    res = {
        "ids_equal": bool(torch.equal(got_ids, want_ids)),
        "werr": float((got_w - want_w).abs().max()),
        "nan": bool(got_w.isnan().any()),
        "ids": got_ids.tolist(),
        "ref_ids": want_ids.tolist(),
        "dtypes": [str(got_w.dtype), str(got_ids.dtype)],
    }
    if extra:
        res["in_buffers"] = got_w.data_ptr() == extra["out_weights"].data_ptr() and got_ids.data_ptr() == (
            extra["out_ids"].data_ptr()
        )
        res["untouched"] = bool(bw[:, 0].isnan().all() and bw[:, k + 1 :].isnan().all() and (bi[:, 0] == -1).all())
    return res


@pytest.fixture(scope="module")
def interp_results():
    return run_file(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_reference_in_interpreter(interp_results, name):
    r = interp_results[name]
    assert r["dtypes"] == ["torch.float32", "torch.int32"]
    assert not r["nan"], "an output weight was not written"
    assert r["ids_equal"], f"ids differ:\nkernel    {r['ids'][:4]}\nreference {r['ref_ids'][:4]}"
    assert r["werr"] < 1e-5, f"weights differ by {r['werr']:.2e}"
    if name in TIE_EXPECTED:
        lead = TIE_EXPECTED[name]
        assert all(row[: len(lead)] == lead for row in r["ids"]), r["ids"]
    if CASES[name].get("out"):
        assert r["in_buffers"] and r["untouched"], "the given buffers are written in place, and only their [T, k]"


# ------------------------------------------------------------------------------------------------
# compiled for sm_90 (ahead of time, no GPU needed)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def aot():
    from tests.cpu.kernels import triton_aot

    return triton_aot


# (logits kernel constexprs, its integer arguments, top-k kernel constexprs) of decode calls
AOT_CONFIGS = {
    "dsv3-T1": (
        dict(BE=16, BK=512, T_PAD=1, MMA=False),
        dict(T=1, E=256, H=7168, stride_xt=7168, stride_xh=1, stride_we=7168, stride_wh=1),
        dict(
            SPLIT=14,
            NG=8,
            GS=32,
            NG_PAD=8,
            GS_PAD=32,
            K=8,
            K_PAD=8,
            TOPK_GROUP=4,
            SIGMOID=True,
            TOPK_FIRST=False,
            RENORM=True,
            HAS_BIAS=False,
            HAS_CORR=True,
            SCALE_PTR=False,
            RENORM_FLOOR=False,
            ROUND=0,
            FILL_ZERO=False,
        ),
    ),  # fmt: skip
    "dsv3-T64": (
        dict(BE=16, BK=512, T_PAD=64, MMA=True),
        dict(T=64, E=256, H=7168, stride_xt=7168, stride_xh=1, stride_we=7168, stride_wh=1),
        dict(
            SPLIT=14,
            NG=8,
            GS=32,
            NG_PAD=8,
            GS_PAD=32,
            K=8,
            K_PAD=8,
            TOPK_GROUP=4,
            SIGMOID=True,
            TOPK_FIRST=False,
            RENORM=True,
            HAS_BIAS=False,
            HAS_CORR=True,
            SCALE_PTR=True,
            RENORM_FLOOR=False,
            ROUND=0,
            FILL_ZERO=False,
        ),
    ),  # fmt: skip
    "qwen3-T1": (
        dict(BE=8, BK=256, T_PAD=1, MMA=False),
        dict(T=1, E=128, H=2048, stride_xt=2048, stride_xh=1, stride_we=2048, stride_wh=1),
        dict(
            SPLIT=8,
            NG=1,
            GS=128,
            NG_PAD=1,
            GS_PAD=128,
            K=8,
            K_PAD=8,
            TOPK_GROUP=1,
            SIGMOID=False,
            TOPK_FIRST=False,
            RENORM=True,
            HAS_BIAS=False,
            HAS_CORR=False,
            SCALE_PTR=False,
            RENORM_FLOOR=False,
            ROUND=1,  # bf16 logits, as the Hugging Face graph rounds them
            FILL_ZERO=False,
        ),
    ),  # fmt: skip
    "qwen3-T16": (
        dict(BE=16, BK=128, T_PAD=16, MMA=True),
        dict(T=16, E=128, H=2048, stride_xt=2048, stride_xh=1, stride_we=2048, stride_wh=1),
        dict(
            SPLIT=16,
            NG=1,
            GS=128,
            NG_PAD=1,
            GS_PAD=128,
            K=8,
            K_PAD=8,
            TOPK_GROUP=1,
            SIGMOID=False,
            TOPK_FIRST=False,
            RENORM=True,
            HAS_BIAS=False,
            HAS_CORR=False,
            SCALE_PTR=False,
            RENORM_FLOOR=False,
            ROUND=0,
            FILL_ZERO=False,
        ),
    ),  # fmt: skip
    "gptoss-T4": (
        dict(BE=16, BK=256, T_PAD=1, MMA=False),
        dict(T=4, E=32, H=2880, stride_xt=2880, stride_xh=1, stride_we=2880, stride_wh=1),
        dict(
            SPLIT=12,
            NG=1,
            GS=32,
            NG_PAD=1,
            GS_PAD=32,
            K=4,
            K_PAD=4,
            TOPK_GROUP=1,
            SIGMOID=False,
            TOPK_FIRST=True,
            RENORM=False,
            HAS_BIAS=True,
            HAS_CORR=False,
            SCALE_PTR=False,
            RENORM_FLOOR=False,
            ROUND=0,
            FILL_ZERO=False,
        ),
    ),  # fmt: skip
}


def _aot_ptx(aot, name: str, gdc: bool) -> tuple[str, str]:
    import triton.language as tl

    R = _route_module()
    k1, ints, k2 = AOT_CONFIGS[name]
    ptx1 = aot.compile_like_a_launch(
        R._router_logits_kernel,
        dict(k1, COMPUTE=tl.bfloat16, GDC=gdc),
        {"x_ptr": "*bf16", "w_ptr": "*bf16", "part_ptr": "*fp32"},
        ints,
        num_stages=1,
    )
    return ptx1, _topk_ptx(aot, name, gdc)


def _topk_ptx(aot, name: str, gdc: bool, num_warps: int = 4, asm: dict = None) -> str:
    R = _route_module()
    _, ints, k2 = AOT_CONFIGS[name]
    return aot.compile_like_a_launch(
        R._route_topk_kernel,
        dict(k2, GDC=gdc),
        {p: "*fp32" for p in ("part_ptr", "bias_ptr", "corr_ptr", "scale_ptr", "w_out_ptr")} | {"id_out_ptr": "*i32"},
        dict(T=ints["T"], stride_wt=k2["K"], stride_it=k2["K"]),
        num_stages=1,
        floats=("scale", "renorm_eps"),
        num_warps=num_warps,
        asm=asm,
    )


@pytest.mark.parametrize("name", list(AOT_CONFIGS))
def test_kernels_compile_for_sm90_with_one_wait_each(aot, name):
    ptx1, ptx2 = _aot_ptx(aot, name, gdc=True)
    for ptx in (ptx1, ptx2):
        assert ptx.count("griddepcontrol.wait") == 1
        assert ptx.count("griddepcontrol.launch_dependents") == 1
    lines = ptx1.splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    before = [line for line in lines[:wait] if "ld.global" in line]
    after = [line for line in lines[wait:] if "ld.global" in line]
    assert before and all(".v4" in line for line in before), "the router weight tile is loaded before the wait"
    assert after, "the hidden states are loaded after the wait"
    assert ("mma.sync" in ptx1 or "wgmma.mma_async" in ptx1) == AOT_CONFIGS[name][0]["MMA"]


@pytest.mark.parametrize("name", ["dsv3-T1", "qwen3-T1"])
def test_topk_kernel_as_launched_keeps_its_keys_in_registers(aot, name):
    """As launched (``heuristic``'s warps a token: one for Qwen3's 128 experts, four for DeepSeek-V3's 256), the
    top-k kernel compiles for sm_90 with its int64 keys in registers (no local memory: a spill would put every
    compare-exchange stage of the bitonic top-k behind a memory round trip) and one wait."""
    R = _route_module()
    asm = {}
    ints = AOT_CONFIGS[name][1]
    ptx = _topk_ptx(aot, name, True, R.heuristic(ints["T"], ints["E"], ints["H"]).topk_warps, asm)
    usage = aot.resource_usage(asm["cubin"])
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, usage
    assert ptx.count("griddepcontrol.wait") == 1


def test_kernels_without_gdc_have_no_pdl_instructions(aot):
    for ptx in _aot_ptx(aot, "dsv3-T1", gdc=False):
        assert "griddepcontrol" not in ptx


def test_the_registered_limits_are_the_kernels():
    """kernels/triton/__init__.py declares the kernel's limits for selection without importing Triton: the same
    numbers as the kernel module's."""
    from rubin_compile.kernels import triton as registered

    R = _route_module()
    assert (registered.ROUTE_MAX_T, registered.ROUTE_MAX_E, registered.ROUTE_MAX_H, registered.ROUTE_MAX_K) == (
        R.MAX_T,
        R.MAX_E,
        R.MAX_H,
        R.MAX_K,
    )


if __name__ == "__main__":  # the subprocess of interp_results
    assert os.environ.get("TRITON_INTERPRET") == "1"
    R = _route_module()
    print(json.dumps({name: _interp_case(R, name) for name in CASES}))
