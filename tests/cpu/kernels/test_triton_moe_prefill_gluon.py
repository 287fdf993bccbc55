"""The Gluon GEMMs of the persistent MoE path (kernels/triton/moe_prefill_gluon.py) on the CPU: Gluon has no
interpreter, so each tile the tuner tries is compiled ahead of time for sm_90 (Triton's own ptxas) and its PTX read:
e4m3 wgmma fed by TMA (FC1's gathered rows: 16-byte cp.async copies, fenced for the MMA), the K loop waiting for all
but the newest MMA (``wgmma.wait_group 1``: the product it scales is the previous step's while the next one runs), one
griddepcontrol.wait, no spills, and room for its occupancy. Their values are checked on the GPU
(tests/gpu/test_triton_moe.py, test_persistent_path_gluon)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.cpu.kernels.triton_aot import compile_like_a_launch, resident_per_sm, resource_usage

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon", reason="needs a Triton with Gluon (>= 3.5)")


@pytest.fixture(scope="module")
def gluon_fc2():
    from tests.cpu.kernels.triton_aot import load_plain

    yield load_plain("moe_prefill_gluon", "rubin_moe_prefill_gluon_aot")
    del sys.modules["rubin_moe_prefill_gluon_aot"]


def _gluon_variants():
    from rubin_compile.kernels.triton import tune_moe as tm

    # (the warp-specialized ones, ``ws``: test_triton_moe_prefill_ws.py)
    return [t for t in tm.PERSISTENT_VARIANTS_FP8 if any(t[-1].get("gluon", ())) and not any(t[-1].get("ws", ()))]


# Qwen3-30B-A3B at T = 4096 (E 128, H 2048, I 768, k 8) with 128 x 128 block scales over w13 [128, 1536, 2048] and
# w2 [128, 2048, 768]
E, H, I, K_TOP, T = 128, 2048, 768, 8, 4096  # noqa: E741
PTRS = dict(
    x_ptr="*fp8e4nv",
    xs_ptr="*fp32",
    isc_ptr="*fp32",
    ws_ptr="*fp32",
    b_ptr="*bf16",
    sorted_ptr="*i32",
    tile_expert_ptr="*i32",
    ntiles_ptr="*i32",
    inter_ptr="*fp8e4nv",
    y_ptr="*bf16",
)


def _compile(mod, fc1: bool, g, w_scale: int, bias: bool):
    """The Gluon FC1 (``fc1``) or FC2 of GemmConfig ``g`` compiled for sm_90 as a launch on Qwen3's shapes
    specialises it: (PTX, resource usage)."""
    BM, BN, BK = g.BM, g.BN, g.BK
    if fc1:
        w13 = torch.empty(E, 2 * I, H, dtype=torch.float8_e4m3fn)
        descs = {"w_desc": mod.fc1_descriptor(w13, E, H, I, BN, BK)}
        fn = mod._fc1_w8a8_kernel
        ints = dict(H=H, I=I, K_TOP=K_TOP, stride_xt=H, stride_xst=H // BK, stride_be=2 * I, stride_ist=I // BN)
        ints.update(stride_se=12 * 16, stride_sn=16, stride_sk=1)
        consts = dict(ACT=0)
    else:
        inter = torch.empty(T * K_TOP + E * (BM - 1), I, dtype=torch.float8_e4m3fn)
        w2 = torch.empty(E, H, I, dtype=torch.float8_e4m3fn)
        a_desc, w_desc = mod.descriptors(inter, w2, E, H, I, BM, BN, BK)
        descs = {"a_desc": a_desc, "w_desc": w_desc}
        fn = mod._fc2_w8a8_kernel
        ints = dict(H=H, I=I, stride_ist=I // BK, stride_be=H, stride_se=16 * 6, stride_sn=6, stride_sk=1)
        consts = {}
    ints.update(SBN=128, SBK=128)
    consts.update(HAS_BIAS=bias, W_SCALE=w_scale, BM=BM, BN=BN, BK=BK, GROUP=8, NUM_STAGES=g.num_stages, GDC=True)
    consts.update(UNROLL=g.unroll)
    asm = {}
    ptx = compile_like_a_launch(
        fn, consts, PTRS, ints, num_stages=g.num_stages, asm=asm, num_warps=g.num_warps, descriptors=descs
    )
    use = resource_usage(asm["cubin"])
    use["DYNAMIC_SHARED"] = asm["metadata"].shared
    return ptx, use


def _ptxas_log(ptx: str) -> str:
    """What the ptxas Triton itself uses for sm_90 says, verbosely, of ``ptx``: its performance notes (C7514: wgmma
    serialised) are in this log, which Triton's own compile drops."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        run = subprocess.run(
            [get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(src), "-o", str(Path(d) / "k.cubin")],
            capture_output=True,
            text=True,
        )
    assert run.returncode == 0, run.stderr
    return run.stderr


def _in_loops(ptx: str) -> list[str]:
    """The PTX lines of the basic blocks LLVM marks as inside a loop (``=>This Inner Loop Header`` or ``in Loop:`` on
    the block's label line): the flat loop's blocks, its latch included, which LLVM may place before the header."""
    out, inside = [], False
    for line in ptx.splitlines():
        if re.match(r"\$L__BB\d+_\d+:|// %bb\.\d+:", line):
            inside = "Loop Header" in line or "in Loop:" in line
        if inside:
            out.append(line)
    return out


def test_the_tuner_tries_gluon_tiles_of_both_gemms():
    vs = _gluon_variants()
    assert sum(t[-1]["gluon"][1] for t in vs) >= 4 and sum(t[-1]["gluon"][0] for t in vs) >= 3
    # and both loop forms (GemmConfig.unroll: 2 or 4 K steps an iteration) of each GEMM
    for gemm in (0, 1):
        assert {t[-1].get("unroll", (2, 2))[gemm] for t in vs if t[-1]["gluon"][gemm]} == {2, 4}


CASES = [
    (i, gemm, w_scale, bias)
    for i, t in enumerate(_gluon_variants())
    for gemm in ("fc1", "fc2")
    if t[-1]["gluon"][gemm == "fc2"]
    for w_scale, bias in ((2, False), (1, True))
]


@pytest.mark.parametrize(
    "i,gemm,w_scale,bias", CASES, ids=[f"{i}-{g}-{'block' if w == 2 else 'expert-bias'}" for i, g, w, _ in CASES]
)
def test_gluon_gemms_keep_the_next_mma_in_flight_without_spills(gluon_fc2, i, gemm, w_scale, bias):
    from rubin_compile.kernels.triton import moe as tmoe
    from rubin_compile.kernels.triton.tune_moe import persistent_config

    cfg = persistent_config(tmoe, _gluon_variants()[i], a_fp8=True)
    fc1 = gemm == "fc1"
    g = cfg.fc1 if fc1 else cfg.fc2
    assert g.gluon and cfg.problem() is None
    assert gluon_fc2.problem(g.BM, g.BN, g.BK, g.num_warps, g.num_stages, w_scale, True, True, fc1=fc1) is None
    ptx, use = _compile(gluon_fc2, fc1, g, w_scale, bias)
    n = 2 * g.BN if fc1 else g.BN  # FC1 multiplies the gate and up tiles as one
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{n}k32\.f32\.e4m3\.e4m3", ptx)
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global\.mbarrier", ptx)  # weights (FC2: both)
    if fc1:  # the gathered rows: 16-byte cp.async copies, made visible to the MMA's async proxy
        assert set(re.findall(r"cp\.async\.cg\.shared\.global \[[^\]]+\], \[[^\]]+\], (\w+)", ptx)) == {"0x10"}
        assert "fence.proxy.async.shared::cta" in ptx
    assert len(re.findall(r"griddepcontrol\.wait", ptx)) == 1
    # no spill on the H200 machine's Triton (3.6); Triton 3.9 compiles with --regAllocOptLevel=2, which spills 8 bytes
    # (two registers' worth) at 255 registers in some of these tiles, 16 in FC2's 4-step loop at BN = 128 (16 bytes
    # stored, 24 loaded an iteration)
    assert use["LOCAL"] == 0 and use["STACK"] <= (0 if triton.__version__.startswith("3.6") else 4 * g.unroll), use
    # the MMAs stay asynchronous: ptxas serialises every wgmma of a kernel that reads an in-flight accumulator (as a
    # loop carrying one across its back-edge does), and says so
    assert "C7514" not in _ptxas_log(ptx)
    fits = resident_per_sm(use["REG"], use["DYNAMIC_SHARED"] + use.get("SHARED", 0), g.num_warps)
    assert fits >= g.occupancy, (g, use)
    # the K loop, UNROLL steps an iteration: each step's MMA issued before the previous step's product is waited
    # for (``wgmma.wait_group 1``), the iteration's last step waited for alone (``0``), nothing in flight at the
    # back-edge
    waits = [ln.split()[-1] for ln in _in_loops(ptx) if "wgmma.wait_group" in ln]
    assert sorted(waits) == ["0;"] + ["1;"] * (g.unroll - 1), waits


def test_gluon_gemms_say_what_they_cannot_run(gluon_fc2):
    p = gluon_fc2.problem
    assert p(64, 128, 64, 4, 4, 2, True, True) is None
    assert "the Gluon FC2 is the W8A8 one" in p(64, 128, 64, 4, 4, 2, True, False)
    assert "whole tiles" in p(64, 128, 64, 4, 4, 2, False, True)
    assert "the Gluon FC2 takes BM = 16 x num_warps" in p(128, 128, 64, 4, 4, 2, True, True)
    assert "BN in 32, 64, 128" in p(64, 256, 64, 4, 4, 1, False, True)
    assert "2 or more stages" in p(64, 128, 64, 4, 1, 2, True, True)
    assert p(64, 64, 128, 4, 4, 2, True, True, fc1=True) is None
    assert "BM x 2 BN" in p(64, 128, 128, 4, 4, 2, True, True, fc1=True)


def test_gluon_configs_are_checked():
    from rubin_compile.kernels.triton.moe import GemmConfig as G
    from rubin_compile.kernels.triton.moe import MoEConfig as M

    assert (
        M(mode="persistent", a_fp8=True, fc1=G(BM=64), fc2=G(BM=64, BN=128, num_warps=4, gluon=True)).problem() is None
    )
    with pytest.raises(ValueError, match="fc1.gluon multiplies the gate and up tiles in one MMA: set fc1.join=True"):
        M(mode="persistent", a_fp8=True, fc1=G(BM=64, gluon=True), fc2=G(BM=64))
    with pytest.raises(ValueError, match="fc1.gluon takes a_fp8=True .* BN <= 64"):
        M(mode="persistent", a_fp8=True, fc1=G(BM=64, BN=128, join=True, gluon=True), fc2=G(BM=64))
    fc1 = G(BM=64, BN=64, join=True, gluon=True)
    assert M(mode="persistent", a_fp8=True, fc1=fc1, fc2=G(BM=64)).problem() is None
    with pytest.raises(ValueError, match="fc2.gluon takes a_fp8=True"):
        M(mode="persistent", fc1=G(BM=64), fc2=G(BM=64, num_warps=4, gluon=True))
    with pytest.raises(ValueError, match="BM = 16 x num_warps"):
        M(mode="persistent", a_fp8=True, fc1=G(BM=64), fc2=G(BM=64, num_warps=8, gluon=True))
    with pytest.raises(ValueError, match="mode='prefill' takes gluon=False"):
        M(mode="prefill", fc2=G(gluon=True))
    fc2 = G(BM=64, BN=128, num_warps=4, gluon=True, unroll=4)
    assert M(mode="persistent", a_fp8=True, fc1=G(BM=64), fc2=fc2).problem() is None
    with pytest.raises(ValueError, match="unroll=3: the Gluon kernels run 2 or 4 K steps per loop iteration"):
        M(mode="persistent", a_fp8=True, fc1=G(BM=64), fc2=G(BM=64, num_warps=4, gluon=True, unroll=3))
    with pytest.raises(
        ValueError, match="unroll=4 sets the Gluon kernel's loop .gluon=True.; without it keep unroll=2"
    ):
        M(mode="persistent", a_fp8=True, fc1=G(BM=64, unroll=4), fc2=G(BM=64))


def test_the_shared_memory_estimate_counts_the_gluon_fc1_scratch():
    """The Gluon FC1 splits its [BM, 2 BN] float32 sums through shared memory: the estimate that keeps configs within
    an SM's shared memory counts it (a config past the limit would otherwise fail to launch)."""
    from rubin_compile.kernels.triton.moe import GemmConfig as G
    from rubin_compile.kernels.triton.moe import smem_estimate

    g = G(BM=64, BN=64, BK=128, num_warps=4, num_stages=4, join=True)
    gg = G(BM=64, BN=64, BK=128, num_warps=4, num_stages=4, join=True, gluon=True)
    assert smem_estimate(gg, "fc1", 1, 1) - smem_estimate(g, "fc1", 1, 1) == 64 * 2 * 64 * 4
    assert smem_estimate(gg, "fc2", 1, 1) == smem_estimate(g, "fc2", 1, 1)


def test_the_tuner_log_names_the_gluon_loop_form():
    """Two Gluon variants that differ only in ``unroll`` have different lines in the tuner's log (the H100 log of
    2026-12-05 had two identical lines before)."""
    from rubin_compile.kernels.triton import moe as tmoe
    from rubin_compile.kernels.triton.tune_moe import describe, persistent_config

    tile = (64, (64, 128, 4, 4), (128, 64, 4, 6), {"join": True, "gluon": (False, True)})
    two = describe(persistent_config(tmoe, tile, a_fp8=True))
    four = describe(persistent_config(tmoe, (*tile[:3], {**tile[3], "unroll": (2, 4)}), a_fp8=True))
    assert two.endswith("fc2=64x128x64/s6w4/gluon a_fp8") and four.endswith("fc2=64x128x64/s6w4/gluon/u4 a_fp8")
