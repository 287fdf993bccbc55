"""The fused-MoE kernels compiled ahead of time for sm_90 on a machine without a GPU (Triton's own ptxas):
every option of the decode path compiles, and the PTX holds what the design says it does (one
griddepcontrol.wait; launch_dependents also right after it with early_launch; the L2 prefetch instruction
where w2 -> L2 or FC2's prefetch is on; wgmma for swapped tiles), and, compiled with the specialisations
a real launch gets, the weight tiles still stream through 16-byte cp.async copies (a kernel that loses
them runs 2-3x slower: benchmarks/results/moe-regression-bisect-h200.log). Catches a kernel that would
fail to compile on the H200, or lose its vectorised pipeline, before a GPU session is spent on it; what it
does not check -- numerics and speed -- tests/gpu does on the GPU."""

from __future__ import annotations

import re
import sys

import pytest

from tests.cpu.kernels.triton_aot import (
    async_copy_sizes,
    compile_like_a_launch,
    compile_sm90,
    load_plain,
    loop_bodies,
    resident_per_sm,
    resource_usage,
)

BF = "*bf16"


@pytest.fixture(scope="module")
def kernels():
    """kernels/triton/moe.py loaded as a plain module (the package refuses to import without CUDA)."""
    yield load_plain("moe", "rubin_moe_aot")
    del sys.modules["rubin_moe_aot"]


# What a Qwen3-30B-A3B decode call passes (H = 2048, I = 768; contiguous weights and activations)
QWEN3_INTS = dict(
    H=2048,
    I=768,
    N_UP=768,
    KCH=1024,
    S=8,
    K_TOP=8,
    cnt_numel=32,
    stride_xt=2048,
    stride_xh=1,
    stride_we=1536 * 2048,
    stride_wn=2048,
    stride_wk=1,
    stride_it=768,
    stride_is=8 * 768,
    stride_w2e=2048 * 768,
    stride_at=768,
    stride_as=8 * 768,
    stride_pt=2048,
    stride_ot=2048,
    stride_xst=16,
    stride_ist=12,
    stride_qit=768,
    stride_ast=12,
    SCALE_BN=1,
    SCALE_BK=1,
)


FC1_PTRS = {
    "x_ptr": BF,
    "xs_ptr": "*fp32",
    "isc_ptr": "*fp32",
    "qi_ptr": "*fp8e4nv",
    "tick_ptr": "*i32",
    "w_ptr": BF,
    "b_ptr": BF,
    "w2_ptr": BF,
    "ws_ptr": "*fp32",
    "ids_ptr": "*i64",
    "sorted_ptr": "*i32",
    "gexp_ptr": "*i32",
    "gstart_ptr": "*i32",
    "gcount_ptr": "*i32",
    "cnt_ptr": "*i32",
}
FC1 = dict(
    ACT=0,
    HAS_BIAS=False,
    W_SCALE=0,
    A_FP8=False,
    A_PRE=False,
    Q_OUT=False,
    DOT_PREC="tf32",
    ROUTE=0,
    SLOT_P2=64,
    BM=16,
    BN=32,
    BK=128,
    EVEN_K=True,
    GDC=True,
    PREFETCH=0,
    PF_CHUNK=16,
    SWAP=False,
    SPLIT=1,
    SPLIT_SUM=False,
    EARLY=False,
    W2_L2=0,
    W2_CHUNK=16,
    GEMV=False,
)
FC2_PTRS = {
    "as_ptr": "*fp32",
    "w_ptr": BF,
    "b_ptr": BF,
    "part_ptr": BF,
    "out_ptr": BF,
    "ws_ptr": "*fp32",
    "ids_ptr": "*i64",
    "tw_ptr": "*fp32",
    "sorted_ptr": "*i32",
    "gexp_ptr": "*i32",
    "gstart_ptr": "*i32",
    "gcount_ptr": "*i32",
    "cnt_ptr": "*i32",
}
FC2 = dict(
    HAS_BIAS=False,
    W_SCALE=0,
    A_FP8=False,
    A_PRE=False,
    DOT_PREC="tf32",
    ROUTE=0,
    SLOT_P2=64,
    BM=16,
    BN=64,
    BK=128,
    EVEN_K=True,
    GDC=True,
    PREFETCH=0,
    PF_CHUNK=16,
    FUSED_SUM=True,
    SWAP=False,
    SPLIT1=1,
    ACT=0,
    GEMV=False,
)


@pytest.mark.parametrize(
    "over,split",
    [
        ({}, 1),
        ({"SPLIT": 4, "HAS_BIAS": True, "ACT": 1}, 4),
        ({"SPLIT": 2, "SWAP": True, "BN": 64, "BK": 64, "ROUTE": 1}, 2),
        ({"W2_L2": 16 * 128 * 96, "W2_CHUNK": 16 * 96, "EARLY": True}, 1),
        ({"SPLIT": 2, "W2_L2": 16 * 128 * 48, "W2_CHUNK": 16 * 48, "EARLY": True, "ROUTE": 1}, 2),
    ],
    ids=["plain", "split4-bias-gelu", "split2-swap-grouped", "w2l2-early", "split2-w2l2-early-grouped"],
)
def test_fc1_variants_compile_for_sm90(kernels, over, split):
    ptx = compile_sm90(
        kernels._moe_fc1_kernel, dict(FC1, **over), dict(FC1_PTRS, inter_ptr="*fp32" if split > 1 else BF)
    )
    assert ptx.count("griddepcontrol.wait") == 1
    assert ptx.count("griddepcontrol.launch_dependents") == (2 if over.get("EARLY") else 1)
    assert ptx.count("cp.async.bulk.prefetch.L2") == (1 if over.get("W2_L2") else 0)
    assert ("wgmma.mma_async" in ptx) == bool(over.get("SWAP"))


@pytest.mark.parametrize(
    "over,stages",
    [
        ({}, 4),
        ({"SPLIT1": 4}, 4),
        ({"SPLIT1": 2, "SWAP": True, "ACT": 1}, 4),
        ({"SPLIT1": 8}, 2),
        ({"PREFETCH": 131072, "PF_CHUNK": 1024}, 4),
    ],
    ids=["plain", "split4", "split2-swap-gelu", "split8-2-stages", "prefetch"],
)
def test_fc2_variants_compile_for_sm90(kernels, over, stages):
    ptx = compile_sm90(
        kernels._moe_fc2_kernel,
        dict(FC2, **over),
        dict(FC2_PTRS, a_ptr="*fp32" if over.get("SPLIT1", 1) > 1 else BF),
        num_stages=stages,
    )
    assert ptx.count("griddepcontrol.wait") == 1 and ptx.count("griddepcontrol.launch_dependents") == 1
    assert ptx.count("cp.async.bulk.prefetch.L2") == (1 if over.get("PREFETCH") else 0)


@pytest.mark.parametrize(
    "which,over",
    [
        ("fc1", {}),
        ("fc1", {"SPLIT": 2}),
        ("fc1", {"SWAP": True, "BN": 64, "BK": 64}),
        ("fc2", {}),
        ("fc2", {"SWAP": True}),
    ],
    ids=["fc1", "fc1-split2", "fc1-swap", "fc2", "fc2-swap"],
)
def test_weight_tiles_stream_through_16_byte_async_copies(kernels, which, over):
    """The decode kernels are bound by streaming weights: compiled as a launch specialises them, every
    global-to-shared copy is 16 bytes wide (vectorised, software-pipelined), and no weight or activation
    element is loaded on its own (2-byte loads: what a runtime K offset of unknown alignment caused)."""
    if which == "fc1":
        fn, consts = kernels._moe_fc1_kernel, dict(FC1, **{"BN": 16, **over})
        ptrs = dict(FC1_PTRS, inter_ptr="*fp32" if over.get("SPLIT", 1) > 1 else BF)
    else:
        fn, consts, ptrs = kernels._moe_fc2_kernel, dict(FC2, **over), dict(FC2_PTRS, a_ptr=BF)
    ptx = compile_like_a_launch(fn, consts, ptrs, QWEN3_INTS)
    assert async_copy_sizes(ptx) == {"0x10"}, async_copy_sizes(ptx)
    assert not re.findall(r"ld\.global(?:\.\w+)*\.b16 ", ptx)


def _k_loop_body(ttgir: str) -> str:
    """The TTGIR of the K loop: from the scf.for that holds the first MMA to its scf.yield."""
    lines = ttgir.splitlines()
    mma = next(i for i, ln in enumerate(lines) if "warp_group_dot " in ln or "tt.dot " in ln)
    start = max(i for i in range(mma) if "scf.for" in lines[i])
    end = next(i for i in range(mma, len(lines)) if "scf.yield" in lines[i])
    return "\n".join(lines[start : end + 1])


F8 = "*fp8e4nv"
FP8_BLOCK_INTS = dict(QWEN3_INTS, SCALE_BN=128, SCALE_BK=128, stride_se=12 * 16, stride_sn=16, stride_sk=1)


@pytest.mark.parametrize(
    "which,over,pre",
    [
        ("fc1", {"BK": 128, "W_SCALE": 2}, True),
        ("fc1", {"BK": 128, "W_SCALE": 1}, True),
        ("fc2", {"BK": 64, "W_SCALE": 2}, True),
        ("fc2", {"BK": 128, "W_SCALE": 2, "SPLIT1": 2}, False),
    ],
    ids=["fc1-block", "fc1-tensor", "fc2-block", "fc2-after-split-fc1"],
)
def test_fp8_activation_k_loop_has_no_quantisation_in_it(kernels, which, over, pre):
    """With FP8 activations, the activations arrive in e4m3 (quantised once before FC1, FC2's intermediate by
    FC1's epilogue): the K loop streams them through 16-byte async copies with the weights and runs FP8 wgmma
    on them straight from shared memory -- no amax reduction and no register -> shared store per K step (what
    kept FP8 at T = 1 slower than bf16 on the H200). Only FC2 after a K-split FC1 still quantises in the loop."""
    common = dict(SWAP=True, BN=64, A_FP8=True, A_PRE=pre, **over)
    if which == "fc1":
        fn, consts = kernels._moe_fc1_kernel, dict(FC1, Q_OUT=True, **common)
        ptrs = dict(FC1_PTRS, x_ptr=F8, w_ptr=F8, inter_ptr=F8, w2_ptr=F8)
    else:
        fn, consts = kernels._moe_fc2_kernel, dict(FC2, **common)
        ptrs = dict(FC2_PTRS, a_ptr=F8 if pre else "*fp32", w_ptr=F8)
    asm = {}
    ptx = compile_like_a_launch(fn, consts, ptrs, FP8_BLOCK_INTS, num_stages=3, asm=asm)
    body = _k_loop_body(asm["ttgir"])
    assert "f8E4M3FN" in body and "warp_group_dot" in body
    if pre:
        assert "tt.reduce" not in body and not re.search(r"ttg\.local_alloc %", body), body
        assert async_copy_sizes(ptx) <= {"0x10", "0x8", "0x4"}
    else:
        assert "tt.reduce" in body  # the in-loop quantisation this path keeps
    assert ptx.count("griddepcontrol.wait") == 1


def test_k_split_fc1_sums_its_own_partials_for_sm90(kernels):
    """FP8 activations with FC1 split over K: every program stores float32 partials and takes one acq_rel
    arrival ticket; the last one re-reads the partials through L2 (.cg) and writes the e4m3 intermediate."""
    consts = dict(FC1, SWAP=True, BN=64, A_FP8=True, A_PRE=True, W_SCALE=2, SPLIT=4, SPLIT_SUM=True, BK=128)
    ptrs = dict(FC1_PTRS, x_ptr=F8, w_ptr=F8, inter_ptr="*fp32", w2_ptr=F8)
    ptx = compile_like_a_launch(kernels._moe_fc1_kernel, consts, ptrs, dict(FP8_BLOCK_INTS, KCH=512), num_stages=4)
    atoms = re.findall(r"atom\S*", ptx)
    assert atoms == ["atom.global.gpu.acq_rel.add.u32"], atoms
    assert re.search(r"ld\.global\.cg", ptx)
    assert ptx.count("griddepcontrol.wait") == 1


@pytest.mark.parametrize(
    "which,over,ptr",
    [
        ("fc1", dict(BM=1, BN=16, BK=128), BF),
        ("fc1", dict(BM=2, BN=16, BK=128, ACT=1, HAS_BIAS=True, ROUTE=1), BF),
        ("fc1", dict(BM=1, BN=16, BK=128, W_SCALE=2), F8),
        ("fc2", dict(BM=1, BN=32, BK=256), BF),
        ("fc2", dict(BM=4, BN=16, BK=128, W_SCALE=1), F8),
        ("fc2", dict(BM=1, BN=16, BK=128, W_SCALE=2), F8),
    ],
    ids=["fc1-m1", "fc1-m2-gelu-bias-grouped", "fc1-fp8-block", "fc2-m1", "fc2-m4-fp8-tensor", "fc2-fp8-block"],
)
def test_gemv_k_loop_streams_without_barriers(kernels, which, over, ptr):
    """The reduction (GEMV) form's K loop, compiled as a launch specialises it (Qwen3-30B-A3B's strides): vector
    weight and activation loads and float32 FMAs, no barrier, shuffle, shared memory or MMA in it (the MMA forms
    stage every tile through shared memory behind barriers). bf16 weights in 16-byte loads; FP8 weights in 8-byte
    loads, the activations' layout (with 16-byte FP8 loads the products needed 2-8 barriers per tile); with block
    scales one scalar scale per tile and weight matrix (FC1 reads gate and up)."""
    consts = dict(FC1 if which == "fc1" else FC2, GEMV=True, **over)
    if which == "fc1":
        fn, ptrs = kernels._moe_fc1_kernel, dict(FC1_PTRS, w_ptr=ptr, w2_ptr=ptr, inter_ptr=BF)
    else:
        fn, ptrs = kernels._moe_fc2_kernel, dict(FC2_PTRS, a_ptr=BF, w_ptr=ptr)
    ints = FP8_BLOCK_INTS if over.get("W_SCALE") == 2 else QWEN3_INTS
    ptx = compile_like_a_launch(fn, consts, ptrs, ints, num_stages=1)
    loops = [body for body in loop_bodies(ptx) if any("fma.rn.f32" in ln for ln in body)]
    assert len(loops) == 1, [len(b) for b in loops]
    (loop,) = loops
    said = {op: sum(op in ln for ln in loop) for op in ("bar.sync", "shfl", "ld.shared", "st.shared", "mma")}
    assert all(v == 0 for v in said.values()), said
    loads = [ln for ln in loop if "ld.global" in ln]
    wide = [ln for ln in loads if ".v4.b32" in ln or ".v2.b32" in ln]
    scalar = [ln for ln in loads if ln not in wide]
    assert len(scalar) == (0 if over.get("W_SCALE") != 2 else 2 if which == "fc1" else 1), scalar
    assert all(".b32" in ln for ln in scalar), scalar  # the float32 scales, not weight elements one by one
    if ptr == BF:
        assert wide and all(".v4.b32" in ln for ln in wide), wide
    else:
        assert any(".v2.b32" in ln for ln in wide) and any(".v4.b32" in ln for ln in wide), wide
    assert "mma" not in ptx and "cp.async" not in ptx
    assert ptx.count("griddepcontrol.wait") == 1


@pytest.mark.parametrize("which", ["fc1", "fc2"])
@pytest.mark.parametrize("ptr", [BF, F8], ids=["bf16", "fp8-block"])
def test_every_gemv_tuner_tile_compiles_without_spills(kernels, which, ptr):
    """Every reduction-form tile the tuner tries (``tune_moe._gemv_candidates`` at BM = 1, 2, 4) compiles for sm_90
    without spilling its accumulators: no local memory and at most 16 bytes of stack (ptxas reports a spill as
    stack; one or two 8-byte values around the loop are not the tile: a 2 x 32 x 512 FC1 tile spills 6264 bytes, and
    with Triton 3.6 -- the H200 machine's -- the slot-mode FC2 tiles with the fused top-k sum spill 136-696 bytes,
    so the tuner also tries each GEMV FC2 with the unfused sum). A spilling tile would run far below its bytes'
    time. Checked with the Triton this machine has (3.9 in CI)."""
    from rubin_compile.kernels.triton import tune_moe as tm

    fn = kernels._moe_fc1_kernel if which == "fc1" else kernels._moe_fc2_kernel
    if which == "fc1":
        ptrs = dict(FC1_PTRS, w_ptr=ptr, w2_ptr=ptr, inter_ptr=BF)
    else:
        ptrs = dict(FC2_PTRS, a_ptr=BF, w_ptr=ptr)
    ints = FP8_BLOCK_INTS if ptr == F8 else QWEN3_INTS
    tiles = {
        (g.BM, g.BN, g.BK, g.num_warps)
        for rows in (1.0, 1.5, 3.0)  # BM 1; 1 and 2; 1 and 4
        for g in tm._gemv_candidates(kernels, 4, 768 if which == "fc1" else 2048, "bf16", which, rows)
    }
    seen = {}
    for bm, bn, bk, warps in sorted(tiles):
        consts = dict(FC1 if which == "fc1" else FC2, GEMV=True, BM=bm, BN=bn, BK=bk, W_SCALE=2 if ptr == F8 else 0)
        asm = {}
        compile_like_a_launch(fn, consts, ptrs, ints, num_stages=1, asm=asm, num_warps=warps)
        seen[(bm, bn, bk, warps)] = resource_usage(asm["cubin"])
    assert {bm for bm, *_ in seen} == {1, 2, 4} and len(seen) >= 10, seen
    assert all(r["LOCAL"] == 0 and r["STACK"] <= 16 for r in seen.values()), seen


# ------------------------------------------------------------------ the fused decode kernel (moe_decode.py)


QWEN3 = dict(H=2048, I=768, k=8)
DEEPSEEK = dict(H=7168, I=256, k=8)


def _compile_fused(shape, cfg, asm):
    dec = sys.modules["rubin_moe_decode_aot"]
    (bn1, bk1, ns1, split), (bn2, bk2, ns2, groups), w, pf = cfg
    H, I, k = shape["H"], shape["I"], shape["k"]  # noqa: E741
    n1 = k * (I // bn1) * split
    kch = -(-H // split)
    ints = dict(T=1, H=H, I=I, K_TOP=k, NT1=I // bn1, NT2=H // bn2, N1=n1, N_ALL=n1 + H // bn2 * groups, SPLIT=split)
    ints.update(KCH=kch, GROUPS=groups, TICK2=2 + 64 + k * (I // bn1))
    ints.update(stride_xt=H, stride_w13e=2 * I * H, stride_w13n=H, stride_w2e=H * I, stride_w2n=I, stride_ot=H)
    ptrs = dict(x_ptr="*bf16", w13_ptr="*bf16", w2_ptr="*bf16", ids_ptr="*i32", tw_ptr="*fp32", inter_ptr="*bf16")
    ptrs.update(part_ptr="*fp32", part2_ptr="*fp32", out_ptr="*bf16", ws_ptr="*i32")
    consts = dict(ACT=0, BN1=bn1, BK1=bk1, NS1=ns1, BN2=bn2, BK2=bk2, NS2=ns2, EVEN_N1=True, EVEN_K1=True)
    consts.update(EVEN_N2=True, EVEN_K2=True, PREFETCH=pf, DOT_PREC="tf32", GDC=True)
    return compile_like_a_launch(
        dec._moe_decode_kernel, consts, ptrs, ints, num_stages=max(ns1, ns2), asm=asm, num_warps=w
    )


@pytest.fixture(scope="module")
def decode_kernels():
    """kernels/triton/moe_decode.py loaded as a plain module."""
    yield load_plain("moe_decode", "rubin_moe_decode_aot")
    del sys.modules["rubin_moe_decode_aot"]


def _fused_cases():
    """The tuner's FC1 tiles of the fused path (moe_decode.TUNE_*), each with one of its FC2 tiles, on each grid (the
    K-split ones at DeepSeek-V3 TP8 sizes, the others at Qwen3-30B-A3B's); and one with the FC2 items' L2 requests."""
    tiles = load_plain("moe_decode", "rubin_moe_decode_tiles")
    del sys.modules["rubin_moe_decode_tiles"]
    out = []
    for i, fc1 in enumerate(tiles.TUNE_FC1):
        fc2 = tiles.TUNE_FC2[i % len(tiles.TUNE_FC2)]
        for w, o in tiles.TUNE_GRIDS:
            out.append(((fc1, fc2, w, o, 0), DEEPSEEK if fc1[3] > 1 else QWEN3))
    out.append(((tiles.TUNE_FC1[0], tiles.TUNE_FC2[0], 4, 2, 32768), QWEN3))
    return out


@pytest.mark.parametrize("tiles,shape", _fused_cases(), ids=lambda v: str(v) if isinstance(v, tuple) else "")
def test_fused_decode_k_loops_pipeline_16_byte_copies_and_nothing_spills(decode_kernels, tiles, shape):
    """The fused decode kernel (moe_decode.py) with the tuner's tiles: its two K loops (FC1's, FC2's over the
    token's slots) are Triton's software pipelines of 16-byte cp.async copies into shared memory feeding the MMAs;
    no local memory; the occupancy it is tuned at fits (registers and shared memory); one griddepcontrol.wait and
    one launch_dependents; the L2 requests only where fc2.prefetch asks for them."""
    fc1, fc2, w, o, pf = tiles
    asm = {}
    ptx = _compile_fused(shape, (fc1, fc2, w, pf), asm)
    assert ptx.count("griddepcontrol.wait") == 1 and ptx.count("griddepcontrol.launch_dependents") == 1
    assert ("cp.async.bulk.prefetch.L2" in ptx) == bool(pf)
    k_loops = [b for b in loop_bodies(ptx) if any("mma.sync" in line for line in b)]
    assert len(k_loops) == 2, f"{len(k_loops)} loops with MMAs"
    fc1_loop, fc2_loop = ("\n".join(b) for b in k_loops)
    # the tiles: 16-byte copies; FC2's loop also pipelines its next step's expert id and routing weight (4 bytes)
    assert async_copy_sizes(fc1_loop) == {"0x10"}, async_copy_sizes(fc1_loop)
    assert async_copy_sizes(fc2_loop) == {"0x10", "0x4"}, async_copy_sizes(fc2_loop)
    use = resource_usage(asm["cubin"])
    assert use["LOCAL"] == 0, use
    shared = asm["metadata"].shared
    assert resident_per_sm(use["REG"], shared, w) >= o, f"occupancy {o} does not fit: {use}, {shared} B shared"
