"""The fused MoE Triton kernels against the reference op (GPU only).

Every case draws fresh random inputs, poisons the output (and the allocator's free blocks) with NaN
before the run, and compares with ``moe_reference`` evaluated in float64 on upcast inputs by
||out - ref|| / ||ref||. Tolerances, per weight format:

* bf16 weights / activations: 1e-2 (the [T*k, I] intermediate and the per-slot rows are rounded to bf16,
  as the reference rounds its own products; measured about 3e-3);
* fp16: 3e-3 (same roundings with 3 more mantissa bits);
* FP8 weights with 16-bit activations (W8A16, the default): 1e-2 (e4m3 -> bf16 is exact; the error is
  the bf16 roundings above);
* FP8 weights with in-kernel FP8 activations (``a_fp8``): 6e-2 (e4m3 has a 3-bit mantissa).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rubin_compile.ops.moe import moe_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3, "fp8": 1e-2, "fp8_a8": 6e-2}


@pytest.fixture(scope="module")
def tmoe():
    from rubin_compile.kernels.triton import moe

    return moe


def _poison_allocator(nbytes: int) -> None:
    """Fill free blocks of the caching allocator with NaN so buffers the kernel forgets to write show up."""
    blocks = [torch.full((max(1, nbytes // 2),), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    del blocks


def _inputs(T, E, H, I, k, dtype, wfmt="16", act="silu", bias=False, block=(128, 128), seed=None, route="random"):
    g = torch.Generator(device="cuda")
    # the default seed is drawn from the generator conftest seeds from the test's id: reproducible per test
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item()))
    x = torch.randn((T, H), device="cuda", dtype=dtype, generator=g)
    kw = dict(activation=act)
    if wfmt == "16":
        kw["w13"] = (torch.randn((E, 2 * I, H), device="cuda", generator=g) / H**0.5).to(dtype)
        kw["w2"] = (torch.randn((E, H, I), device="cuda", generator=g) / I**0.5).to(dtype)
    else:
        f8 = torch.float8_e4m3fn
        kw["w13"] = (torch.randn((E, 2 * I, H), device="cuda", generator=g) * 32).to(f8)
        kw["w2"] = (torch.randn((E, H, I), device="cuda", generator=g) * 32).to(f8)
        if wfmt == "fp8_tensor":
            kw["w13_scale"] = torch.rand((), device="cuda", generator=g) / (32 * H**0.5)
            kw["w2_scale"] = torch.rand((), device="cuda", generator=g) / (32 * I**0.5)
        elif wfmt == "fp8_expert":
            kw["w13_scale"] = torch.rand((E,), device="cuda", generator=g) / (32 * H**0.5) + 1e-3 / H**0.5
            kw["w2_scale"] = torch.rand((E, 1, 1), device="cuda", generator=g) / (32 * I**0.5) + 1e-3 / I**0.5
        else:
            bn, bk = block
            kw["w13_scale"] = (
                torch.rand((E, -(-2 * I // bn), -(-H // bk)), device="cuda", generator=g) / (32 * H**0.5)
                + 1e-3 / H**0.5
            )
            kw["w2_scale"] = (
                torch.rand((E, -(-H // bn), -(-I // bk)), device="cuda", generator=g) / (32 * I**0.5) + 1e-3 / I**0.5
            )
            kw["block_shape"] = list(block)
    if bias:
        kw["w13_bias"] = torch.randn((E, 2 * I), device="cuda", generator=g).to(dtype) * 0.1
        kw["w2_bias"] = torch.randn((E, H), device="cuda", generator=g).to(dtype) * 0.1
    if route == "random":
        ids = torch.rand((T, E), device="cuda", generator=g).topk(k, dim=-1).indices
    elif route == "one_expert":  # every slot of every token on expert E-1 (duplicates within a row)
        ids = torch.full((T, k), E - 1, device="cuda", dtype=torch.int64)
    else:  # "skewed": tokens crowd onto few experts, most experts get none
        ids = torch.randint(0, max(1, E // 4), (T, k), device="cuda", generator=g)
    tw = torch.softmax(torch.randn((T, k), device="cuda", generator=g), dim=-1)
    return x, tw, ids, kw


def _reference(x, tw, ids, kw):
    """The reference op in float64 on upcast inputs (FP8 weights stay FP8: the reference dequantises them)."""
    up = {
        n: (v.double() if isinstance(v, torch.Tensor) and v.dtype in (torch.bfloat16, torch.float16) else v)
        for n, v in kw.items()
    }
    return moe_reference(
        x.double(),
        up["w13"],
        up["w2"],
        tw.double(),
        ids,
        up["activation"],
        up.get("w13_bias"),
        up.get("w2_bias"),
        up.get("w13_scale"),
        up.get("w2_scale"),
        up.get("block_shape"),
    )


def _run(tmoe, x, tw, ids, kw, **extra):
    T, H = x.shape
    out = torch.full((T, H), float("nan"), dtype=x.dtype, device="cuda")
    _poison_allocator(ids.numel() * max(H, kw["w2"].shape[2]) * 4)
    got = tmoe.fused_moe(
        x,
        kw["w13"],
        kw["w2"],
        tw,
        ids,
        kw["activation"],
        kw.get("w13_bias"),
        kw.get("w2_bias"),
        kw.get("w13_scale"),
        kw.get("w2_scale"),
        kw.get("block_shape"),
        out=out,
        **extra,
    )
    assert got is out
    return got


def _check(got, ref, tol):
    assert not torch.isnan(got).any(), "output has NaN: an element was not written"
    err = ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < tol, f"relative error {err:.3e} >= {tol:.1e}"
    return err


def _cfg(
    tmoe, mode, bm=16, bn1=32, bn2=64, bk=128, cap=0, fused=True, a_fp8=False, prefetch=0, swap=False, split=1, **knobs
):
    G = tmoe.GemmConfig
    if mode == "prefill":
        return tmoe.MoEConfig(
            mode="prefill",
            cap=cap or 64,
            fused_sum=fused,
            a_fp8=a_fp8,
            **knobs,
            fc1=G(BM=64, BN=64, BK=64, num_warps=4, num_stages=3, split_k=split),
            fc2=G(BM=64, BN=128, BK=64, num_warps=4, num_stages=3),
        )
    return tmoe.MoEConfig(
        mode=mode,
        fused_sum=fused,
        a_fp8=a_fp8,
        cap=cap,
        **knobs,
        fc1=G(BM=bm, BN=bn1, BK=bk, prefetch=prefetch, swap=swap, split_k=split),
        fc2=G(BM=bm, BN=bn2, BK=bk, prefetch=prefetch, swap=swap),
    )


SHAPES = [
    # (E, H, I, k): a fine-grained MoE, and one whose E, H and I are not powers of two / block multiples
    (16, 512, 384, 4),
    (9, 320, 200, 2),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("E,H,I,k", SHAPES)
@pytest.mark.parametrize("T", [1, 3, 16, 70, 300])
def test_matches_reference_auto_config(tmoe, dtype, E, H, I, k, T):
    x, tw, ids, kw = _inputs(T, E, H, I, k, dtype)
    _check(_run(tmoe, x, tw, ids, kw), _reference(x, tw, ids, kw), TOL[dtype])


@pytest.mark.parametrize("mode", ["slot", "grouped", "prefill"])
@pytest.mark.parametrize("T", [1, 5, 13])
@pytest.mark.parametrize("act,bias", [("silu", False), ("gelu_tanh", True)])
def test_each_mode(tmoe, mode, T, act, bias):
    x, tw, ids, kw = _inputs(T, 16, 512, 384, 4, torch.bfloat16, act=act, bias=bias)
    _check(_run(tmoe, x, tw, ids, kw, config=_cfg(tmoe, mode)), _reference(x, tw, ids, kw), TOL[torch.bfloat16])


@pytest.mark.parametrize("wfmt", ["fp8_tensor", "fp8_expert", "fp8_block"])
@pytest.mark.parametrize("mode", ["slot", "grouped", "prefill"])
def test_fp8_weights(tmoe, wfmt, mode):
    T = 7 if mode != "prefill" else 150
    x, tw, ids, kw = _inputs(T, 9, 320, 200, 2, torch.bfloat16, wfmt=wfmt)  # H, I not multiples of 128
    _check(_run(tmoe, x, tw, ids, kw, config=_cfg(tmoe, mode)), _reference(x, tw, ids, kw), TOL["fp8"])


@pytest.mark.parametrize("wfmt", ["fp8_expert", "fp8_block"])
@pytest.mark.parametrize(
    "mode,T,swap", [("slot", 3, True), ("grouped", 100, True), ("grouped", 100, False), ("prefill", 100, False)]
)
def test_fp8_quantised_activations(tmoe, wfmt, mode, T, swap):
    x, tw, ids, kw = _inputs(T, 8, 512, 320, 2, torch.bfloat16, wfmt=wfmt)
    cfg = _cfg(tmoe, mode, a_fp8=True, swap=swap, bn1=64, bn2=64)
    _check(_run(tmoe, x, tw, ids, kw, config=cfg), _reference(x, tw, ids, kw), TOL["fp8_a8"])


@pytest.mark.parametrize("wfmt", ["16", "fp8_block"])
@pytest.mark.parametrize("mode,T", [("slot", 1), ("slot", 9), ("grouped", 60)])
def test_swapped_tiles(tmoe, wfmt, mode, T):
    x, tw, ids, kw = _inputs(T, 9, 320, 200, 2, torch.bfloat16, wfmt=wfmt, act="gelu_tanh", bias=True)
    cfg = _cfg(tmoe, mode, swap=True, bn1=64, bn2=128)
    _check(_run(tmoe, x, tw, ids, kw, config=cfg), _reference(x, tw, ids, kw), TOL["fp8"])


@pytest.mark.parametrize(
    "T,k,route",
    [
        (1, 1, "random"),
        (1, 8, "random"),
        (64, 1, "one_expert"),
        (6, 4, "one_expert"),
        (200, 4, "one_expert"),
        (40, 3, "skewed"),
        (5000, 2, "random"),
    ],
)
def test_routing_edge_cases(tmoe, T, k, route):
    x, tw, ids, kw = _inputs(T, 10, 256, 160, k, torch.bfloat16, route=route)
    _check(_run(tmoe, x, tw, ids, kw), _reference(x, tw, ids, kw), TOL[torch.bfloat16])


@pytest.mark.parametrize("mode", ["slot", "grouped"])
def test_prefetch_and_unfused_sum(tmoe, mode):
    x, tw, ids, kw = _inputs(6, 16, 512, 384, 4, torch.bfloat16)
    ref = _reference(x, tw, ids, kw)
    _check(_run(tmoe, x, tw, ids, kw, config=_cfg(tmoe, mode, prefetch=16384)), ref, TOL[torch.bfloat16])
    _check(_run(tmoe, x, tw, ids, kw, config=_cfg(tmoe, mode, fused=False)), ref, TOL[torch.bfloat16])


@pytest.mark.parametrize("wfmt", ["16", "fp8_block"])
@pytest.mark.parametrize("mode,T", [("slot", 1), ("slot", 7), ("grouped", 60), ("prefill", 300)])
@pytest.mark.parametrize("split", [2, 3])
def test_fc1_split_over_k(tmoe, wfmt, mode, T, split):
    """FC1 split over K = H (FC2 sums the float32 partials and activates): H = 320 with BK = 64 gives
    ranges of 3 + 2 tiles (split 2) or 2 + 2 + 1 (split 3), the last one ragged; bias added once."""
    x, tw, ids, kw = _inputs(T, 9, 320, 200, 2, torch.bfloat16, wfmt=wfmt, act="gelu_tanh", bias=True)
    cfg = _cfg(tmoe, mode, bk=64, split=split, a_fp8=False)
    _check(_run(tmoe, x, tw, ids, kw, config=cfg), _reference(x, tw, ids, kw), TOL["fp8"])


@pytest.mark.parametrize("wfmt", ["fp8_tensor", "fp8_block"])
@pytest.mark.parametrize("mode,T", [("slot", 1), ("slot", 7), ("grouped", 60)])
@pytest.mark.parametrize("split", [2, 3])
def test_fc1_split_over_k_fp8_activations(tmoe, wfmt, mode, T, split):
    """FP8 activations with FC1 split over K: FC1's last-arriving program of each (group, N tile) sums the
    float32 partials in split order and writes the e4m3 intermediate (plan.split_sum). Right within e4m3's
    error, bitwise the same with PDL on and off and from one call to the next (the tickets are re-zeroed)."""
    x, tw, ids, kw = _inputs(T, 9, 512, 256, 2, torch.bfloat16, wfmt=wfmt, act="gelu_tanh", bias=True)
    cfg = _cfg(tmoe, mode, bk=64, bn1=64, split=split, a_fp8=True, swap=True)
    plan = tmoe.plan_call(
        T,
        512,
        9,
        256,
        2,
        x.dtype,
        kw["w13"].dtype,
        tuple(kw["block_shape"]) if "block_shape" in kw else None,
        "gelu_tanh",
        cfg,
        True,
        False,
        False,
        False,
    )
    assert plan.split == split and plan.split_sum, plan
    off = _run(tmoe, x, tw, ids, kw, config=cfg, pdl=False)
    _check(off, _reference(x, tw, ids, kw), TOL["fp8_a8"])
    assert torch.equal(_run(tmoe, x, tw, ids, kw, config=cfg, pdl=True), off)
    assert torch.equal(_run(tmoe, x, tw, ids, kw, config=cfg, pdl=True), off)


@pytest.mark.parametrize("mode,T", [("slot", 1), ("slot", 9), ("grouped", 40)])
@pytest.mark.parametrize("wfmt", ["16", "fp8_block"])
def test_kernel_boundary_options_bitwise_identical(tmoe, mode, T, wfmt):
    """w2 pulled into L2 by FC1, FC2 started early with a whole-slice prefetch, and PDL between our kernels
    on or off only move bytes and launches: the output is bitwise the same, and right."""
    x, tw, ids, kw = _inputs(T, 16, 512, 384, 4, torch.bfloat16, wfmt=wfmt)
    base = _cfg(tmoe, mode, swap=True, bn1=64, a_fp8=wfmt != "16")
    ref = _run(tmoe, x, tw, ids, kw, config=base, pdl=False)
    _check(ref, _reference(x, tw, ids, kw), TOL["fp8_a8"] if wfmt != "16" else TOL[torch.bfloat16])
    from dataclasses import replace

    variants = [
        replace(base, w2_l2=True),
        replace(base, chain=True),
        replace(base, early_launch=True, fc2=replace(base.fc2, prefetch=1 << 17)),
        replace(base, w2_l2=True, early_launch=True, fc2=replace(base.fc2, prefetch=1 << 17)),
    ]
    for cfg in variants:
        for pdl in (False, True):
            assert torch.equal(_run(tmoe, x, tw, ids, kw, config=cfg, pdl=pdl), ref), (cfg, pdl)


def test_non_contiguous_hidden_states_and_int32_ids(tmoe):
    x, tw, ids, kw = _inputs(9, 16, 512, 384, 4, torch.bfloat16)
    xs = torch.randn((9, 2 * 512), device="cuda", dtype=torch.bfloat16)[:, ::2]
    xs.copy_(x)
    assert not xs.is_contiguous()
    got = _run(tmoe, xs, tw.to(torch.bfloat16), ids.to(torch.int32), kw)
    _check(got, _reference(x, tw.to(torch.bfloat16), ids, kw), TOL[torch.bfloat16])


def test_zero_size_batch(tmoe):
    x, tw, ids, kw = _inputs(0, 16, 512, 384, 4, torch.bfloat16)
    got = tmoe.fused_moe(x, kw["w13"], kw["w2"], tw, ids)
    assert got.shape == (0, 512) and got.dtype == torch.bfloat16


@pytest.mark.parametrize("T,mode", [(1, "slot"), (8, "slot"), (40, "grouped"), (300, "prefill")])
@pytest.mark.parametrize("wfmt,swap", [("16", False), ("16", True), ("fp8_block", True)])
def test_pdl_on_off_bitwise_identical_and_deterministic(tmoe, T, mode, wfmt, swap):
    x, tw, ids, kw = _inputs(T, 16, 512, 384, 4, torch.bfloat16, wfmt=wfmt)
    cfg = _cfg(
        tmoe,
        mode,
        prefetch=16384 if mode != "prefill" else 0,
        swap=swap and mode != "prefill",
        a_fp8=wfmt != "16",
        bn1=64,
    )
    off = _run(tmoe, x, tw, ids, kw, config=cfg, pdl=False)
    on = _run(tmoe, x, tw, ids, kw, config=cfg, pdl=True)
    again = _run(tmoe, x, tw, ids, kw, config=cfg, pdl=True)
    assert torch.equal(off, on) and torch.equal(on, again)


def _captured(fn):
    """(a CUDA graph of ``fn()``, what the captured call returns): warmed up once on a side stream (kernels compile
    there, outside the capture), then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def test_pdl_inside_cuda_graph(tmoe):
    x, tw, ids, kw = _inputs(4, 16, 512, 384, 4, torch.bfloat16)
    eager = _run(tmoe, x, tw, ids, kw, pdl=False)
    args = (x, kw["w13"], kw["w2"], tw, ids)
    g, outs = _captured(lambda: [tmoe.fused_moe(*args, pdl=True) for _ in range(3)])
    g.replay()
    torch.cuda.synchronize()
    for o in outs:
        assert torch.equal(o, eager)
    # new routing written into the captured buffers is picked up on replay
    ids.copy_(torch.rand((4, 16), device="cuda").topk(4, dim=-1).indices)
    g.replay()
    torch.cuda.synchronize()
    _check(outs[0], _reference(x, tw, ids, kw), TOL[torch.bfloat16])


def _gemv_cfg(tmoe, mode, bm, fc1=True, fc2=True, bk1=128, split=1):
    G = tmoe.GemmConfig
    mma = _cfg(tmoe, mode, bn1=64, swap=True)
    return tmoe.MoEConfig(
        mode=mode,
        fc1=G(BM=bm, BN=16, BK=bk1, num_stages=1, gemv=True, split_k=split) if fc1 else mma.fc1,
        fc2=G(BM=bm, BN=32, BK=128, num_stages=1, gemv=True) if fc2 else mma.fc2,
    )


@pytest.mark.parametrize("wfmt", ["16", "fp8_tensor", "fp8_expert", "fp8_block"])
@pytest.mark.parametrize(
    "mode,T,bm", [("slot", 1, 1), ("slot", 3, 2), ("slot", 9, 4), ("slot", 9, 1), ("grouped", 40, 4)]
)
def test_gemv_form(tmoe, wfmt, mode, T, bm):
    """The reduction (GEMV) form in both GEMMs (FP8 weights converted in registers, bf16 activations): against the
    float64 reference, groups of more rows than a chunk included; PDL on and off and the kernel-boundary options
    bitwise the same as the plain launch (the sum over K has one order)."""
    from dataclasses import replace

    x, tw, ids, kw = _inputs(T, 16, 512, 384, 4, torch.bfloat16, wfmt=wfmt, act="gelu_tanh", bias=True)
    cfg = _gemv_cfg(tmoe, mode, bm)
    off = _run(tmoe, x, tw, ids, kw, config=cfg, pdl=False)
    _check(off, _reference(x, tw, ids, kw), TOL["fp8"] if wfmt != "16" else TOL[torch.bfloat16])
    early = replace(cfg, early_launch=True, fc2=replace(cfg.fc2, prefetch=1 << 16))
    for variant in (cfg, replace(cfg, w2_l2=True), replace(cfg, chain=True), early):
        assert torch.equal(_run(tmoe, x, tw, ids, kw, config=variant, pdl=True), off), variant


@pytest.mark.parametrize(
    "fc1,fc2,bk1,split", [(True, False, 256, 1), (False, True, 128, 1), (True, False, 128, 2)], ids=str
)
def test_gemv_form_with_the_mma_form(tmoe, fc1, fc2, bk1, split):
    """One GEMM in the GEMV form, the other swapped on the tensor cores; a K-split GEMV FC1 whose float32 partials
    FC2's MMA form sums: against the reference."""
    x, tw, ids, kw = _inputs(2, 16, 512, 384, 4, torch.bfloat16)
    cfg = _gemv_cfg(tmoe, "slot", 1, fc1=fc1, fc2=fc2, bk1=bk1, split=split)
    _check(_run(tmoe, x, tw, ids, kw, config=cfg), _reference(x, tw, ids, kw), TOL[torch.bfloat16])


def test_gemv_form_pdl_bitwise_under_graph_replay(tmoe):
    """A CUDA graph of GEMV-form calls with PDL replays bitwise what the calls without PDL compute."""
    x, tw, ids, kw = _inputs(1, 16, 512, 384, 4, torch.bfloat16, wfmt="fp8_block")
    cfg = _gemv_cfg(tmoe, "slot", 1)
    args = (x, kw["w13"], kw["w2"], tw, ids, "silu", None, None, kw["w13_scale"], kw["w2_scale"], kw["block_shape"])
    eager = tmoe.fused_moe(*args, config=cfg, pdl=False)
    g, outs = _captured(lambda: [tmoe.fused_moe(*args, config=cfg, pdl=True) for _ in range(3)])
    for _ in range(2):
        g.replay()
        torch.cuda.synchronize()
        for o in outs:
            assert torch.equal(o, eager)


def test_registry_and_op(tmoe):
    from rubin_compile.ops.moe import MOE
    from rubin_compile.target import detect

    assert MOE.kernel("triton").unavailable_here(detect()) is None
    x, tw, ids, kw = _inputs(3, 16, 512, 384, 4, torch.bfloat16)
    got = torch.ops.rubin.moe(x, kw["w13"], kw["w2"], tw, ids, impl="triton")
    _check(got, _reference(x, tw, ids, kw), TOL[torch.bfloat16])


# ------------------------------------------------------------------ the persistent prefill path (moe_prefill.py)


def _persistent_cfg(tmoe, tile=0, fp8=False, w8a16=False, variant=False):
    """One of the tuner's persistent tiles (tune_moe.PERSISTENT_TILES, the FP8 ones, or the W8A16 ones; ``variant``:
    those with options of the persistent grids, PERSISTENT_VARIANTS*) as a config."""
    kind = "w8a16" if w8a16 else "fp8" if fp8 else "bf16"
    return _tm.persistent_config(tmoe, (VARIANTS if variant else TILES)[kind][tile], a_fp8=fp8)


try:
    from rubin_compile.kernels.triton import tune_moe as _tm

    TILES = {"bf16": _tm.PERSISTENT_TILES, "fp8": _tm.PERSISTENT_TILES_FP8, "w8a16": _tm.PERSISTENT_TILES_W8A16}
    VARIANTS = {
        "bf16": _tm.PERSISTENT_VARIANTS,
        "fp8": _tm.PERSISTENT_VARIANTS_FP8,
        "w8a16": _tm.PERSISTENT_VARIANTS_W8A16,
    }
except ImportError:  # no Triton here: the module is skipped anyway
    TILES = VARIANTS = {"bf16": (), "fp8": (), "w8a16": ()}
PERSISTENT_TILES, PERSISTENT_TILES_FP8, PERSISTENT_TILES_W8A16 = TILES["bf16"], TILES["fp8"], TILES["w8a16"]
VARIANT_CASES = [(kind, i) for kind, tiles in VARIANTS.items() for i in range(len(tiles))]
PERSISTENT_CASES = [(tile, (300, 16, 512, 384, 4)) for tile in range(len(PERSISTENT_TILES))] + [
    (tile, shape) for tile in (0, 4) for shape in ((1000, 64, 1024, 256, 8), (37, 9, 328, 200, 2))
]


@pytest.mark.parametrize("tile,shape", PERSISTENT_CASES, ids=[f"tile{t}-T{s[0]}-E{s[1]}" for t, s in PERSISTENT_CASES])
def test_persistent_path(tmoe, tile, shape):
    """Every tuner tile against the reference, two of them on more shapes: many experts at k = 8, and H, I that are
    not multiples of the tiles (but of 8, as TMA needs) with few tokens."""
    T, E, H, I, k = shape
    x, tw, ids, kw = _inputs(T, E, H, I, k, torch.bfloat16)
    cfg = _persistent_cfg(tmoe, tile)
    _check(_run(tmoe, x, tw, ids, kw, config=cfg), _reference(x, tw, ids, kw), TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("route", ["random", "skewed", "one_expert"])
@pytest.mark.parametrize("act,bias", [("silu", False), ("gelu_tanh", True)])
def test_persistent_path_routings_dtypes_epilogues(tmoe, dtype, route, act, bias):
    """Skewed routing (most experts empty, a few with many M tiles), every slot on one expert, fp16, GELU and
    biases."""
    x, tw, ids, kw = _inputs(512, 32, 512, 384, 4, dtype, act=act, bias=bias, route=route)
    _check(_run(tmoe, x, tw, ids, kw, config=_persistent_cfg(tmoe, 4)), _reference(x, tw, ids, kw), TOL[dtype])


@pytest.mark.parametrize("tile", range(len(PERSISTENT_TILES_FP8)))
@pytest.mark.parametrize("wfmt", ["fp8_block", "fp8_expert", "fp8_tensor"])
def test_persistent_path_fp8(tmoe, tile, wfmt):
    """FP8 weights with e4m3 activations (quantised once per call per FC1 K tile; the intermediate per FC1 N tile):
    128 x 128 block scales, one scale per expert, one per tensor; within e4m3's error of the reference."""
    x, tw, ids, kw = _inputs(300, 16, 512, 384, 4, torch.bfloat16, wfmt=wfmt)
    cfg = _persistent_cfg(tmoe, tile, fp8=True)
    _check(_run(tmoe, x, tw, ids, kw, config=cfg), _reference(x, tw, ids, kw), TOL["fp8_a8"])


@pytest.mark.parametrize("tile", range(len(PERSISTENT_TILES_W8A16)))
@pytest.mark.parametrize("wfmt", ["fp8_block", "fp8_expert", "fp8_tensor"])
def test_persistent_path_w8a16(tmoe, tile, wfmt):
    """FP8 weights with the activations kept in bf16 (a_fp8=False): each weight tile dequantised in registers (its
    block scales applied, rounded to bf16) and multiplied on the bf16 tensor cores; within FP8 weights' tolerance of
    the reference, which dequantises the same weights."""
    x, tw, ids, kw = _inputs(300, 16, 512, 384, 4, torch.bfloat16, wfmt=wfmt)
    cfg = _persistent_cfg(tmoe, tile, w8a16=True)
    _check(_run(tmoe, x, tw, ids, kw, config=cfg), _reference(x, tw, ids, kw), TOL["fp8"])


@pytest.mark.parametrize("kind,tile", VARIANT_CASES, ids=[f"{k}-{i}" for k, i in VARIANT_CASES])
def test_persistent_path_variants(tmoe, kind, tile):
    """The tuner's tiles with options of the persistent grids (two programs per SM, a flattened item loop): each
    program walks many work items; the result matches the reference and is bitwise the same tiles' without the
    options (neither which program computes an item nor the loop's shape changes a value), and 8 calls back to back
    with PDL are bitwise equal."""
    T, E, H, I, k = 2048, 64, 1024, 768, 8
    wfmt = "16" if kind == "bf16" else "fp8_block"  # _inputs' "16": weights in the activations' dtype
    x, tw, ids, kw = _inputs(T, E, H, I, k, torch.bfloat16, wfmt=wfmt)
    assert (kw["w13"].dtype == torch.bfloat16) == (kind == "bf16")
    cfg = _persistent_cfg(tmoe, tile, fp8=kind == "fp8", w8a16=kind == "w8a16", variant=True)
    assert (
        max(cfg.fc1.occupancy, cfg.fc2.occupancy) == 2
        or cfg.fc1.flatten
        or cfg.fc2.flatten
        or cfg.fc1.join
        or cfg.fc2.gluon
    )
    args = (x, kw["w13"], kw["w2"], tw, ids, "silu", None, None, kw.get("w13_scale"), kw.get("w2_scale"))
    args += (kw.get("block_shape"),)
    got = _run(tmoe, x, tw, ids, kw, config=cfg, pdl=False)
    tol = TOL[torch.bfloat16] if kind == "bf16" else TOL["fp8_a8"] if kind == "fp8" else TOL["fp8"]
    _check(got, _reference(x, tw, ids, kw), tol)
    plain = dict(occupancy=1, flatten=False)
    one = dataclasses.replace(
        cfg,
        # a Gluon FC1 is joined by construction (one MMA over the gate and up tiles): it keeps join
        fc1=dataclasses.replace(cfg.fc1, join=cfg.fc1.gluon, **plain),
        fc2=dataclasses.replace(cfg.fc2, **plain),
    )
    assert torch.equal(tmoe.fused_moe(*args, config=one, pdl=False), got)
    outs = [tmoe.fused_moe(*args, config=cfg, pdl=True) for _ in range(8)]
    torch.cuda.synchronize()
    assert all(torch.equal(o, got) for o in outs)


# (a Gluon FC1 is joined by construction; its H, I off the tiles are test_persistent_path_gluon's "ragged" shape)
JOIN_CASES = [
    (kind, i)
    for kind, i in VARIANT_CASES
    if VARIANTS[kind][i][-1].get("join") and not VARIANTS[kind][i][-1].get("gluon", (False,))[0]
]


@pytest.mark.parametrize("kind,tile", JOIN_CASES, ids=[f"{k}-{i}" for k, i in JOIN_CASES])
def test_persistent_path_joined_tiles_past_i(tmoe, kind, tile):
    """Joined FC1 tiles (GemmConfig.join: the gate and up tiles in one TMA box over w13 seen as [E * 2, I, H]) where I
    is not a multiple of the tile (the box's zero fill past I) and, FP8, not of the 128-row scale blocks (so the up
    tile's scales are per column): against the reference, and bitwise the same tiles unjoined."""
    T, E, k = 37, 9, 2
    H, I = (328, 200) if kind == "bf16" else (336, 208)  # noqa: E741  (TMA rows of 16 bytes: e4m3 in 16s)
    wfmt = "16" if kind == "bf16" else "fp8_block"
    x, tw, ids, kw = _inputs(T, E, H, I, k, torch.bfloat16, wfmt=wfmt, bias=True, act="gelu_tanh")
    cfg = _persistent_cfg(tmoe, tile, fp8=kind == "fp8", w8a16=kind == "w8a16", variant=True)
    got = _run(tmoe, x, tw, ids, kw, config=cfg, pdl=False)
    tol = TOL[torch.bfloat16] if kind == "bf16" else TOL["fp8_a8"] if kind == "fp8" else TOL["fp8"]
    _check(got, _reference(x, tw, ids, kw), tol)
    apart = dataclasses.replace(cfg, fc1=dataclasses.replace(cfg.fc1, join=False))
    assert torch.equal(_run(tmoe, x, tw, ids, kw, config=apart, pdl=False), got)


GLUON_CASES = [i for i, t in enumerate(VARIANTS["fp8"]) if any(t[-1].get("gluon", ()))]
GLUON_SHAPES = {"prefill": (2048, 64, 1024, 768, 8), "ragged": (37, 9, 336, 208, 2)}


@pytest.mark.parametrize("shape", list(GLUON_SHAPES))
@pytest.mark.parametrize("wfmt", ["fp8_block", "fp8_expert", "fp8_tensor"])
@pytest.mark.parametrize("tile", GLUON_CASES)
def test_persistent_path_gluon(tmoe, tile, wfmt, shape):
    """The Gluon GEMMs (GemmConfig.gluon; moe_prefill_gluon.py: the next K step's MMA in flight while this one's
    product is scaled) run, and match: the reference within e4m3's tolerance; the Triton kernels on the same tiles
    within one rounding of the output to bf16 (the same float32 operations per element; only the MMA's own summation
    may differ, and FC1's e4m3 intermediate with it); themselves bitwise with PDL on, 8 calls back to back, and
    replayed in a CUDA graph. "ragged": H and I not multiples of the tiles (zero fill past H and I, columns past I or
    H never stored), biases, GELU."""
    from rubin_compile.kernels.triton import moe_prefill_gluon as gk
    from rubin_compile.kernels.triton import moe_prefill_ws as wk
    from rubin_compile.kernels.triton.launch import launcher

    assert gk.GLUON, "the GPU machine's Triton has Gluon (>= 3.5)"
    T, E, H, I, k = GLUON_SHAPES[shape]
    bias = shape == "ragged"
    x, tw, ids, kw = _inputs(T, E, H, I, k, torch.bfloat16, wfmt=wfmt, bias=bias, act="gelu_tanh" if bias else "silu")
    cfg = _persistent_cfg(tmoe, tile, fp8=True, variant=True)
    kernels = [gk._fc1_w8a8_kernel, gk._fc2_w8a8_kernel, wk._fc1_ws_kernel, wk._fc2_ws_kernel]
    kernels = [launcher(fn) for fn in kernels]
    before = [ran.hits + ran.misses for ran in kernels]
    got = _run(tmoe, x, tw, ids, kw, config=cfg, pdl=False)
    ran = [ran.hits + ran.misses - b for ran, b in zip(kernels, before)]
    # block scales over a Gluon FC1 need I a multiple of the 128-row blocks (one scale per tile); elsewhere the
    # Triton FC1 runs the same tiles
    fc1 = cfg.fc1.gluon and (wfmt != "fp8_block" or I % 128 == 0)
    want_ran = [fc1 and not cfg.fc1.ws, cfg.fc2.gluon and not cfg.fc2.ws, fc1 and cfg.fc1.ws, cfg.fc2.ws]
    assert ran == [int(r) for r in want_ran], f"Gluon FC1 / FC2, warp-specialized FC1 / FC2 launches {ran}"
    _check(got, _reference(x, tw, ids, kw), TOL["fp8_a8"])
    # the Triton kernels on the same tiles (a warp-specialized GEMM's 128 rows at 8 warps, as run() falls back)
    tri = dataclasses.replace(
        cfg,
        fc1=dataclasses.replace(
            cfg.fc1, gluon=False, ws=False, unroll=2, num_warps=8 if cfg.fc1.ws else cfg.fc1.num_warps
        ),
        fc2=dataclasses.replace(
            cfg.fc2, gluon=False, ws=False, unroll=2, num_warps=8 if cfg.fc2.ws else cfg.fc2.num_warps
        ),
    )
    want = _run(tmoe, x, tw, ids, kw, config=tri, pdl=False)
    gap = ((got.double() - want.double()).norm() / want.double().norm()).item()
    # FC2 alone: the same operations, one bf16 rounding apart; a Gluon FC1 may round an intermediate element to the
    # neighbouring e4m3 value (its MMA's own summation order), a step of 2^-3 relative that FC2 carries: for the few
    # elements that differ, at most 2^-5 of the output's norm
    assert gap <= (2**-5 if cfg.fc1.gluon else 2**-8), (gap, torch.equal(got, want))
    args = (x, kw["w13"], kw["w2"], tw, ids, kw["activation"], kw.get("w13_bias"), kw.get("w2_bias"))
    args += (kw.get("w13_scale"), kw.get("w2_scale"), kw.get("block_shape"))
    outs = [tmoe.fused_moe(*args, config=cfg, pdl=True) for _ in range(8)]
    torch.cuda.synchronize()
    assert all(torch.equal(o, got) for o in outs)
    g, out = _captured(lambda: tmoe.fused_moe(*args, config=cfg, pdl=True))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)


def test_persistent_path_takes_other_modes_where_it_cannot_run(tmoe):
    """Rows that are not whole 16 bytes for TMA (FP8 with I = 200; bf16 with H = 324): the call runs another mode,
    still right."""
    x, tw, ids, kw = _inputs(300, 9, 320, 200, 2, torch.bfloat16, wfmt="fp8_block")
    cfg = _persistent_cfg(tmoe, fp8=True)
    _check(_run(tmoe, x, tw, ids, kw, config=cfg), _reference(x, tw, ids, kw), TOL["fp8_a8"])
    x, tw, ids, kw = _inputs(300, 9, 324, 200, 2, torch.bfloat16)
    _check(_run(tmoe, x, tw, ids, kw, config=_persistent_cfg(tmoe)), _reference(x, tw, ids, kw), TOL[torch.bfloat16])


def test_persistent_path_deterministic_pdl_bitwise_and_replayed_with_new_routing(tmoe):
    """Bitwise the same run to run and with PDL on and off (the slots' order within an expert's run varies with the
    atomics; no value depends on it); a CUDA graph of it replays with routing written into its inputs afterwards,
    bitwise what an eager call on that routing computes."""
    T, E, H, I, k = 700, 32, 512, 384, 8
    x, tw, ids, kw = _inputs(T, E, H, I, k, torch.bfloat16)
    cfg = _persistent_cfg(tmoe, 1)
    args = (x, kw["w13"], kw["w2"], tw, ids, "silu")
    first = tmoe.fused_moe(*args, config=cfg, pdl=False)
    for pdl in (False, True, True):
        assert torch.equal(tmoe.fused_moe(*args, config=cfg, pdl=pdl), first)
    g, out = _captured(lambda: tmoe.fused_moe(*args, config=cfg, pdl=True))
    for seed in (1, 2):
        x2, tw2, ids2, _ = _inputs(T, E, H, I, k, torch.bfloat16, seed=seed, route="skewed" if seed == 2 else "random")
        x.copy_(x2), tw.copy_(tw2), ids.copy_(ids2)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, tmoe.fused_moe(*args, config=cfg, pdl=False)), seed


def test_persistent_path_back_to_back_with_pdl_at_prefill_size(tmoe):
    """Many calls back to back with PDL at a prefill size, one sync at the end: every result equal to the first. A
    kernel that wrote its TMA descriptors before gdc_wait raced the previous kernel for the reused scratch block
    (an illegal address on the H100, only without CUDA_LAUNCH_BLOCKING); each config of the tuner's tiles."""
    T, E, H, I, k = 2048, 64, 1024, 768, 8
    x, tw, ids, kw = _inputs(T, E, H, I, k, torch.bfloat16)
    for tile in range(len(PERSISTENT_TILES)):
        cfg = _persistent_cfg(tmoe, tile)
        outs = [tmoe.fused_moe(x, kw["w13"], kw["w2"], tw, ids, "silu", config=cfg, pdl=True) for _ in range(16)]
        torch.cuda.synchronize()
        assert all(torch.equal(o, outs[0]) for o in outs), tile
    _check(outs[0], _reference(x, tw, ids, kw), TOL[torch.bfloat16])


# ------------------------------------------------------------------ the fused decode path (moe_decode.py)


def _fused_cfg(tmoe, fc1=(32, 128, 4, 1), fc2=(16, 128, 4, 1), grid=(4, 1), prefetch=0):
    G = tmoe.GemmConfig
    (bn1, bk1, ns1, split), (bn2, bk2, ns2, groups), (w, o) = fc1, fc2, grid
    return tmoe.MoEConfig(
        mode="fused",
        fc1=G(BM=16, BN=bn1, BK=bk1, num_warps=w, num_stages=ns1, occupancy=o, split_k=split),
        fc2=G(BM=16, BN=bn2, BK=bk2, num_warps=w, num_stages=ns2, occupancy=o, prefetch=prefetch, split_k=groups),
    )


def _fused_tuner_cfgs(tmoe):
    """Every config the tuner tries for the fused path."""
    from rubin_compile.kernels.triton.tune_moe import fused_candidates

    return fused_candidates(tmoe, 1, "bf16")


@pytest.mark.parametrize("shape", [(128, 2048, 768, 8), (256, 7168, 256, 8)], ids=["qwen3", "deepseek-v3-tp8"])
def test_fused_decode_path_every_tuner_config(tmoe, shape):
    """Each config the tuner tries, at Qwen3-30B-A3B / DeepSeek-V3 TP8 sizes, T = 1 and 4: right, and the workspace's
    counters left zero."""
    from rubin_compile.kernels.triton import moe_decode

    E, H, I, k = shape
    for T in (1, 4):
        x, tw, ids, kw = _inputs(T, E, H, I, k, torch.bfloat16)
        ref = _reference(x, tw, ids, kw)
        for cfg in _fused_tuner_cfgs(tmoe):
            _check(_run(tmoe, x, tw, ids, kw, config=cfg, pdl=True), ref, TOL[torch.bfloat16])
            assert int(moe_decode.workspace(x.device).abs().sum()) == 0, cfg


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("route", ["random", "one_expert", "skewed"])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_fused_decode_path_routings_dtypes_ragged_tiles(tmoe, dtype, route, act):
    """H = 328, I = 200: no tile divides them (masked rows and K steps in both GEMMs), FC1 split over K into 3 ranges
    (the last one short); T = 1, 3, 8, 64 (MAX_T)."""
    for T in (1, 3, 8, 64):
        x, tw, ids, kw = _inputs(T, 16, 328, 200, 4, dtype, act=act, route=route)
        cfg = _fused_cfg(tmoe, fc1=(16, 64, 3, 3), fc2=(32, 128, 2, 3), grid=(4, 2), prefetch=32768)
        _check(_run(tmoe, x, tw, ids, kw, config=cfg), _reference(x, tw, ids, kw), TOL[dtype])


def test_fused_decode_path_deterministic_pdl_bitwise_and_replayed_with_new_routing(tmoe):
    """Bitwise the same run to run, with PDL on and off, back to back with one sync at the end (each call resets the
    counters the next one reads), and in a CUDA graph replayed with new routing written into its inputs."""
    T, E, H, I, k = 2, 128, 2048, 768, 8
    x, tw, ids, kw = _inputs(T, E, H, I, k, torch.bfloat16)
    cfg = _fused_cfg(tmoe, fc1=(16, 128, 4, 4), fc2=(32, 128, 4, 4), grid=(4, 2), prefetch=32768)
    args = (x, kw["w13"], kw["w2"], tw, ids, "silu")
    first = tmoe.fused_moe(*args, config=cfg, pdl=False)
    outs = [tmoe.fused_moe(*args, config=cfg, pdl=pdl) for pdl in (True, False) * 8]
    torch.cuda.synchronize()
    assert all(torch.equal(o, first) for o in outs)
    g, outs = _captured(lambda: [tmoe.fused_moe(*args, config=cfg, pdl=True) for _ in range(3)])
    for seed in (1, 2):
        x2, tw2, ids2, _ = _inputs(T, E, H, I, k, torch.bfloat16, seed=seed, route="skewed" if seed == 2 else "random")
        x.copy_(x2), tw.copy_(tw2), ids.copy_(ids2)
        g.replay()
        torch.cuda.synchronize()
        eager = tmoe.fused_moe(*args, config=cfg, pdl=False)
        assert all(torch.equal(o, eager) for o in outs), seed
        _check(eager, _reference(x, tw, ids, kw), TOL[torch.bfloat16])


def test_fused_decode_path_takes_slot_mode_where_it_cannot_run(tmoe):
    """FP8 weights, biases, more than MAX_T tokens: the call runs the slot / grouped kernels, still right."""
    cfg = _fused_cfg(tmoe)
    x, tw, ids, kw = _inputs(2, 16, 512, 384, 4, torch.bfloat16, wfmt="fp8_block")
    _check(_run(tmoe, x, tw, ids, kw, config=cfg), _reference(x, tw, ids, kw), TOL["fp8_a8"])
    x, tw, ids, kw = _inputs(2, 16, 512, 384, 4, torch.bfloat16, bias=True)
    _check(_run(tmoe, x, tw, ids, kw, config=cfg), _reference(x, tw, ids, kw), TOL[torch.bfloat16])
    x, tw, ids, kw = _inputs(70, 16, 512, 384, 2, torch.bfloat16)
    _check(_run(tmoe, x, tw, ids, kw, config=cfg), _reference(x, tw, ids, kw), TOL[torch.bfloat16])
