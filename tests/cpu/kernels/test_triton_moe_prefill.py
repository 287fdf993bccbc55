"""The persistent prefill path of the Triton MoE (kernels/triton/moe_prefill.py) on the CPU: what its configs may be,
the tuner's tiles, and the kernels compiled ahead of time for sm_90 (Triton's own ptxas): the GEMMs run on wgmma with
their weights (FC2: both operands) loaded through TMA descriptors and FC1's output stored through one, FC1's gathered
rows through 16-byte cp.async copies, one griddepcontrol.wait each, and no spill at any tile the tuner tries.
Numerics under the interpreter are in test_triton_moe_config.py (the "persistent" cases); on the GPU in
tests/gpu/test_triton_moe.py."""

from __future__ import annotations

import dataclasses

import re
import sys

import pytest

from tests.cpu.kernels.triton_aot import (
    async_copy_sizes,
    compile_like_a_launch,
    loop_bodies,
    resident_per_sm,
    resource_usage,
)

BF = "*bf16"


@pytest.fixture(scope="module")
def prefill():
    from tests.cpu.kernels.triton_aot import load_plain

    yield load_plain("moe_prefill", "rubin_moe_prefill_aot")
    del sys.modules["rubin_moe_prefill_aot"]


def _tuner_tiles(fp8: bool = False):
    from rubin_compile.kernels.triton.tune_moe import PERSISTENT_TILES, PERSISTENT_TILES_FP8

    return PERSISTENT_TILES_FP8 if fp8 else PERSISTENT_TILES


TILES = [(False, i) for i in range(len(_tuner_tiles()))] + [(True, i) for i in range(len(_tuner_tiles(True)))]
TILE_IDS = [f"{'fp8' if f else 'bf16'}-{i}" for f, i in TILES]
WGMMA = {False: r"m64n\d+k16\.f32\.bf16\.bf16", True: r"m64n\d+k32\.f32\.e4m3\.e4m3"}

# A Qwen3-30B-A3B prefill call (H = 2048, I = 768, k = 8) at T = 1024 with 128-row tiles
QWEN3 = dict(E=128, H=2048, I=768, P_MAX=8192 + 128 * 127, K_TOP=8, stride_xt=2048, stride_be=0)
PTRS = dict(
    sorted_ptr="*i32",
    tile_expert_ptr="*i32",
    ntiles_ptr="*i32",
    b_ptr=BF,
    ws_ptr="*fp32",
    xs_ptr="*fp32",
    isc_ptr="*fp32",
)
F8 = "*fp8e4nv"
# the scale strides of 128 x 128 blocks over Qwen3's w13 [128, 1536, 2048] and w2 [128, 2048, 768]
SCALES = dict(stride_xst=16, stride_se=12 * 16, stride_sn=16, stride_sk=1, SBN=128, SBK=128, stride_ist=12)


def _compile(fn, consts, ptrs, warps, stages):
    asm: dict = {}
    ints = {n: v for n, v in {**QWEN3, **SCALES}.items() if n in fn.arg_names}
    ptx = compile_like_a_launch(fn, consts, {**PTRS, **ptrs}, ints, num_stages=stages, asm=asm, num_warps=warps)
    use = resource_usage(asm["cubin"])
    use["DYNAMIC_SHARED"] = asm["metadata"].shared
    return ptx, use


@pytest.mark.parametrize("fp8,tile", TILES, ids=TILE_IDS)
def test_fc1_runs_on_tma_and_wgmma_without_spills(prefill, fp8, tile):
    bm, (bn, bk, warps, stages), _ = _tuner_tiles(fp8)[tile]
    consts = dict(ACT=0, HAS_BIAS=True, A_FP8=fp8, W_SCALE=2 if fp8 else 0, BM=bm, BN=bn, BK=bk, GROUP=8)
    consts.update(NUM_STAGES=stages, DOT_PREC="tf32", GDC=True)
    ptrs = dict(x_ptr=F8 if fp8 else BF, w_ptr=F8 if fp8 else BF, inter_ptr=F8 if fp8 else BF)
    ptx, use = _compile(prefill._fc1_kernel, consts, ptrs, warps, stages)
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\." + WGMMA[fp8], ptx), "no wgmma of the weights' format"
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global", ptx), "weights not loaded through TMA"
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.global\.shared", ptx), "output not stored through TMA"
    # the gathered rows in 16-byte copies; with FP8 also the K step's scales, 4 bytes each
    sizes = async_copy_sizes(ptx)
    assert "0x10" in sizes and sizes <= ({"0x10", "0x4"} if fp8 else {"0x10"}), sizes
    assert len(re.findall(r"griddepcontrol\.wait", ptx)) == 1
    assert use["LOCAL"] == 0 and use["STACK"] == 0, use


@pytest.mark.parametrize("fp8,tile", TILES, ids=TILE_IDS)
def test_fc2_runs_on_tma_and_wgmma_without_spills(prefill, fp8, tile):
    bm, _, (bn, bk, warps, stages) = _tuner_tiles(fp8)[tile]
    consts = dict(HAS_BIAS=True, A_FP8=fp8, W_SCALE=2 if fp8 else 0, BM=bm, BN=bn, BK=bk, GROUP=8)
    consts.update(NUM_STAGES=stages, DOT_PREC="tf32", GDC=True)
    ptrs = dict(inter_ptr=F8 if fp8 else BF, w_ptr=F8 if fp8 else BF, y_ptr=BF)
    ptx, use = _compile(prefill._fc2_kernel, consts, ptrs, warps, stages)
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\." + WGMMA[fp8], ptx), "no wgmma of the weights' format"
    loads = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global", ptx)
    assert len(loads) >= 2, "both operands through TMA"
    assert async_copy_sizes(ptx) <= ({"0x4"} if fp8 else set()), "operands copied through pointers (FP8: scales only)"
    assert len(re.findall(r"griddepcontrol\.wait", ptx)) == 1
    assert use["LOCAL"] == 0 and use["STACK"] == 0, use


def _w8a16_tiles():
    from rubin_compile.kernels.triton.tune_moe import PERSISTENT_TILES_W8A16

    return PERSISTENT_TILES_W8A16


W8A16_TILES = range(len(_w8a16_tiles()))
WAITS = r"wgmma\.wait_group\.sync\.aligned\s+(\d+)"


def _gemms(prefill, kind: str, cfg):
    """FC1's and FC2's kernels of a persistent ``cfg`` as the tests compile them, with biases: (name, GemmConfig,
    kernel, constexprs, pointer types); ``kind`` "bf16", "fp8" (W8A8) or "w8a16" (e4m3 weights, bf16 activations)."""
    fp8 = kind == "fp8"
    act, wt = (F8 if fp8 else BF), (BF if kind == "bf16" else F8)
    common = dict(HAS_BIAS=True, A_FP8=fp8, W_SCALE=0 if kind == "bf16" else 2, BM=cfg.fc1.BM, GROUP=8, GDC=True)
    common["DOT_PREC"] = "tf32"
    out = []
    for name, g, fn, ptrs in (
        ("fc1", cfg.fc1, prefill._fc1_kernel, dict(x_ptr=act, w_ptr=wt, inter_ptr=act)),
        ("fc2", cfg.fc2, prefill._fc2_kernel, dict(inter_ptr=act, w_ptr=wt, y_ptr=BF)),
    ):
        if g.ws:  # where a warp-specialized GEMM cannot run, run() gives its 128-row tile to this kernel at 8 warps
            g = dataclasses.replace(g, num_warps=8)
        consts = dict(common, BN=g.BN, BK=g.BK, NUM_STAGES=g.num_stages, FLATTEN=g.flatten)
        # as run() decides for Qwen3's 128 x 128 blocks (I = 768: the up rows start at a block)
        consts["SCALAR_SW"] = fp8 and 128 % g.BN == 0
        if name == "fc1":
            consts["ACT"] = 0
            consts["JOIN"] = g.join
        out.append((name, g, fn, consts, ptrs))
    return out


@pytest.mark.parametrize("tile", W8A16_TILES, ids=[f"w8a16-{i}" for i in W8A16_TILES])
def test_w8a16_keeps_its_mmas_in_flight_without_spills(prefill, tile):
    """FP8 block weights with bf16 activations (a_fp8=False): e4m3 weight tiles through TMA, dequantised in registers
    and fed to bf16 wgmma as the register operand (FC1's two, FC2's one); the K loops wait for all MMAs only after
    the loop (every wait inside leaves MMAs in flight: what the W8A8 step cannot do), with no spill."""
    from rubin_compile.kernels.triton import moe as tmoe
    from rubin_compile.kernels.triton.tune_moe import persistent_config

    cfg = persistent_config(tmoe, _w8a16_tiles()[tile], a_fp8=False)
    for name, g, fn, consts, ptrs in _gemms(prefill, "w8a16", cfg):
        ptx, use = _compile(fn, consts, ptrs, g.num_warps, g.num_stages)
        # bf16 MMAs whose A operand is registers (a brace-enclosed register list before the B descriptor)
        assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16\s+\{[^}]*\},\s*\{", ptx), name
        assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global", ptx), "weights not loaded through TMA"
        waits = [int(n) for n in re.findall(WAITS, ptx)]
        assert waits.count(0) == 1 and len(waits) > 1, (name, waits)  # one full wait: after the loop
        assert len(re.findall(r"griddepcontrol\.wait", ptx)) == 1
        assert use["LOCAL"] == 0 and use["STACK"] == 0, (name, use)


def _variants():
    from rubin_compile.kernels.triton import tune_moe as tm

    return [
        *(("bf16", t) for t in tm.PERSISTENT_VARIANTS),
        *(("fp8", t) for t in tm.PERSISTENT_VARIANTS_FP8),
        *(("w8a16", t) for t in tm.PERSISTENT_VARIANTS_W8A16),
    ]


STORES = {"fc1": r"cp\.async\.bulk\.tensor\.2d\.global\.shared", "fc2": r"\bst\.global\."}


@pytest.mark.parametrize("i", range(len(_variants())), ids=[f"{k}-{i}" for i, (k, _) in enumerate(_variants())])
def test_tile_variants_fit_their_occupancy_and_flatten_their_loops(prefill, i):
    """The tuner's tiles with options of the persistent grids (tune_moe.PERSISTENT_VARIANTS*): each GEMM's kernel
    compiles without spills, on wgmma of its format; its registers and shared memory let ``occupancy`` programs
    reside on an sm_90 SM at once (else the extra programs would wait for a slot, and the option would cost instead
    of hide latency); and with ``flatten`` its innermost loop holds the item's epilogue store (one pipelined loop over
    all the program's items' K steps), where without it the innermost loop is the K loop alone."""
    from rubin_compile.kernels.triton import moe as tmoe
    from rubin_compile.kernels.triton.tune_moe import persistent_config

    kind, tile = _variants()[i]
    cfg = persistent_config(tmoe, tile, a_fp8=kind == "fp8")
    for name, g, fn, consts, ptrs in _gemms(prefill, kind, cfg):
        ptx, use = _compile(fn, consts, ptrs, g.num_warps, g.num_stages)
        assert re.search(r"wgmma\.mma_async\.sync\.aligned\." + WGMMA[cfg.a_fp8], ptx), name
        assert use["LOCAL"] == 0 and use["STACK"] == 0, (name, use)
        fits = resident_per_sm(use["REG"], use["DYNAMIC_SHARED"] + use.get("SHARED", 0), g.num_warps)
        assert fits >= g.occupancy, (name, g, use)
        stores_in_loop = any(re.search(STORES[name], ln) for body in loop_bodies(ptx) for ln in body)
        assert stores_in_loop == g.flatten, (name, g)


@pytest.mark.parametrize("join", [False, True], ids=["apart", "joined"])
@pytest.mark.parametrize("scalar", [False, True], ids=["column-scales", "one-scale-per-tile"])
def test_w8a8_scales_each_product_with_one_fma_per_element(prefill, join, scalar):
    """W8A8 with 128 x 128 block scales: where each weight tile lies in one scale block (``SCALAR_SW``, what run()
    passes for BN dividing the block), a K step folds that one weight scale into its rows' scales and scales its
    products with one FMA an element -- no float32 multiply per element -- where column scales take an outer-product
    multiply and an FMA; joined (``JOIN``) FC1 tiles do so with one MMA and one wait per K step, not two."""
    from rubin_compile.kernels.triton import moe as tmoe
    from rubin_compile.kernels.triton.tune_moe import persistent_config

    cfg = persistent_config(tmoe, (64, (64, 128, 4, 4), (128, 64, 4, 4), {"join": join}), a_fp8=True)
    for name, g, fn, consts, ptrs in _gemms(prefill, "fp8", cfg):
        consts["SCALAR_SW"] = scalar
        ptx, use = _compile(fn, consts, ptrs, g.num_warps, g.num_stages)
        body = next(b for b in loop_bodies(ptx) if any("wgmma.mma_async" in ln for ln in b))
        fma = sum(bool(re.search(r"\bfma\.rn\.f32\b", ln)) for ln in body)
        mul = sum(bool(re.search(r"\bmul\.(rn\.)?f32\b", ln)) for ln in body)
        elements = g.BM * g.BN * (2 if name == "fc1" else 1) // (32 * g.num_warps)  # accumulator values a thread holds
        assert fma == elements, (name, fma, elements)
        assert (mul < elements // 4) if scalar else (mul >= elements), (name, mul, elements)
        waits = re.findall(WAITS, "\n".join(body))
        assert len(waits) == (2 if name == "fc1" and not join else 1), (name, waits)
        assert use["LOCAL"] == 0 and use["STACK"] == 0, (name, use)


def test_alignment_and_sum_kernels_compile(prefill):
    """The alignment counts and claims positions with integer atomics (no float atomics anywhere: deterministic)."""
    count = compile_like_a_launch(
        prefill._align_count,
        dict(BLOCK=1024, GDC=True),
        dict(ids_ptr="*i64", counts_ptr="*i32", sorted_ptr="*i32"),
        dict(S=8192, P_MAX=24448, FILL=3056),
        num_stages=1,
    )
    scatter = compile_like_a_launch(
        prefill._align_scatter,
        dict(BM=128, E_P2=128, BLOCK=1024, TCH=64, GDC=True),
        dict(
            ids_ptr="*i64",
            counts_ptr="*i32",
            cursor_ptr="*i32",
            sorted_ptr="*i32",
            tile_expert_ptr="*i32",
            ntiles_ptr="*i32",
        ),
        dict(S=8192, E=128, TILES_MAX=191),
        num_stages=1,
    )
    total = compile_like_a_launch(
        prefill._sum_kernel,
        dict(BLOCK=1024, GDC=True),
        dict(y_ptr=BF, w_ptr="*fp32", out_ptr=BF),
        dict(H=2048, K_TOP=8, stride_ot=2048),
        num_stages=1,
    )
    for ptx in (count, scatter):
        assert re.search(r"\b(red|atom)\.global\.[\w.]*(add\.u32|add\.s32)", ptx)
    for ptx in (count, scatter, total):
        assert not re.search(r"\b(red|atom)\.[\w.]*\.f(16|32|64)", ptx), "a float atomic"


def test_persistent_configs_are_checked():
    from rubin_compile.kernels.triton import moe as tmoe

    G, M = tmoe.GemmConfig, tmoe.MoEConfig
    ok = M(mode="persistent", fc1=G(BM=128, BN=128, BK=64, num_warps=8), fc2=G(BM=128, BN=256, BK=64, num_warps=8))
    assert ok.problem() is None
    with pytest.raises(ValueError, match="fc1.BM .128. and fc2.BM .64. must be equal"):
        M(mode="persistent", fc1=G(BM=128), fc2=G(BM=64))
    with pytest.raises(ValueError, match="plain tiles"):
        M(mode="persistent", fc1=G(BM=64, swap=True), fc2=G(BM=64))
    with pytest.raises(ValueError, match="decode-path options"):
        M(mode="persistent", fc1=G(BM=64), fc2=G(BM=64), w2_l2=True)
    # programs per SM: the persistent grids' only
    assert M(mode="persistent", fc1=G(BM=64, occupancy=2), fc2=G(BM=64, occupancy=1)).problem() is None
    with pytest.raises(ValueError, match="occupancy=5: programs per SM of a persistent grid, 1 to 4"):
        M(mode="persistent", fc1=G(BM=64, occupancy=5), fc2=G(BM=64))
    with pytest.raises(ValueError, match="mode='grouped' takes occupancy=1"):
        M(mode="grouped", fc2=G(occupancy=2))
    with pytest.raises(ValueError, match="mode='slot' takes flatten=False"):
        M(mode="slot", fc1=G(flatten=True))


def test_tuner_tries_the_persistent_path_at_prefill_sizes_only():
    from rubin_compile.kernels.triton import moe as tmoe
    from rubin_compile.kernels.triton import tune_moe

    for T in (1, 64):
        assert not [c for c in tune_moe.candidate_configs(tmoe, T, 128, 2048, 768, 8, "bf16") if c.mode == "persistent"]
    cands = [c for c in tune_moe.candidate_configs(tmoe, 1024, 128, 2048, 768, 8, "bf16") if c.mode == "persistent"]
    assert len(cands) == len(tune_moe.PERSISTENT_TILES) + len(tune_moe.PERSISTENT_VARIANTS)
    opts = [(c.fc1.occupancy, c.fc2.occupancy, c.fc1.flatten, c.fc2.flatten) for c in cands]
    variants = [
        (*t[3].get("occupancy", (1, 1)), *t[3].get("flatten", (False, False))) for t in tune_moe.PERSISTENT_VARIANTS
    ]
    assert opts == [(1, 1, False, False)] * len(tune_moe.PERSISTENT_TILES) + variants
    assert len(set(cands)) == len(cands)  # a variant is never a tile of the plain list again
    for c in cands:
        assert c.problem() is None
        for which, g in (("fc1", c.fc1), ("fc2", c.fc2)):
            smem = g.num_stages * (g.BM * g.BK + (2 if which == "fc1" else 1) * g.BN * g.BK) * 2
            assert smem <= tmoe.SMEM_LIMIT, (which, g, smem)
    fp8 = tune_moe.persistent_candidates(tmoe, 1024, "fp8_block")
    w8a8 = [c for c in fp8 if c.a_fp8]
    assert len(w8a8) == len(tune_moe.PERSISTENT_TILES_FP8) + len(tune_moe.PERSISTENT_VARIANTS_FP8)
    w8a16 = len(tune_moe.PERSISTENT_TILES_W8A16) + len(tune_moe.PERSISTENT_VARIANTS_W8A16)
    assert len(fp8) == len(w8a8) + w8a16 and len(set(fp8)) == len(fp8)
    assert {c.fc1.occupancy for c in w8a8} == {1, 2} and {c.fc2.flatten for c in w8a8} == {False, True}
    for c in w8a8:  # FC2's K tile is FC1's N tile (the intermediate's scale groups); both divide the scale blocks
        assert c.problem() is None and c.fc2.BK == c.fc1.BN and 128 % c.fc1.BK == 0 and 128 % c.fc2.BK == 0
    for c in fp8[len(w8a8) :]:  # W8A16: a K step within one scale block
        assert c.problem() is None and not c.a_fp8 and 128 % c.fc1.BK == 0 and 128 % c.fc2.BK == 0


def test_tuner_can_weigh_the_persistent_path_alone_against_the_table():
    """``--modes persistent``: the heuristic, the table's entry for this T and the persistent tiles only."""
    from rubin_compile.kernels.triton import moe as tmoe
    from rubin_compile.kernels.triton import tune_moe

    entry = tmoe.load_config_table("NVIDIA H200")["configs"]["E=128,H=2048,I=768,k=8,w=bf16"]["1024"]
    cands = tune_moe.candidate_configs(tmoe, 1024, 128, 2048, 768, 8, "bf16", table_entry=entry, modes={"persistent"})
    heuristic = tmoe.heuristic_config(1024, 128, 2048, 768, 8, tmoe.torch.bfloat16)
    tiles = tune_moe.persistent_candidates(tmoe, 1024, "bf16")
    # the H200 table's entry is itself one of the persistent tiles since it was tuned: each candidate once
    assert cands == list(dict.fromkeys([heuristic, tmoe.MoEConfig.from_json(entry), *tiles]))
    assert set(tiles) <= set(cands)
    assert len(tiles) == len(tune_moe.PERSISTENT_TILES) + len(tune_moe.PERSISTENT_VARIANTS)


# (E, k, H, I) of the four tuned shapes and of held-out ones (benchmarks/moe_heuristic.py)
HEURISTIC_SHAPES = [
    (128, 8, 2048, 768),
    (256, 8, 7168, 256),
    (8, 2, 4096, 14336),
    (256, 8, 3072, 1536),
    (128, 8, 4096, 1536),
    (128, 4, 2880, 2880),
    (16, 1, 5120, 8192),
    (60, 4, 2048, 1408),
]


@pytest.mark.parametrize("E,k,H,I", HEURISTIC_SHAPES)
def test_heuristic_runs_tuned_persistent_tiles_at_prefill_sizes_on_sm90_only(E, k, H, I):
    """On sm_90 the heuristic runs the persistent path where moe_choice.PERSISTENT_SWITCH says (bf16: from T = 256
    at 16 rows per routed expert, from 512 at 32; FP8: from 512 at 32), with tiles the tuner tries (so the sm_90 compiles above
    and the GPU tests of the tuner's tiles cover them); below, elsewhere (sm90=False) and for FP8 weights without
    128-wide block scales it is the heuristic it was."""
    import torch

    from rubin_compile.kernels.triton import moe as tmoe
    from rubin_compile.kernels.triton import moe_choice as choice
    from rubin_compile.kernels.triton import tune_moe

    seen = set()
    for wfmt, wdt, block in (
        ("bf16", torch.bfloat16, None),
        ("fp16", torch.float16, None),
        ("fp8_block", torch.float8_e4m3fn, [128, 128]),
        ("fp8_tensor", torch.float8_e4m3fn, None),
    ):
        for T in (1, 8, 64, 256, 511, 512, 1024, 2048, 4096, 8192):
            before = tmoe.heuristic_config(T, E, H, I, k, wdt, block, 132)
            on_sm90 = tmoe.heuristic_config(T, E, H, I, k, wdt, block, 132, sm90=True)
            rows = choice.expected_rows(T, E, k)
            fp8 = wdt == torch.float8_e4m3fn
            prefill = (T >= 512 and rows >= 32) or (not fp8 and 256 <= T < 512 and rows >= 16)
            assert prefill == tmoe.heuristic_runs_persistent(T, E, k, fp8)
            if not prefill or wfmt == "fp8_tensor":
                assert on_sm90 == before, (wfmt, T)
                assert tmoe.persistent_heuristic(T, E, k, H, I, wdt, block) is None
                continue
            assert on_sm90.mode == "persistent" and on_sm90.problem() is None, (wfmt, T, on_sm90)
            tried = tune_moe.persistent_candidates(tmoe, T, "bf16" if wfmt == "fp16" else wfmt)
            assert on_sm90 in tried, (wfmt, T, on_sm90)
            assert on_sm90.fc1.BM == (64 if rows < (128 if wdt == torch.float8_e4m3fn else 64) else 128)
            assert on_sm90.a_fp8 == (wfmt == "fp8_block" and rows < 128)
            seen.add((wfmt, on_sm90.fc1.BM))
    assert ("bf16", 128) in seen  # every shape reaches 128-row tiles by T = 8192


def test_heuristic_persistent_tiles_are_the_h200_tables_winners():
    """The tiles come from the H200's tuning: where the table has an entry at T >= 1024, the heuristic's
    persistent config is that entry for 6 of the 8 bf16 and 5 of the 8 FP8 block entries (the docstring of
    ``persistent_heuristic`` names the others)."""
    import torch

    from rubin_compile.kernels.triton import moe as tmoe

    configs = tmoe.load_config_table("NVIDIA H200")["configs"]
    same = {"bf16": 0, "fp8_block": 0}
    total = {"bf16": 0, "fp8_block": 0}
    for key, entry in configs.items():
        fields = dict(f.split("=") for f in key.split(","))
        E, H, I, k, w = int(fields["E"]), int(fields["H"]), int(fields["I"]), int(fields["k"]), fields["w"]
        if w not in same:
            continue
        wdt, block = (torch.bfloat16, None) if w == "bf16" else (torch.float8_e4m3fn, [128, 128])
        for t, e in entry.items():
            if int(t) < 1024:
                continue
            total[w] += 1
            same[w] += tmoe.persistent_heuristic(int(t), E, k, H, I, wdt, block) == tmoe.MoEConfig.from_json(e)
    assert total == {"bf16": 8, "fp8_block": 8}
    assert same == {"bf16": 6, "fp8_block": 5}


def test_lookup_config_passes_sm90_to_the_heuristic():
    import torch

    from rubin_compile.kernels.triton import moe as tmoe

    cfg, src = tmoe.lookup_config(4096, 128, 4096, 1536, 8, torch.bfloat16, table={}, sm90=True)
    assert (src, cfg.mode) == ("heuristic", "persistent")
    cfg, src = tmoe.lookup_config(4096, 128, 4096, 1536, 8, torch.bfloat16, table={})
    assert (src, cfg.mode) == ("heuristic", "prefill")
    assert not tmoe.is_sm90(torch.device("cpu"))
