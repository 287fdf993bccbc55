"""The warp-specialized Gluon GEMMs of the persistent MoE path (kernels/triton/moe_prefill_ws.py) on the CPU, and the
kernel that quantises their FC1's rows in tile order (fp8.gather_quant_rows_kernel).

Gluon has no interpreter: each warp-specialized tile the tuner tries is compiled ahead of time for sm_90 (Triton's own
ptxas) and its PTX read: two consumer warpgroups and a producer (``setmaxnreg`` moving registers to the consumers),
e4m3 wgmma fed by TMA only (no gathered rows), each consumer's K loop keeping the next MMA in flight and releasing
stages by mbarrier arrivals, no CTA-wide barrier between the consumers, one griddepcontrol.wait, no spills. The
gather-quantisation kernel runs in Triton's interpreter (a subprocess) against ``quantise_rows``. Their values on the
GPU: tests/gpu/test_triton_moe.py (test_persistent_path_gluon, the ``ws`` tiles)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests.cpu.kernels.triton_aot import compile_like_a_launch, resident_per_sm, resource_usage
from tests.cpu.kernels.triton_interp import run_file

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]


def _ws_variants():
    from rubin_compile.kernels.triton import tune_moe as tm

    return [t for t in tm.PERSISTENT_VARIANTS_FP8 if any(t[-1].get("ws", ()))]


def _compile(fc1: bool, g, w_scale: int, bias: bool):
    """The warp-specialized FC1 (``fc1``) or FC2 of GemmConfig ``g`` compiled for sm_90 as a launch on Qwen3's shapes
    specialises it: (PTX, resource usage with the dynamic shared memory, the compiled kernel's warps)."""
    from rubin_compile.kernels.triton import moe_prefill_gluon as mg
    from rubin_compile.kernels.triton import moe_prefill_ws as ws

    # the Gluon kernels' test case: Qwen3-30B-A3B at T = 4096, 128 x 128 block scales, its pointer types
    from tests.cpu.kernels.test_triton_moe_prefill_gluon import E, H, I, K_TOP, PTRS, T  # noqa: E741

    BM, BN, BK = g.BM, g.BN, g.BK
    P = T * K_TOP + E * (BM - 1)
    if fc1:
        xq = torch.empty(P, H, dtype=torch.float8_e4m3fn)
        a, w = ws.fc1_descriptors(xq, torch.empty(E, 2 * I, H, dtype=torch.float8_e4m3fn), E, H, I, BM, BN, BK)
        fn = ws._fc1_ws_kernel
        ints = dict(H=H, I=I, stride_xsp=H // BK, stride_be=2 * I, stride_ist=I // BN)
        ints.update(stride_se=12 * 16, stride_sn=16, stride_sk=1)
        consts = dict(ACT=0)
    else:
        inter = torch.empty(P, I, dtype=torch.float8_e4m3fn)
        a, w = mg.descriptors(inter, torch.empty(E, H, I, dtype=torch.float8_e4m3fn), E, H, I, BM, BN, BK)
        fn = ws._fc2_ws_kernel
        ints = dict(H=H, I=I, stride_ist=I // BK, stride_be=H, stride_se=16 * 6, stride_sn=6, stride_sk=1)
        consts = {}
    ints.update(SBN=128, SBK=128)
    consts.update(HAS_BIAS=bias, W_SCALE=w_scale, BM=BM, BN=BN, BK=BK, GROUP=8, NUM_STAGES=g.num_stages, GDC=True)
    consts.update(UNROLL=g.unroll)
    asm = {}
    ptx = compile_like_a_launch(
        fn,
        consts,
        PTRS,
        ints,
        num_stages=g.num_stages,
        asm=asm,
        num_warps=g.num_warps,
        descriptors={"a_desc": a, "w_desc": w},
    )
    use = resource_usage(asm["cubin"])
    use["DYNAMIC_SHARED"] = asm["metadata"].shared
    return ptx, use, asm["metadata"].num_warps


def test_the_tuner_tries_warp_specialized_tiles_of_both_gemms():
    vs = _ws_variants()
    assert sum(t[-1]["ws"][1] for t in vs) >= 2 and sum(t[-1]["ws"][0] for t in vs) >= 1
    for t in vs:  # a warp-specialized GEMM is a Gluon one, 128 rows at 4 warps
        assert all(g for g, w in zip(t[-1]["gluon"], t[-1]["ws"]) if w) and t[0] == 128


CASES = [
    (i, gemm, w_scale, bias)
    for i, t in enumerate(_ws_variants())
    for gemm in ("fc1", "fc2")
    if t[-1]["ws"][gemm == "fc2"]
    for w_scale, bias in ((2, False), (1, True))
]


@pytest.mark.parametrize(
    "i,gemm,w_scale,bias", CASES, ids=[f"{i}-{g}-{'block' if w == 2 else 'expert-bias'}" for i, g, w, _ in CASES]
)
def test_ws_gemms_split_their_warps_and_keep_mmas_in_flight(i, gemm, w_scale, bias):
    pytest.importorskip("triton.experimental.gluon", reason="needs a Triton with Gluon (>= 3.5)")
    from rubin_compile.kernels.triton import moe as tmoe
    from rubin_compile.kernels.triton import moe_prefill_ws as ws
    from rubin_compile.kernels.triton.tune_moe import persistent_config
    from tests.cpu.kernels.test_triton_moe_prefill_gluon import _ptxas_log

    cfg = persistent_config(tmoe, _ws_variants()[i], a_fp8=True)
    fc1 = gemm == "fc1"
    g = cfg.fc1 if fc1 else cfg.fc2
    assert g.ws and g.gluon and cfg.problem() is None
    assert ws.problem(g.BM, g.BN, g.BK, g.num_warps, g.num_stages, w_scale, True, True, fc1=fc1) is None
    ptx, use, warps = _compile(fc1, g, w_scale, bias)
    # 4 + 4 consumer warps and the producer's warpgroup; registers moved to the consumers, 24 left to the producer
    assert warps == 12, warps
    moves = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)
    assert ("dec", "24") in moves and ("inc", str(ws.WS_REGS)) in moves, moves
    n = 2 * g.BN if fc1 else g.BN  # FC1 multiplies the gate and up tiles as one
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{n}k32\.f32\.e4m3\.e4m3", ptx)
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global\.mbarrier", ptx)  # TMA, rows and weights
    assert not re.search(r"cp\.async\.c[ag]\.shared\.global", ptx), "rows gathered by cp.async"
    # each consumer: UNROLL steps an iteration, each step's MMA issued before the previous one's product is waited
    # for, the last waited for alone; a stage released by one arrival per consumer (after its own warpgroup's barrier,
    # 128 threads: never the whole CTA's)
    waits = sorted(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx))
    assert waits == sorted((["0"] + ["1"] * (g.unroll - 1)) * 2), waits
    assert len(re.findall(r"mbarrier\.arrive\.shared::cta\.b64", ptx)) >= 2 * g.unroll
    assert not re.search(r"bar\.sync\s+\d+, 256;|bar\.sync\s+0;", ptx), "a barrier across both consumers"
    assert len(re.findall(r"griddepcontrol\.wait", ptx)) == 1
    assert use["LOCAL"] == 0 and use["STACK"] <= (0 if triton.__version__.startswith("3.6") else 4 * g.unroll), use
    assert "C7514" not in _ptxas_log(ptx)  # no wgmma serialised
    assert resident_per_sm(use["REG"], use["DYNAMIC_SHARED"] + use.get("SHARED", 0), warps) >= 1, use


def test_ws_gemms_say_what_they_cannot_run():
    pytest.importorskip("triton.experimental.gluon", reason="needs a Triton with Gluon (>= 3.5)")
    from rubin_compile.kernels.triton import moe_prefill_ws as ws

    p = ws.problem
    assert p(128, 128, 64, 4, 6, 2, True, True) is None
    assert p(128, 64, 128, 4, 4, 2, True, True, fc1=True) is None
    assert "takes BM = 128 at 4 warps" in p(64, 128, 64, 4, 4, 2, True, True)
    assert "takes BM = 128 at 4 warps" in p(128, 128, 64, 8, 4, 2, True, True)
    assert "the Gluon FC2 is the W8A8 one" in p(128, 128, 64, 4, 4, 2, True, False)
    assert "BM x 2 BN" in p(128, 128, 128, 4, 4, 2, True, True, fc1=True)


def test_ws_configs_are_checked():
    from rubin_compile.kernels.triton.moe import GemmConfig as G
    from rubin_compile.kernels.triton.moe import MoEConfig as M

    fc1 = G(BM=128, BN=64, BK=128, num_warps=4, join=True, gluon=True, ws=True)
    fc2 = G(BM=128, BN=128, BK=64, num_warps=4, gluon=True, ws=True)
    assert M(mode="persistent", a_fp8=True, fc1=fc1, fc2=fc2).problem() is None
    with pytest.raises(ValueError, match="ws=True is the warp-specialized form of the Gluon kernel: set gluon=True"):
        M(mode="persistent", a_fp8=True, fc1=fc1, fc2=G(BM=128, num_warps=4, ws=True))
    with pytest.raises(ValueError, match="ws=True runs one program per SM"):
        M(mode="persistent", a_fp8=True, fc1=fc1, fc2=G(BM=128, num_warps=4, gluon=True, ws=True, occupancy=2))
    with pytest.raises(ValueError, match="fc2.ws takes BM = 128 at num_warps = 4"):
        M(mode="persistent", a_fp8=True, fc1=G(BM=128, num_warps=8), fc2=G(BM=128, num_warps=8, gluon=True, ws=True))
    with pytest.raises(ValueError, match="fc1.gluon takes a_fp8=True"):
        M(mode="persistent", fc1=fc1, fc2=G(BM=128, num_warps=8))
    with pytest.raises(ValueError, match="mode='prefill' takes gluon=False"):
        M(mode="prefill", fc2=G(BM=128, num_warps=4, gluon=True, ws=True))


def test_gather_quant_moves_rows_in_16_byte_vectors():
    """The tile-order quantisation at Qwen3's and DeepSeek-V3's hidden sizes loads bf16 and stores e4m3 16 bytes per
    instruction, as quant_rows_kernel does (test_triton_fp8.py says why that matters)."""
    from tests.cpu.kernels.triton_aot import load_plain

    fp8 = load_plain("fp8", "rubin_fp8_ws_aot")
    try:
        for h in (2048, 7168):
            ptx = compile_like_a_launch(
                fp8.gather_quant_rows_kernel,
                dict(G=128, NG=16, GDC=True),
                dict(x_ptr="*bf16", sorted_ptr="*i32", q_ptr="*fp8e4nv", s_ptr="*fp32"),
                dict(H=h, K_TOP=8, stride_xt=h, stride_qp=h, stride_sp=h // 128),
            )
            assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx), "bf16 rows not loaded in 16-byte vectors"
            assert re.search(r"st\.global(\.\w+)*\.v4\.b32", ptx), "e4m3 rows not stored in 16-byte vectors"
            assert not re.search(r"st\.global(\.\w+)*\.b8\b", ptx), "an e4m3 element stored alone"
    finally:
        del sys.modules["rubin_fp8_ws_aot"]


def _gather_case() -> dict:
    """(In the interpreter subprocess.) Rows of 3 M tiles of 4 over 5 tokens, k = 2, padding rows (-1) among them and
    past them: the tile-order rows against ``quantise_rows``' rows of their tokens; which rows were written (the
    buffers ``fp8._e4m3_rows`` makes for the kernel filled with a marker first)."""
    from rubin_compile.kernels.triton import fp8

    g = torch.Generator().manual_seed(0)
    Tn, Hn, k, G = 5, 40, 2, 16  # H not a multiple of G: the last group is short
    x = (torch.randn(Tn, Hn, generator=g) * 3).bfloat16()
    x[2, :16] = 0  # a group of zeros: the smallest scale
    sorted_slots = torch.tensor([0, 3, 5, -1, 1, 2, 4, 6, 9, 8, 7, -1] + [-1] * 8, dtype=torch.int32)
    buffers = fp8._e4m3_rows

    def marked(*args):
        q, xs, grid, ng = buffers(*args)
        q.view(torch.uint8).fill_(0x5A)
        return q, xs.fill_(-7.0), grid, ng

    fp8._e4m3_rows = marked
    try:
        q, s = fp8.gather_quantise_rows(x, sorted_slots, k, G, False, {})
    finally:
        fp8._e4m3_rows = buffers
    qt, st = fp8.quantise_rows(x, G, False, {})
    real = [p for p in range(len(sorted_slots)) if sorted_slots[p] >= 0]
    toks = [int(sorted_slots[p]) // k for p in real]
    rest = [p for p in range(len(sorted_slots)) if sorted_slots[p] < 0]
    return dict(
        rows_equal=bool(torch.equal(q[real].view(torch.uint8), qt[toks].view(torch.uint8))),
        scales_equal=bool(torch.equal(s[real], st[toks])),
        rest_untouched=bool((q[rest].view(torch.uint8) == 0x5A).all() and (s[rest] == -7.0).all()),
        shape=list(q.shape) + list(s.shape),
    )


@pytest.fixture(scope="module")
def gather_result():
    return run_file(__file__, timeout=600)


def test_gather_quant_rows_are_the_tokens_rows_in_tile_order(gather_result):
    """Each row with a slot is its token's row as ``quantise_rows`` quantises it, bit for bit (e4m3 and the scales);
    rows without one (padding, and past the tiles in use) are not written; the buffers are P_MAX rows (the sorted
    slots')."""
    r = gather_result
    assert r["rows_equal"] and r["scales_equal"], r
    assert r["rest_untouched"], r
    assert r["shape"] == [20, 40, 20, 3], r


if __name__ == "__main__":  # the subprocess of gather_result
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from tests.cpu.kernels.triton_interp import gpu_rounding

    gpu_rounding()
    print(json.dumps(_gather_case()))
