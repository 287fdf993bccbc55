"""The split-KV decode attention kernels (rubin_compile/kernels/triton/attention.py) on the GPU: against SDPA in
fp32 and the float64 reference in bf16 / FP8 KV, over lengths that are not multiples of the tile, GQA ratios
1 / 4 / 8, batches whose rows are filled to different lengths (a static cache: the unfilled part poisoned with
NaN, which must never be read), and captured in a CUDA graph (no host synchronisation)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rubin_compile.ops.attention import AttentionArgs, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


needs_sm90 = pytest.mark.skipif(not _hopper(), reason="the Triton decode attention is built for sm_90+")


def _inputs(B, Hq, Hkv, S, Skv, D, lengths, dtype, kv_dtype=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn((B, S, Hq, D), generator=g, device="cuda").to(dtype).transpose(1, 2)
    k = torch.randn((B, Hkv, Skv, D), generator=g, device="cuda")
    v = torch.randn((B, Hkv, Skv, D), generator=g, device="cuda")
    k, v = k.to(kv_dtype or dtype), v.to(kv_dtype or dtype)
    pos = torch.arange(Skv, device="cuda")
    lengths = torch.tensor(lengths, device="cuda")
    last = lengths[:, None] - S + torch.arange(S, device="cuda")[None, :]  # the S newest positions of each row
    mask = (pos[None, None, :] <= last[:, :, None])[:, None]  # [B, 1, S, Skv]: causal within the filled part
    tail = (pos[None, :] >= lengths[:, None])[:, None, :, None]
    return q, k, v, mask, tail


def _poisoned(t, tail):
    """``t`` with NaN where ``tail`` (FP8 through its bytes: masked_fill has no FP8 kernel; 0x7F is e4m3's NaN)."""
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).masked_fill(tail, 0x7F).view(t.dtype)
    return t.masked_fill(tail, torch.tensor(float("nan"), device=t.device).to(t.dtype))


@needs_sm90
@pytest.mark.parametrize("Hq,Hkv", [(8, 8), (32, 8), (32, 4)], ids=["gqa1", "gqa4", "gqa8"])
@pytest.mark.parametrize("S", [1, 2])
@pytest.mark.parametrize("Skv,lengths", [(1000, (1000, 999)), (4224, (4100, 77)), (333, (333,))])
@pytest.mark.parametrize("config", ["DEFAULT", "LONG"])
def test_fp32_matches_sdpa(Hq, Hkv, S, Skv, lengths, config):
    from rubin_compile.kernels.triton import attention

    B = len(lengths)
    q, k, v, mask, tail = _inputs(B, Hq, Hkv, S, Skv, 128, lengths, torch.float32)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # fp32 math: the exact reference SDPA computes
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=Hq != Hkv)
    config = getattr(attention, config)  # each Config config_for can pick, at every shape
    got = attention.run(AttentionArgs(q, _poisoned(k, tail), _poisoned(v, tail), mask), config=config)
    assert torch.isfinite(got).all(), "a position past a row's length (NaN) was read"
    err = (got - want).abs().max().item()
    assert err < 2e-5, f"max |rubin - SDPA| = {err:.2e} (fp32)"
    again = attention.run(AttentionArgs(q, _poisoned(k, tail), _poisoned(v, tail), mask), config=config)
    assert torch.equal(got, again), "two runs differ: the merge of the splits is not deterministic"


@needs_sm90
@pytest.mark.parametrize("kind", ["dense", "bool-hole", "additive-hole", "additive-bias"])
@pytest.mark.parametrize("config", ["DEFAULT", "LONG"])
def test_shared_mask_with_holes_and_biases(kind, config):
    """A mask shared by every query row, dense (a static cache's), with a hole inside a split (masked positions between
    attended ones: read, their values real, not NaN, and masked by the tile) or with a finite bias (ALiBi-like): fp32
    against SDPA's math."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rubin_compile.kernels.triton import attention

    Skv, length = 4224, 4100
    q, k, v, mask, tail = _inputs(1, 32, 4, 1, Skv, 128, (length,), torch.float32)
    if kind.endswith("hole"):
        mask[..., 1000:1013] = False  # inside one split of every Config (splits of 128 positions or more)
    sdpa_mask = mask
    if kind.startswith("additive"):
        sdpa_mask = torch.where(mask, 0.0, float("-inf"))
        if kind == "additive-bias":
            sdpa_mask = sdpa_mask + torch.randn(Skv, device="cuda")  # finite where attended, -inf elsewhere
    with sdpa_kernel(SDPBackend.MATH):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, enable_gqa=True)
    got = attention.run(
        AttentionArgs(q, _poisoned(k, tail), _poisoned(v, tail), sdpa_mask), config=getattr(attention, config)
    )
    assert torch.isfinite(got).all(), "a position past the filled length (NaN) was read"
    err = (got - want).abs().max().item()
    assert err < 2e-5, f"max |rubin - SDPA| = {err:.2e} ({kind}, {config})"


@needs_sm90
@pytest.mark.parametrize(
    "dtype,kv_dtype,tol",
    [(torch.bfloat16, None, 1.5e-2), (torch.float16, None, 3e-3), (torch.bfloat16, torch.float8_e4m3fn, 1.5e-2)],
    ids=["bf16", "fp16", "fp8-kv"],
)
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_half_and_fp8_kv_match_the_float64_reference(dtype, kv_dtype, tol, splits):
    from rubin_compile.kernels.triton import attention

    lengths = (16384, 5000, 31, 9000)
    B, Hq, Hkv, Skv = len(lengths), 32, 4, 16512
    q, k, v, mask, tail = _inputs(B, Hq, Hkv, 1, Skv, 128, lengths, dtype, kv_dtype)
    additive = torch.where(mask, 0.0, float("-inf")).to(dtype)  # what SDPA makes of transformers' bool mask
    scales = (torch.tensor(0.7, device="cuda"), torch.tensor(1.3, device="cuda")) if kv_dtype else (None, None)
    want = reference(
        AttentionArgs(
            q.double(),
            k.double() * (scales[0].double() if kv_dtype else 1),
            v.double() * (scales[1].double() if kv_dtype else 1),
            mask,
        )
    )
    got = attention.run(
        AttentionArgs(q, _poisoned(k, tail), _poisoned(v, tail), additive, False, None, *scales), splits=splits
    )
    assert torch.isfinite(got).all(), "a position past a row's length (NaN) was read"
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err < tol, f"error {err:.2e} of the output's scale"


@needs_sm90
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 1.5e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_sinks_match_gpt_oss_eager_attention(dtype, tol, splits):
    """GPT-OSS's shapes (64 query / 8 KV heads of 64) with a sink logit per head, a finite additive mask (eager
    attention's ``finfo.min``, as transformers gives it; skipped where masked, as -inf is) and batch rows filled to
    different lengths, against the
    float64 reference (the model's own formula: tests/cpu/ops/test_attention.py); the combine adds the sinks
    (several splits) or the split kernel (one)."""
    from rubin_compile.kernels.triton import attention

    lengths = (3000, 130)
    B, Hq, Hkv, Skv, D = len(lengths), 64, 8, 3200, 64
    q, k, v, mask, tail = _inputs(B, Hq, Hkv, 1, Skv, D, lengths, dtype)
    sinks = (torch.randn(Hq, device="cuda") * 2 + 5).to(dtype)  # large enough to change every output
    additive = torch.where(mask, 0.0, torch.finfo(dtype).min).to(dtype)
    k, v = k.masked_fill(tail, 0.0), v.masked_fill(tail, 0.0)
    want = reference(AttentionArgs(q.double(), k.double(), v.double(), additive.double(), sinks=sinks.double()))
    # finfo.min is -inf once in log2 units: the positions past each row's length are skipped (NaN: never read)
    got = attention.run(AttentionArgs(q, _poisoned(k, tail), _poisoned(v, tail), additive, sinks=sinks), splits=splits)
    assert torch.isfinite(got).all(), "a position past a row's length (NaN) was read"
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err < tol, f"error {err:.2e} of the output's scale"
    no_sinks = attention.run(AttentionArgs(q, k, v, additive), splits=splits)
    assert (no_sinks.double() - want).abs().max() > 10 * tol * want.abs().max(), "the sinks changed nothing"


@needs_sm90
def test_runs_in_a_cuda_graph():
    from rubin_compile.kernels.triton import attention

    q, k, v, mask, _ = _inputs(1, 32, 4, 1, 8320, 128, (8000,), torch.bfloat16)
    args = AttentionArgs(q, k, v, mask)
    eager = attention.run(args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attention.run(args)
    q.normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, attention.run(args))
    assert not torch.equal(captured, eager)


@needs_sm90
def test_the_op_runs_the_kernel_and_falls_back_for_prefill_rows():
    """``rubin.attention(impl="triton@sm90")``: decode-sized calls run the kernel; a prefill-sized call of a graph
    compiled with a symbolic query length runs the op's ATen form (same result as the reference)."""
    for S in (1, 64):
        q, k, v, mask, _ = _inputs(1, 32, 4, S, 600, 128, (600,), torch.bfloat16)
        got = torch.ops.rubin.attention(q, k, v, mask, impl="triton@sm90")
        want = reference(AttentionArgs(q.double(), k.double(), v.double(), mask))
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err < 1.5e-2, (S, err)


@needs_sm90
@pytest.mark.parametrize("config", ["DEFAULT", "LONG"])
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["bf16", "fp8-kv"])
def test_pdl_bitwise_equal_under_graph_replay(config, kv_dtype):
    """PDL on (each call launched after the one before with PDL, its first K / V tiles asked into L2 before its
    wait) against off, in one captured graph of chained calls whose inputs are refreshed before each replay: the
    same results bitwise, and each replay computes its fresh inputs (a call that read before its wait would see the
    previous replay's query). The unfilled part of the cache is NaN: the prefetch may touch it, no load may."""
    from rubin_compile.kernels.triton import attention
    from rubin_compile.ops.registry import Launch

    cfg = getattr(attention, config)
    q, k, v, mask, tail = _inputs(2, 32, 4, 1, 4224, 128, (4100, 1500), torch.bfloat16, kv_dtype=kv_dtype)
    k, v = _poisoned(k, tail), _poisoned(v, tail)
    one = torch.ones((), device="cuda") if kv_dtype is not None else None

    def chain(pdl: bool):
        # three dependent calls: the next query is the previous output (the previous kernel's write)
        x = q
        for _ in range(3):
            x = attention.run(AttentionArgs(x, k, v, mask, False, None, one, one), Launch(pdl=pdl), config=cfg)
        return x

    outs = {}
    for pdl in (True, False):
        chain(pdl)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(pdl)
        results = []
        for seed in range(3):
            q.copy_(torch.randn(q.shape, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda"))
            graph.replay()
            torch.cuda.synchronize()
            results.append(out.clone())
            assert torch.equal(out, chain(False)), "a replay did not compute its fresh inputs"
        outs[pdl] = results
    for a, b in zip(outs[True], outs[False]):
        assert torch.isfinite(a).all() and torch.equal(a, b)
