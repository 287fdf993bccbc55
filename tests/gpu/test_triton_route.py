"""The fused decode routing (rubin_compile/kernels/triton/route.py) on the GPU, at the routers of DeepSeek-V3
(E = 256, H = 7168, k = 8, sigmoid with a correction bias, 8 groups keep 4, renormalised, scale 2.5),
Qwen3-30B-A3B (E = 128, H = 2048, k = 8, softmax, renormalised) and Mixtral (E = 8, H = 4096, k = 2) at
T = 1, 8, 64, in bf16 and fp32, against ``route_reference``:

- ids equal as sets per token, except where the reference's selection values (or, grouped, its group scores)
  are within float32 rounding of each other: a near-tie, which the kernel may resolve either way since it sums
  the logits in another order; weights of the tokens whose sets agree within 1e-3 relative (bf16; 1e-4 fp32);
- bitwise the same with PDL on and off, and from one run to the next;
- captured in a CUDA graph (PDL on) and replayed with new inputs: bitwise what the eager call gives;
- exact ties (dyadic inputs, exact in bf16 and in any summation order) go to the lower id, expert and group;
- GPT-OSS's top-k-then-softmax with a router bias, E = 60 / 160 and H not a multiple of the tile, a 0-d
  tensor scale, given output buffers and strided hidden states."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MODELS = {
    "deepseek-v3": dict(
        E=256,
        H=7168,
        k=8,
        corr=True,
        kw=dict(scoring="sigmoid", renormalize=True, n_group=8, topk_group=4, routed_scaling_factor=2.5),
    ),
    "qwen3-30b-a3b": dict(E=128, H=2048, k=8, kw=dict(renormalize=True)),
    "mixtral": dict(E=8, H=4096, k=2, kw=dict(renormalize=True)),
}
TOKENS = (1, 8, 64)
NEAR = 2e-5  # selection values closer than this (relative to the largest) may be chosen either way
WTOL = {torch.bfloat16: 1e-3, torch.float16: 1e-3, torch.float32: 1e-4}


@pytest.fixture(scope="module")
def R():
    from rubin_compile.kernels.triton import route

    return route


def _inputs(E, H, dtype, T, seed, corr=False, bias=False, **_):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn((T, H), device="cuda", generator=g).to(dtype)
    w = (torch.randn((E, H), device="cuda", generator=g) / H**0.5).to(dtype)
    kw = {}
    if corr:
        kw["correction_bias"] = torch.randn((E,), device="cuda", generator=g) * 0.05
    if bias:
        kw["router_bias"] = torch.randn((E,), device="cuda", generator=g).to(dtype)
    return x, w, kw


def _selection(R, x, w, k, kw):
    """The reference's selection values [T, E] and, grouped, its group scores [T, n_group]."""
    logits = x.float() @ w.float().t()
    if kw.get("router_bias") is not None:
        logits = logits + kw["router_bias"].float()
    if kw.get("order") == "topk_then_softmax":
        return logits, None
    s = torch.sigmoid(logits) if kw.get("scoring") == "sigmoid" else torch.softmax(logits, -1)
    sel = s + kw["correction_bias"].float() if kw.get("correction_bias") is not None else s
    ng = kw.get("n_group", 1)
    if ng == 1:
        return sel, None
    return sel, sel.view(sel.shape[0], ng, -1).topk(2, dim=-1).values.sum(-1)


def _check(R, got, want, x, w, k, kw, dtype):
    (gw, gi), (rw, ri) = got, want
    assert gw.dtype == torch.float32 and gi.dtype == torch.int32 and gi.shape == ri.shape == (x.shape[0], k)
    assert not gw.isnan().any()
    sel, gscore = _selection(R, x, w, k, kw)
    scale = sel.abs().amax(-1)
    same = []
    for t in range(x.shape[0]):
        a, b = set(gi[t].tolist()), set(ri[t].tolist())
        assert len(a) == k, f"token {t}: repeated ids {gi[t].tolist()}"
        if a == b:
            same.append(t)
            continue
        # a near-tie: the experts that differ are within rounding of the k-th selection value, or their groups
        # within rounding of the last group kept
        kth = sel[t, ri[t].long()].min()
        diff = torch.tensor(sorted(a ^ b), device="cuda")
        ok = ((sel[t, diff] - kth).abs() <= NEAR * scale[t]).all()
        if not ok and gscore is not None:
            kept = gscore[t].sort(descending=True).values[kw["topk_group"] - 1]
            groups = diff // (w.shape[0] // kw["n_group"])
            ok = ((gscore[t, groups] - kept).abs() <= NEAR * gscore[t].abs().max()).all()
        assert ok, f"token {t}: kernel {sorted(a)} reference {sorted(b)} (no near-tie)"
    assert len(same) >= x.shape[0] - max(1, x.shape[0] // 16), "too many tokens routed differently"
    rows = torch.tensor(same, device="cuda")
    go, ro = gi[rows].long().argsort(-1), ri[rows].long().argsort(-1)
    torch.testing.assert_close(
        gw[rows].gather(1, go), rw[rows].gather(1, ro), rtol=WTOL[dtype], atol=1e-6
    )  # weights by expert id
    # listed in descending selection value (within rounding)
    v = sel.gather(1, gi.long())
    assert (v[:, :-1] >= v[:, 1:] - NEAR * scale[:, None]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("model", list(MODELS))
def test_matches_reference(R, model, T, dtype):
    m = MODELS[model]
    x, w, extra = _inputs(dtype=dtype, T=T, seed=T, **m)
    kw = dict(m["kw"], **extra)
    _check(R, R.route(x, w, top_k=m["k"], **kw), R.route_reference(x, w, top_k=m["k"], **kw), x, w, m["k"], kw, dtype)


@pytest.mark.parametrize("mma", [False, True], ids=["fma", "mma"])
@pytest.mark.parametrize("T", (1, 2, 4, 8, 16))
@pytest.mark.parametrize("model", list(MODELS))
def test_both_logits_forms(R, model, T, mma):
    """The logits by multiply-adds and by tl.dot (``RouteConfig.mma``), at every T either may be chosen at."""
    from dataclasses import replace

    m = MODELS[model]
    x, w, extra = _inputs(dtype=torch.bfloat16, T=T, seed=T + 30, **m)
    kw = dict(m["kw"], **extra)
    cfg = replace(R.heuristic(T, m["E"], m["H"]), mma=mma)
    got = R.route(x, w, top_k=m["k"], config=cfg, **kw)
    _check(R, got, R.route_reference(x, w, top_k=m["k"], **kw), x, w, m["k"], kw, torch.bfloat16)


def test_fp16_and_mixed_dtypes(R):
    m = MODELS["qwen3-30b-a3b"]
    for xd, wd in ((torch.float16, torch.float16), (torch.bfloat16, torch.float32)):
        x, _, _ = _inputs(dtype=xd, T=8, seed=1, **m)
        _, w, _ = _inputs(dtype=wd, T=8, seed=2, **m)
        _check(R, R.route(x, w, top_k=8, **m["kw"]), R.route_reference(x, w, top_k=8, **m["kw"]), x, w, 8, m["kw"], xd)


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("model", list(MODELS))
def test_pdl_on_and_off_are_bitwise_equal_and_deterministic(R, model, T):
    m = MODELS[model]
    x, w, extra = _inputs(dtype=torch.bfloat16, T=T, seed=7, **m)
    kw = dict(m["kw"], **extra)
    off = R.route(x, w, top_k=m["k"], pdl=False, **kw)
    on = R.route(x, w, top_k=m["k"], pdl=True, **kw)
    again = R.route(x, w, top_k=m["k"], pdl=True, **kw)
    for a, b in ((off, on), (on, again)):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("model", list(MODELS))
def test_cuda_graph_replay_with_new_inputs(R, model, T):
    m = MODELS[model]
    x, w, extra = _inputs(dtype=torch.bfloat16, T=T, seed=11, **m)
    kw = dict(m["kw"], **extra)
    static_x = x.clone()
    out_w = torch.empty((T, m["k"]), dtype=torch.float32, device="cuda")
    out_i = torch.empty((T, m["k"]), dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles) outside the capture
        R.route(static_x, w, top_k=m["k"], pdl=True, out_weights=out_w, out_ids=out_i, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        R.route(static_x, w, top_k=m["k"], pdl=True, out_weights=out_w, out_ids=out_i, **kw)
    for seed in (21, 22, 23):
        new, _, _ = _inputs(dtype=torch.bfloat16, T=T, seed=seed, **m)
        static_x.copy_(new)
        out_w.fill_(float("nan"))
        out_i.fill_(-1)
        graph.replay()
        eager = R.route(new, w, top_k=m["k"], **kw)
        assert torch.equal(out_w, eager[0]) and torch.equal(out_i, eager[1])
        _check(R, (out_w, out_i), R.route_reference(new, w, top_k=m["k"], **kw), new, w, m["k"], kw, torch.bfloat16)


@pytest.mark.parametrize(
    "E,H,k,T,kw",
    [
        (60, 1000, 4, 5, dict(renormalize=True)),
        (60, 1000, 4, 64, dict(renormalize=True)),
        (160, 5120, 6, 1, dict(scoring="sigmoid", renormalize=True, n_group=8, topk_group=3)),
        (160, 5120, 6, 16, dict(scoring="sigmoid", renormalize=True, n_group=8, topk_group=3)),
        (512, 8192, 16, 64, dict(renormalize=True)),
    ],
    ids=["E60-T5", "E60-T64", "E160-grouped-T1", "E160-grouped-T16", "E512-H8192-k16-T64"],
)
def test_odd_shapes(R, E, H, k, T, kw):
    x, w, extra = _inputs(E, H, torch.bfloat16, T, seed=E + T, corr="n_group" in kw)
    kw = dict(kw, **extra)
    _check(R, R.route(x, w, top_k=k, **kw), R.route_reference(x, w, top_k=k, **kw), x, w, k, kw, torch.bfloat16)


@pytest.mark.parametrize("T", (1, 16))
def test_gpt_oss_topk_then_softmax_with_router_bias(R, T):
    x, w, extra = _inputs(32, 2880, torch.bfloat16, T, seed=5, bias=True)
    kw = dict(order="topk_then_softmax", **extra)
    _check(R, R.route(x, w, top_k=4, **kw), R.route_reference(x, w, top_k=4, **kw), x, w, 4, kw, torch.bfloat16)


def test_tensor_scale_buffers_and_strided_hidden_states(R):
    m = MODELS["deepseek-v3"]
    x, w, extra = _inputs(dtype=torch.bfloat16, T=8, seed=3, **m)
    wide = torch.zeros((8, 2 * m["H"]), dtype=torch.bfloat16, device="cuda")
    wide[:, : m["H"]] = x
    xs = wide[:, : m["H"]]  # row stride 2H
    kw = dict(m["kw"], **extra, routed_scaling_factor=torch.tensor(2.5, device="cuda"))
    bw = torch.full((8, 11), float("nan"), device="cuda")
    bi = torch.full((8, 11), -1, dtype=torch.int32, device="cuda")
    got = R.route(xs, w, top_k=8, out_weights=bw[:, 1:9], out_ids=bi[:, 1:9], **kw)
    assert got[0].data_ptr() == bw[:, 1:9].data_ptr() and bw[:, 0].isnan().all() and (bi[:, 9:] == -1).all()
    want = R.route_reference(x, w, top_k=8, **dict(m["kw"], **extra))
    _check(R, got, want, x, w, 8, kw, torch.bfloat16)


@pytest.mark.parametrize("T", (2, 16))
def test_exact_ties_go_to_the_lower_id(R, T):
    g = torch.Generator(device="cuda").manual_seed(T)
    H = 32
    x = (torch.randint(1, 5, (T, H), device="cuda", generator=g).float() / 4).to(torch.bfloat16)
    w = torch.randint(-8, 9, (16, H), device="cuda", generator=g).float() / 64
    w[3] = w[5] = w[11] = 0.5
    got = R.route(x, w.to(torch.bfloat16), top_k=4)
    want = R.route_reference(x, w.to(torch.bfloat16), top_k=4)
    assert torch.equal(got[1], want[1]) and (got[1][:, :3] == torch.tensor([3, 5, 11], device="cuda")).all()
    # groups 1 and 2 equal and best; experts 1 and 4 of each tie at their top
    wg = torch.full((32, H), -1 / 64, device="cuda")
    c8 = torch.tensor([1, 8, 0, 2, 8, 1, 3, 4], device="cuda") / 64
    wg[8:16] = wg[16:24] = c8[:, None].expand(8, H)
    for keep, lead in ((1, [9, 12]), (2, [9, 12, 17, 20])):
        kw = dict(scoring="sigmoid", n_group=4, topk_group=keep)
        got = R.route(x, wg.to(torch.bfloat16), top_k=len(lead), **kw)
        want = R.route_reference(x, wg.to(torch.bfloat16), top_k=len(lead), **kw)
        assert torch.equal(got[1], want[1]) and (got[1] == torch.tensor(lead, device="cuda")).all()
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-7)
