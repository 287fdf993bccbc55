"""The Gluon FC2 of the persistent MoE path (kernels/triton/moe_prefill_gluon.py) on the CPU: Gluon has no
interpreter, so each tile the tuner tries is compiled ahead of time for sm_90 (Triton's own ptxas) and its PTX read:
e4m3 wgmma fed by TMA, the K loop waiting for all but the newest MMA (``wgmma.wait_group 1``: the product it scales is
the previous step's while the next one runs), one griddepcontrol.wait, no spills, and room for its occupancy. Its
values are checked on the GPU (tests/gpu/test_triton_moe.py, the gluon cases)."""

from __future__ import annotations

import inspect
import re
import sys

import pytest

from tests.cpu.kernels.triton_aot import resident_per_sm, resource_usage

torch = pytest.importorskip("torch")
pytest.importorskip("triton.experimental.gluon", reason="needs a Triton with Gluon (>= 3.5)")


@pytest.fixture(scope="module")
def gluon_fc2():
    from tests.cpu.kernels.triton_aot import load_plain

    yield load_plain("moe_prefill_gluon", "rubin_moe_prefill_gluon_aot")
    del sys.modules["rubin_moe_prefill_gluon_aot"]


def _gluon_variants():
    from rubin_compile.kernels.triton import tune_moe as tm

    return [t for t in tm.PERSISTENT_VARIANTS_FP8 if t[-1].get("gluon")]


# Qwen3-30B-A3B's FC2 at T = 4096 (E 128, H 2048, I 768, k 8) with 128 x 128 block scales over w2 [128, 2048, 768]
E, H, I, K_TOP = 128, 2048, 768, 8  # noqa: E741
SCALE_STRIDES = dict(stride_se=16 * 6, stride_sn=6, stride_sk=1, SBN=128, SBK=128)


def _compile(mod, BM, BN, BK, warps, stages, w_scale, bias):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    p_max = 4096 * K_TOP + E * (BM - 1)
    inter = torch.empty(p_max, I, dtype=torch.float8_e4m3fn)
    w2 = torch.empty(E, H, I, dtype=torch.float8_e4m3fn)
    a_desc, w_desc = mod.descriptors(inter, w2, E, H, I, BM, BN, BK)
    fn = mod._fc2_w8a8_kernel
    consts = dict(HAS_BIAS=bias, W_SCALE=w_scale, BM=BM, BN=BN, BK=BK, GROUP=8, NUM_STAGES=stages, GDC=True)
    ptrs = dict(isc_ptr="*fp32", ws_ptr="*fp32", b_ptr="*bf16", sorted_ptr="*i32", tile_expert_ptr="*i32")
    ptrs.update(ntiles_ptr="*i32", y_ptr="*bf16")
    ints = dict(H=H, I=I, stride_ist=I // BK, stride_be=H, **SCALE_STRIDES)
    sig, attrs = {}, {}
    for i, p in enumerate(inspect.signature(fn.fn).parameters):
        if p in consts:
            sig[p] = "constexpr"
        elif p in ("a_desc", "w_desc"):
            sig[p] = mangle_type(a_desc if p == "a_desc" else w_desc)
        elif p in ptrs:
            sig[p], attrs[(i,)] = ptrs[p], [["tt.divisibility", 16]]
        else:  # as a launch specialises: 16-divisible ints marked so (SBN, SBK = 128 included)
            sig[p] = "i32"
            if ints[p] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = GluonASTSource(fn, sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    use = resource_usage(k.asm["cubin"])
    use["DYNAMIC_SHARED"] = k.metadata.shared
    return k.asm["ptx"], use


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


def test_the_tuner_tries_gluon_fc2_tiles():
    assert len(_gluon_variants()) >= 4


@pytest.mark.parametrize("w_scale,bias", [(2, False), (1, True)], ids=["block-scales", "per-expert-bias"])
@pytest.mark.parametrize("i", range(len(_gluon_variants())))
def test_gluon_fc2_keeps_the_next_mma_in_flight_without_spills(gluon_fc2, i, w_scale, bias):
    from rubin_compile.kernels.triton import moe as tmoe
    from rubin_compile.kernels.triton.tune_moe import persistent_config

    cfg = persistent_config(tmoe, _gluon_variants()[i], a_fp8=True)
    g = cfg.fc2
    assert g.gluon and cfg.problem() is None
    assert gluon_fc2.problem(g.BM, g.BN, g.BK, g.num_warps, w_scale, True, True) is None
    ptx, use = _compile(gluon_fc2, g.BM, g.BN, g.BK, g.num_warps, g.num_stages, w_scale, bias)
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{g.BN}k32\.f32\.e4m3\.e4m3", ptx)
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global\.mbarrier", ptx)
    assert len(re.findall(r"griddepcontrol\.wait", ptx)) == 1
    assert use["LOCAL"] == 0 and use["STACK"] == 0, use
    fits = resident_per_sm(use["REG"], use["DYNAMIC_SHARED"] + use.get("SHARED", 0), g.num_warps)
    assert fits >= g.occupancy, (g, use)
    # the K loop: one wait that leaves the newest MMA in flight; a full wait only after the loop, for the last step
    waits = [ln for ln in _in_loops(ptx) if "wgmma.wait_group" in ln]
    assert waits and all(re.search(r"wgmma\.wait_group\.sync\.aligned 1;", ln) for ln in waits), waits
    assert re.search(r"wgmma\.wait_group\.sync\.aligned 0;", ptx)


def test_gluon_fc2_says_what_it_cannot_run(gluon_fc2):
    p = gluon_fc2.problem
    assert p(64, 128, 64, 4, 2, True, True) is None
    assert "W8A8" in p(64, 128, 64, 4, 2, True, False)
    assert "whole tiles" in p(64, 128, 64, 4, 2, False, True)
    assert "BM = 16 x num_warps" in p(128, 128, 64, 4, 2, True, True)
    assert "BN in 32, 64, 128" in p(64, 256, 64, 4, 1, False, True)


def test_gluon_configs_are_checked():
    from rubin_compile.kernels.triton.moe import GemmConfig as G
    from rubin_compile.kernels.triton.moe import MoEConfig as M

    assert (
        M(mode="persistent", a_fp8=True, fc1=G(BM=64), fc2=G(BM=64, BN=128, num_warps=4, gluon=True)).problem() is None
    )
    with pytest.raises(ValueError, match="gluon is an FC2 kernel"):
        M(mode="persistent", a_fp8=True, fc1=G(BM=64, gluon=True), fc2=G(BM=64))
    with pytest.raises(ValueError, match="fc2.gluon takes a_fp8=True"):
        M(mode="persistent", fc1=G(BM=64), fc2=G(BM=64, num_warps=4, gluon=True))
    with pytest.raises(ValueError, match="BM = 16 x num_warps"):
        M(mode="persistent", a_fp8=True, fc1=G(BM=64), fc2=G(BM=64, num_warps=8, gluon=True))
    with pytest.raises(ValueError, match="mode='prefill' takes gluon=False"):
        M(mode="prefill", fc2=G(gluon=True))
