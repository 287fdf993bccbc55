"""The Triton MoE provider on a CPU: config lookup, heuristics, registry wiring, and the kernels' indexing
under Triton's interpreter (float32, tiny shapes; the interpreter computes bf16 dots wrongly)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rubin_compile.ops.moe import MOE, MoEArgs, moe_reference
from rubin_compile.ops.registry import Launch, Placement
from rubin_compile.target import detect, resolve
from tests.cpu.kernels.triton_interp import run_file, triton_version

ROOT = Path(__file__).resolve().parents[3]
PKG = "rubin_compile.kernels.triton"


@pytest.fixture(scope="module")
def tmoe():
    """rubin_compile.kernels.triton.moe imported with TRITON_INTERPRET=1 (kernels run on CPU tensors)."""
    pytest.importorskip("triton", reason="the Triton provider needs the triton package")
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    saved = {n: m for n, m in sys.modules.items() if n == PKG or n.startswith(PKG + ".")}
    for n in saved:
        del sys.modules[n]
    try:
        yield importlib.import_module(PKG + ".moe")
    finally:
        for n in [n for n in sys.modules if n == PKG or n.startswith(PKG + ".")]:
            del sys.modules[n]
        sys.modules.update(saved)
        mp.undo()


# ------------------------------------------------------------------ registry


def test_the_kernel_is_registered_from_its_package():
    kernel = MOE.kernel("triton")
    assert kernel.module == PKG and kernel.placements == ("split_n",) and kernel.pdl is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_registry_says_cannot_run_without_cuda():
    code = (
        "from rubin_compile.ops.moe import MOE\n"
        "from rubin_compile.ops.registry import KernelUnavailableError\n"
        "try:\n"
        "    MOE.run('triton', None)\n"
        "except KernelUnavailableError as e:\n"
        "    print('REFUSED', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert "REFUSED" in r.stdout, r.stdout + r.stderr
    assert "cannot run on this machine" in r.stdout and "CUDA" in r.stdout


def test_the_registered_adapter_runs_the_kernels_with_the_launch(tmoe, monkeypatch):
    """The adapter hands the op's arguments and launch settings to kernels/triton/moe.py's ``run`` unchanged
    (here under the interpreter, where the kernel counts as runnable)."""
    kernel = MOE.kernel("triton")
    assert kernel.unavailable_here(detect()) is None
    calls = []
    monkeypatch.setattr(tmoe, "run", lambda args, launch: calls.append((args, launch)) or "ran")
    args = MoEArgs(
        torch.randn(2, 8), torch.randn(4, 6, 8), torch.randn(4, 8, 3), torch.rand(2, 2), torch.randint(0, 4, (2, 2))
    )
    launch = Launch(True, Placement("backfill", 2, 16))
    assert kernel.run(args, launch) == "ran" and calls == [(args, launch)]


# ------------------------------------------------------------------ configs


BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


@pytest.mark.parametrize(
    "T,E,H,I,k",
    [
        (1, 128, 2048, 768, 8),
        (8, 128, 2048, 768, 8),
        (1, 8, 4096, 14336, 2),
        (64, 256, 7168, 256, 8),
        (256, 256, 3072, 1536, 8),
        (4096, 128, 2048, 768, 8),
    ],
)
@pytest.mark.parametrize("wdt,block", [(BF16, None), (FP8, [128, 128]), (FP8, None)])
def test_heuristic_is_valid(tmoe, T, E, H, I, k, wdt, block):
    cfg = tmoe.heuristic_config(T, E, H, I, k, wdt, block)
    S = T * k
    assert cfg.mode == ("slot" if S <= tmoe.SLOT_MAX else cfg.mode)
    if S > tmoe.SLOT_MAX:
        assert cfg.mode in ("grouped", "prefill")
    if T >= 4096:
        assert cfg.mode == "prefill" and cfg.cap == cfg.fc1.BM
    for g in (cfg.fc1, cfg.fc2):
        for v in (g.BM, g.BN, g.BK):
            assert v >= 16 and v & (v - 1) == 0
        if block is not None:
            assert block[1] % g.BK == 0  # a K step never straddles a scale block
    if cfg.mode != "prefill":  # decode: enough programs to cover the SMs
        groups = tmoe.expected_distinct_experts(T, E, k)
        assert groups * -(-H // cfg.fc2.BN) >= 132


@pytest.mark.parametrize("wfmt", ["bf16", "fp8_block"])
def test_heuristic_fits_shared_memory_on_benchmark_shapes(tmoe, wfmt):
    # the heuristic is what runs for shapes the tuned table lacks: it must always compile
    from rubin_compile.kernels.triton.tune_moe import SHAPES, TOKENS

    wdt, block, w_elt = (BF16, None, 2) if wfmt == "bf16" else (FP8, [128, 128], 1)
    for sh in SHAPES.values():
        for T in TOKENS + [3, 48, 200, 600, 2000]:
            cfg = tmoe.heuristic_config(T, sh["E"], sh["H"], sh["I"], sh["k"], wdt, block)
            assert tmoe.smem_estimate(cfg.fc1, "fc1", 2, w_elt) <= tmoe.SMEM_LIMIT, (sh, T, cfg)
            assert tmoe.smem_estimate(cfg.fc2, "fc2", 2, w_elt) <= tmoe.SMEM_LIMIT, (sh, T, cfg)


def test_smem_estimate_matches_compiled_kernels(tmoe):
    # shared memory the compiled sm_90 kernels reported (ptxas via Triton, see moe-notes.md)
    G = tmoe.GemmConfig
    assert tmoe.smem_estimate(G(BM=16, BN=32, BK=128, num_stages=4), "fc1", 2, 2) == 61440
    assert tmoe.smem_estimate(G(BM=16, BN=64, BK=128, num_stages=4, swap=True), "fc1", 2, 2) == 147456
    assert tmoe.smem_estimate(G(BM=128, BN=64, BK=64, num_warps=8, num_stages=3), "fc1", 2, 2) == 98304
    # FC2 after a K-split FC1, as ptxas reported them for sm_90 (Triton 3.9 AOT compile on the CPU)
    for split, stages, swap, bn, reported in (
        (2, 2, False, 64, 49152),
        (4, 4, False, 64, 212992),
        (8, 2, False, 64, 147456),
        (2, 3, True, 128, 102400),
        (4, 4, True, 128, 233472),
        (8, 2, True, 128, 167936),
    ):
        est = tmoe.smem_estimate(G(BM=16, BN=bn, BK=128, num_stages=stages, swap=swap), "fc2", 2, 2, split1=split)
        assert reported <= est <= reported + 4096
    fitted = tmoe.fit_smem(G(BM=16, BN=128, BK=128, num_stages=4, swap=True), "fc2", 2, 2, split1=8)
    assert fitted.num_stages == 2 and tmoe.smem_estimate(fitted, "fc2", 2, 2, split1=8) <= tmoe.SMEM_LIMIT


def test_scale_blocks_narrower_than_a_k_tile_are_refused(tmoe):
    """FP8 blocks of 8 along K would put two scale blocks in one 16-wide K tile: the plan refuses (the old plan
    silently widened the tile and mis-scaled), and selection does not offer the kernel for them."""
    from rubin_compile.kernels.triton import _moe_supports
    from rubin_compile.ops.moe import MoEArgumentError

    with pytest.raises(MoEArgumentError, match="scale blocks of 8 along K"):
        tmoe.plan_call(
            1,
            64,
            4,
            32,
            2,
            torch.bfloat16,
            torch.float8_e4m3fn,
            (16, 8),
            "silu",
            tmoe.MoEConfig(),
            True,
            False,
            False,
            True,
        )
    from rubin_compile.ops.registry import KernelSpec

    def spec(block):
        return KernelSpec("moe", "fp8_block", "bfloat16", "float8_e4m3fn", block, (("E", 4), ("H", 64)), "silu")

    assert "multiples of 16" in (_moe_supports(resolve("sm90"), spec((16, 8))) or "")
    assert _moe_supports(resolve("sm90"), spec((128, 128))) is None


def test_split_n_runs_fc1_unsplit_when_fc2_cannot_take_the_e4m3_intermediate(tmoe):
    """Over locality domains FC1 may stay split over K only when it sums its own partials into the e4m3
    intermediate; if FC2's tile (K = FC1's N tile) does not fit shared memory, there is no e4m3 intermediate,
    and FC1 must run unsplit (FC2's sum of float32 partials is per whole call)."""
    G = tmoe.GemmConfig
    cfg = tmoe.MoEConfig(
        mode="grouped", a_fp8=True, fc1=G(BM=16, BN=128, BK=128, split_k=2), fc2=G(BM=512, BN=16, BK=128)
    )
    args = (64, 2048, 8, 256, 2, torch.bfloat16, torch.float8_e4m3fn, (128, 128), "silu", cfg, True, False)
    whole = tmoe.plan_call(*args, False, True)
    assert not whole.q_inter and whole.split == 2 and not whole.split_sum  # FC2 sums the partials
    placed = tmoe.plan_call(*args, True, True)
    assert not placed.q_inter and placed.split == 1 and not placed.split_sum


def test_expected_distinct_experts(tmoe):
    assert tmoe.expected_distinct_experts(1, 128, 8) == pytest.approx(8)
    assert tmoe.expected_distinct_experts(4096, 128, 8) == pytest.approx(128)
    assert tmoe.expected_distinct_experts(0, 128, 8) == 0


def test_lookup_uses_nearest_tuned_token_count(tmoe):
    key = tmoe.shape_key(128, 2048, 768, 8, BF16)
    c1 = tmoe.MoEConfig(mode="slot", fc1=tmoe.GemmConfig(BN=16)).to_json()
    c64 = tmoe.MoEConfig(mode="grouped", fc1=tmoe.GemmConfig(BN=64)).to_json()
    table = {"configs": {key: {"1": c1, "64": c64}}}
    cfg, src = tmoe.lookup_config(1, 128, 2048, 768, 8, BF16, table=table)
    assert cfg.fc1.BN == 16 and src.endswith("@T=1")
    cfg, src = tmoe.lookup_config(100, 128, 2048, 768, 8, BF16, table=table)
    assert cfg.fc1.BN == 64 and cfg.mode == "grouped" and src.endswith("@T=64")
    # a slot-mode entry used for more slots than slot mode handles becomes grouped, keeping its tiles
    cfg, _ = tmoe.lookup_config(7, 128, 2048, 768, 8, BF16, table=table)
    assert cfg.mode == "slot"  # nearest is T=1 (log2 distance 2.8 vs 3.2), 56 slots still fit
    cfg, _ = tmoe.lookup_config(9, 128, 2048, 768, 8, BF16, table={"configs": {key: {"1": c1}}})
    assert cfg.mode == "grouped" and cfg.fc1.BN == 16
    # another shape or weight format is not in the table: heuristic
    cfg, src = tmoe.lookup_config(1, 128, 2048, 768, 8, FP8, [128, 128], table=table)
    assert src == "heuristic"


def test_config_json_round_trip(tmoe):
    cfg = tmoe.MoEConfig(mode="prefill", cap=64, fc1=tmoe.GemmConfig(BM=64, BN=128, BK=64, num_warps=8), a_fp8=True)
    assert tmoe.MoEConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg


def test_device_file_name(tmoe):
    assert tmoe.device_file_name("NVIDIA H200") == "NVIDIA_H200.json"
    assert tmoe.device_file_name("NVIDIA GH200 480GB") == "NVIDIA_GH200_480GB.json"


def test_shipped_tables_are_valid(tmoe):
    files = sorted(tmoe.CONFIG_DIR.glob("*.json"))
    for f in files:
        table = json.loads(f.read_text())
        assert f.name == tmoe.device_file_name(table["device"])
        for key, entry in table["configs"].items():
            assert key.startswith("E=")
            for t, c in entry.items():
                cfg = tmoe.MoEConfig.from_json(c)
                assert cfg.mode in ("slot", "grouped", "prefill", "persistent")
                assert cfg.problem() is None, (f.name, key, t)
                assert cfg.mode != "slot" or int(t) * int(key.split("k=")[1].split(",")[0]) <= tmoe.SLOT_MAX


def test_tuner_tries_k_split_only_where_n_tiles_cannot_fill_the_gpu(tmoe):
    from rubin_compile.kernels.triton import tune_moe as tm

    def splits(shape, T):  # of the two-kernel decode path (the fused path's split tiles are fixed: moe_decode.TUNE_FC1)
        cands = tm.candidate_configs(tmoe, T, **tm.SHAPES[shape], wfmt="bf16")
        return {c.fc1.split_k for c in cands if c.mode != "fused"}

    assert max(splits("deepseek-v3-tp8", 1)) > 1  # I = 256: 8 experts x 16 N tiles of 16 < 132 SMs
    assert splits("mixtral-8x7b", 1) == {1} and splits("deepseek-v3-tp8", 64) == {1}
    for c in tm.candidate_configs(tmoe, 1, **tm.SHAPES["deepseek-v3-tp8"], wfmt="bf16"):
        assert c.fc1.split_k * 2 * c.fc1.BK <= 7168  # every K range keeps at least two K tiles


def test_tuner_second_round_joins_best_fc1_and_fc2_with_boundary_options(tmoe):
    from dataclasses import replace

    from rubin_compile.kernels.triton import tune_moe as tm

    base = tmoe.heuristic_config(4, 128, 2048, 768, 8, torch.bfloat16)
    fast1 = replace(base, fc1=replace(base.fc1, BN=16, num_stages=5))
    fast2 = replace(base, fc2=replace(base.fc2, BN=128, swap=True))
    results = [(30.0, base), (20.0, fast1), (25.0, fast2)]
    r2 = tm.round_two(tmoe, results, base, 2048, 768, "bf16")
    joined = replace(base, fc1=fast1.fc1, fc2=fast2.fc2)
    assert joined in r2 and replace(joined, w2_l2=True) in r2 and replace(fast1, w2_l2=True) in r2
    early = [c for c in r2 if c.early_launch]
    assert early and all(c.fc2.prefetch >= c.fc2.BN * 768 * 2 for c in early)  # FC2's whole slice
    assert not {c for _, c in results} & set(r2)  # nothing timed twice


def test_gemv_configs_that_cannot_run_are_refused_with_the_fix(tmoe):
    """The reduction (GEMV) form's limits, named with the fix when a config is built (a table entry, a tuner
    candidate, a hand-written config): no swapped tile, at most GEMV_MAX_BM rows per chunk, no FP8 activations,
    no GEMV FC2 after a K-split FC1."""
    G, C = tmoe.GemmConfig, tmoe.MoEConfig
    ok = C(fc1=G(BM=1, BN=16, BK=256, num_stages=1, gemv=True), fc2=G(BM=2, BN=32, BK=128, gemv=True))
    assert ok.problem() is None and tmoe.MoEConfig.from_json(json.loads(json.dumps(ok.to_json()))) == ok
    for bad, said in (
        (dict(fc1=G(BM=1, gemv=True, swap=True)), "fc1: gemv=True and swap=True exclude each other"),
        (dict(fc2=G(BM=8, gemv=True)), "fc2: gemv=True takes BM <= 4 rows per chunk, not 8"),
        (dict(fc1=G(BM=1, gemv=True), a_fp8=True), "a_fp8=True needs the tensor cores"),
        (dict(fc1=G(split_k=2), fc2=G(BM=1, gemv=True)), "set fc1.split_k=1"),
    ):
        with pytest.raises(ValueError, match=re.escape(said)):
            C(**bad)
    # a K-split FC1 in the GEMV form is fine (FC2's MMA form sums its partials)
    assert C(fc1=G(BM=1, gemv=True, split_k=2)).problem() is None


def test_gemv_tile_across_scale_blocks_is_refused(tmoe):
    """With 128 x 128 block scales a GEMV tile takes one scale per K step, so a tile whose rows straddle a scale
    block is refused: with I = 136, FC1's up rows start at row 136 and the up tile of gate rows [112, 128) is rows
    [248, 264), across the block edge at 256. With I = 128 every tile lies in one block."""
    from rubin_compile.ops.moe import MoEArgumentError

    G = tmoe.GemmConfig
    cfg = tmoe.MoEConfig(fc1=G(BM=1, BN=16, BK=128, num_stages=1, gemv=True))
    args = (1, 256, 4, 136, 2, torch.bfloat16, torch.float8_e4m3fn, (128, 128), "silu", cfg, True, False, False, True)
    with pytest.raises(MoEArgumentError, match="GEMV tile of BN=16 rows straddles"):
        tmoe.plan_call(*args)
    fine = tmoe.plan_call(1, 256, 4, 128, 2, *args[5:])
    assert fine.fc1.gemv and fine.fc1.BN == 16


def test_tuner_tries_gemv_tiles_only_at_decode(tmoe):
    """Decode groups of 1-4 rows get reduction-form candidates: BM the expected rows per routed expert rounded up
    (and 1), at most 64 float32 accumulators per thread, one stage; never with FP8 activations; with FP8 block
    scales only tiles inside one scale block. None past T = 8."""
    from rubin_compile.kernels.triton import tune_moe as tm

    for shape in tm.SHAPES:
        for wfmt in ("bf16", "fp8_block"):
            one = tm.candidate_configs(tmoe, 1, **tm.SHAPES[shape], wfmt=wfmt)
            gemv = [(c, g, n) for c in one for g, n in ((c.fc1, "fc1"), (c.fc2, "fc2")) if g.gemv]
            assert {n for _, _, n in gemv} == {"fc1", "fc2"}, (shape, wfmt)
            for c, g, n in gemv:
                assert c.problem() is None and not c.a_fp8 and g.BM == 1 and g.num_stages == 1
                assert (2 if n == "fc1" else 1) * g.BM * g.BN * g.BK <= 64 * 32 * g.num_warps
                if wfmt == "fp8_block":
                    assert 128 % g.BN == 0 and (n == "fc2" or tm.SHAPES[shape]["I"] % g.BN == 0)
            two = tm.candidate_configs(tmoe, 2, **tm.SHAPES[shape], wfmt=wfmt)
            assert {g.BM for c in two for g in (c.fc1, c.fc2) if g.gemv} == {1, 2}
            assert not any(g.gemv for c in tm.candidate_configs(tmoe, 16, **tm.SHAPES[shape], wfmt=wfmt)
                           for g in (c.fc1, c.fc2))  # fmt: skip


def test_every_decode_tuner_candidate_builds_a_plan(tmoe):
    """Each candidate the tuner would time at T <= 8, on every benchmark shape and weight format, is a config
    ``plan_call`` accepts for that shape (a refused one would cost its compile and timing slot on the GPU)."""
    from rubin_compile.kernels.triton import tune_moe as tm

    count = 0
    for sh in tm.SHAPES.values():
        for wfmt in tm.WEIGHT_FORMATS:
            wdt = BF16 if wfmt == "bf16" else FP8
            block = (128, 128) if wfmt == "fp8_block" else None
            for T in (1, 2, 4, 8):
                for c in tm.candidate_configs(tmoe, T, sh["E"], sh["H"], sh["I"], sh["k"], wfmt):
                    args = (T, sh["H"], sh["E"], sh["I"], sh["k"], BF16, wdt, block, "silu", c)
                    tmoe.plan_call(*args, True, True, False, False)
                    count += 1
    assert count > 1000


def test_tuner_second_round_skips_a_join_that_cannot_run(tmoe):
    """The best FC1 on FP8 activations joined with a GEMV FC2 (which cannot read them) is not tried; the round
    still tries the winner with its boundary options."""
    from dataclasses import replace

    from rubin_compile.kernels.triton import tune_moe as tm

    base = tmoe.heuristic_config(1, 128, 2048, 768, 8, torch.float8_e4m3fn, [128, 128])
    assert base.a_fp8
    gemv2 = replace(base, a_fp8=False, fc2=tmoe.GemmConfig(BM=1, BN=16, BK=128, num_stages=1, gemv=True))
    fast1 = replace(base, fc1=replace(base.fc1, num_stages=6))
    results = [(30.0, base), (20.0, fast1), (25.0, gemv2)]
    r2 = tm.round_two(tmoe, results, base, 2048, 768, "fp8_block")
    assert r2 and all(c.problem() is None for c in r2)
    assert replace(fast1, w2_l2=True) in r2 and not any(c.fc2.gemv and c.a_fp8 for c in r2)


def test_route_groups_torch(tmoe):
    ids = torch.tensor([3, 1, 3, 3, 0, 3, 1, 3], dtype=torch.int64)
    sorted_slots, gexp, gstart, gcount = tmoe.route_groups_torch(ids, E=5, cap=2)
    assert sorted_slots.tolist() == [4, 1, 6, 0, 2, 3, 5, 7]
    valid = gcount > 0
    assert gexp[valid].tolist() == [0, 1, 3, 3, 3]
    assert gstart[valid].tolist() == [0, 1, 3, 5, 7]
    assert gcount[valid].tolist() == [1, 2, 2, 2, 1]
    assert int(gcount.sum()) == ids.numel()


# ------------------------------------------------------------------ kernels under the interpreter
# Triton decorates its own standard library (tl.sum, tl.cdiv, ...) when it is first imported, so the
# interpreter works only if TRITON_INTERPRET=1 is set before that: the kernels run in one subprocess.

INTERP_CASES = [
    # T, E, H, I, k, mode, options
    (1, 8, 32, 16, 2, "slot", {}),
    (3, 5, 40, 24, 2, "slot", {"act": "gelu_tanh", "bias": True}),  # H, I not multiples of the tiles
    (3, 5, 40, 24, 2, "slot", {"fused": False}),
    (20, 4, 32, 16, 1, "slot", {}),  # k = 1, 20 rows on <= 4 experts: the per-group row-chunk loop
    (6, 4, 32, 16, 3, "slot", {"route": "one_expert"}),  # duplicate experts within a row
    (40, 6, 48, 32, 2, "grouped", {"noncontig": True}),
    (40, 6, 48, 32, 2, "prefill", {"cap": 16}),
    (9, 3, 32, 16, 3, "grouped", {"act": "gelu_tanh"}),
    (0, 4, 32, 16, 2, "slot", {}),  # zero-size batch
    (3, 5, 40, 24, 2, "slot", {"swap": True, "bias": True}),  # weight tile as the MMA's M side
    (40, 6, 48, 32, 2, "grouped", {"swap": True, "act": "gelu_tanh"}),
    (20, 4, 32, 16, 1, "slot", {"swap": True}),
    # FC1 split over K (partials reduced and activated in FC2): 3 ranges of 16 over H = 40 (last one short),
    # with bias (added once) and GELU; in each routing mode; with swapped tiles
    (3, 5, 40, 24, 2, "slot", {"split": 3, "bias": True, "act": "gelu_tanh"}),
    (40, 6, 48, 32, 2, "grouped", {"split": 2, "swap": True}),
    (40, 6, 48, 32, 2, "prefill", {"split": 4, "cap": 16, "fused": False}),
    # split-N over 2 locality domains (run one after another here): FC1 on each half of I with its up
    # rows, FC2 on each half of H; shards as views of the weights (uniform memory) and as copies (sm_107)
    (3, 5, 256, 256, 2, "slot", {"split_n": "views", "bias": True, "act": "gelu_tanh"}),
    (40, 6, 256, 384, 2, "grouped", {"split_n": "copies", "bias": True}),
    # FP8 weights: 16 x 16 scale blocks, one per K tile (the scales loaded one K step ahead), W8A16 ...
    (3, 5, 48, 32, 2, "slot", {"wfmt": "fp8_block", "bias": True}),
    (40, 6, 48, 32, 2, "grouped", {"wfmt": "fp8_block", "swap": True}),
    # ... and FP8 activations (within e4m3's error): the hidden states quantised once before FC1, FC1's
    # epilogue writing the e4m3 intermediate FC2 reads (FC2's K tile = FC1's N tile); after a K-split FC1
    # FC2 quantises its own A tiles; over locality domains FC1 reads the quantised copy, FC2 quantises
    (3, 5, 48, 32, 2, "slot", {"wfmt": "fp8_block", "a_fp8": True, "swap": True}),
    (40, 6, 48, 40, 2, "grouped", {"wfmt": "fp8_block", "a_fp8": True, "act": "gelu_tanh"}),
    (40, 6, 48, 32, 2, "prefill", {"wfmt": "fp8_tensor", "a_fp8": True, "cap": 16}),
    (3, 5, 48, 32, 2, "slot", {"wfmt": "fp8_block", "a_fp8": True, "split": 3}),  # FC1's last program sums
    (40, 6, 48, 32, 2, "grouped", {"wfmt": "fp8_block", "a_fp8": True, "split": 2, "swap": True}),
    # FC1 tiles wider than the scale block: no e4m3 intermediate, FC2 sums the partials and quantises
    (3, 5, 48, 32, 2, "slot", {"wfmt": "fp8_block", "a_fp8": True, "split": 2, "bn1": 32}),
    (3, 5, 48, 32, 2, "slot", {"wfmt": "fp8_tensor", "a_fp8": True, "split": 3, "act": "gelu_tanh", "bias": True}),
    (3, 5, 256, 256, 2, "slot", {"split_n": "views", "wfmt": "fp8_block", "a_fp8": True}),
    (3, 5, 256, 256, 2, "slot", {"split_n": "copies", "wfmt": "fp8_block", "a_fp8": True, "split": 2}),
    (40, 6, 256, 384, 2, "grouped", {"split_n": "views", "wfmt": "fp8_tensor", "a_fp8": True, "split": 2}),
    # the reduction (GEMV) form, ``gemv`` = (FC1's, FC2's) rows per chunk (0: that GEMM's MMA form): T = 1; groups
    # of more rows than a chunk (the row-chunk loop); H, I not multiples of the tiles, bias, GELU; route tables;
    # FP8 weights converted in registers (block and per-tensor scales); a K-split FC1 summed by FC2's MMA form;
    # split-N (bitwise the whole call); each GEMM alone in the GEMV form
    (1, 8, 32, 16, 2, "slot", {"gemv": (1, 1)}),
    (3, 5, 40, 24, 2, "slot", {"gemv": (1, 2), "act": "gelu_tanh", "bias": True}),
    (20, 4, 32, 16, 1, "slot", {"gemv": (4, 4)}),
    (40, 6, 48, 32, 2, "grouped", {"gemv": (2, 4), "noncontig": True}),
    (3, 5, 48, 32, 2, "slot", {"wfmt": "fp8_block", "gemv": (1, 1), "bias": True}),
    (3, 5, 48, 32, 2, "slot", {"wfmt": "fp8_tensor", "gemv": (2, 1), "act": "gelu_tanh"}),
    (3, 5, 40, 24, 2, "slot", {"gemv": (1, 0), "split": 3, "bias": True}),
    (3, 5, 256, 256, 2, "slot", {"split_n": "views", "gemv": (1, 1), "bias": True}),
    (1, 8, 32, 16, 2, "slot", {"gemv": (0, 1)}),
    # ... and in bf16 (the kernels' roundings: the intermediate, each slot's row and the output in bf16), bf16 and
    # FP8 block weights, against an emulation of exactly those roundings
    (1, 8, 64, 32, 2, "slot", {"gemv": (1, 1), "dtype": "bf16", "act": "gelu_tanh", "bias": True}),
    (3, 5, 48, 32, 2, "slot", {"gemv": (2, 1), "dtype": "bf16", "wfmt": "fp8_block"}),
    # the persistent prefill path (moe_prefill.py): the slots aligned into BM-row tiles on the device, TMA descriptors,
    # the persistent walk over (M tile, N tile); H, I not multiples of the tiles with bias and GELU; every slot on one
    # expert; few tokens; zero tokens; and a call it does not take (rows of x not contiguous: another mode runs it)
    (40, 6, 48, 32, 2, "persistent", {}),
    (40, 6, 40, 24, 2, "persistent", {"act": "gelu_tanh", "bias": True}),
    (20, 4, 32, 16, 1, "persistent", {"route": "one_expert"}),
    (9, 3, 32, 16, 3, "persistent", {}),
    (0, 4, 32, 16, 2, "persistent", {}),
    (40, 6, 48, 32, 2, "persistent", {"noncontig": True}),
    # ... with FP8 weights: the hidden states in e4m3 once per call (groups of FC1's K tile), e4m3 products scaled per
    # K tile by the rows' and the 16 x 16 blocks' scales (or one per expert and projection), FC1 writing the e4m3
    # intermediate with one scale per (row, N tile) = FC2's K tile; bias, GELU
    (40, 6, 48, 32, 2, "persistent", {"wfmt": "fp8_block", "a_fp8": True}),
    (40, 6, 48, 48, 2, "persistent", {"wfmt": "fp8_block", "a_fp8": True, "act": "gelu_tanh", "bias": True}),
    (40, 6, 48, 32, 2, "persistent", {"wfmt": "fp8_tensor", "a_fp8": True, "bias": True}),
    # ... and W8A16 (a_fp8=False): the e4m3 weight tiles dequantised in registers, accumulated transposed
    (40, 6, 48, 32, 2, "persistent", {"wfmt": "fp8_block"}),
    (40, 6, 48, 48, 2, "persistent", {"wfmt": "fp8_block", "act": "gelu_tanh", "bias": True, "route": "one_expert"}),
    (40, 6, 48, 32, 2, "persistent", {"wfmt": "fp8_tensor", "bias": True}),
    # ... the persistent walk with more work items than programs: a GPU of 2 SMs, one or two programs per SM
    # (GemmConfig.occupancy), each program walking several (M tile, N tile) items; bitwise the one-program-per-item run
    (40, 6, 48, 32, 2, "persistent", {"sms": 2, "occupancy": (2, 1), "bias": True}),
    (40, 6, 48, 32, 2, "persistent", {"sms": 2, "occupancy": (1, 2), "wfmt": "fp8_block", "a_fp8": True}),
    (40, 6, 48, 32, 2, "persistent", {"sms": 3, "occupancy": (2, 2), "wfmt": "fp8_block"}),
    # ... and with the item loop flattened (GemmConfig.flatten: one loop over the program's items' K steps)
    (40, 6, 48, 32, 2, "persistent", {"sms": 2, "flatten": (True, True), "act": "gelu_tanh", "bias": True}),
    (40, 6, 48, 32, 2, "persistent", {"sms": 2, "occupancy": (2, 2), "flatten": (False, True), "wfmt": "fp8_block"}),
    # ... with FC1's gate and up tiles joined (GemmConfig.join: one TMA box over w13 seen as [E * 2, I, H], one MMA
    # of 2 BN columns); bitwise the unjoined run: I not a multiple of the tile (the box's zero fill past I), bias,
    # GELU; FP8 W8A8 with one block scale per tile (the product seen as [BM, 2, BN], a row scale per half) and with
    # scale blocks narrower than the tile (8 x 16: column scales); W8A16; per-tensor scales
    (40, 6, 48, 32, 2, "persistent", {"join": True, "bias": True}),
    (40, 6, 40, 24, 2, "persistent", {"join": True, "act": "gelu_tanh", "bias": True}),
    (40, 6, 48, 32, 2, "persistent", {"join": True, "wfmt": "fp8_block", "a_fp8": True}),
    (40, 6, 48, 48, 2, "persistent", {"join": True, "wfmt": "fp8_block", "a_fp8": True, "block": (8, 16)}),
    (40, 6, 48, 32, 2, "persistent", {"wfmt": "fp8_block", "a_fp8": True, "block": (8, 16), "bias": True}),
    (40, 6, 48, 32, 2, "persistent", {"join": True, "wfmt": "fp8_block", "act": "gelu_tanh"}),
    (40, 6, 48, 32, 2, "persistent", {"join": True, "wfmt": "fp8_tensor", "a_fp8": True, "bias": True}),
]
FP8_ACT_TOL = 6e-2  # e4m3 activations: a 3-bit mantissa (tests/gpu/test_triton_moe.py uses the same)


def _interp_case(
    tmoe,
    T,
    E,
    H,
    I,
    k,
    mode,
    act="silu",
    bias=False,
    cap=0,
    fused=True,
    route="random",
    noncontig=False,
    swap=False,
    split=1,
    split_n=None,
    wfmt="fp32",
    a_fp8=False,
    bn1=None,
    gemv=(0, 0),
    dtype="fp32",
    occupancy=(1, 1),
    flatten=(False, False),
    sms=None,
    join=False,
    block=(16, 16),
):
    """Run one case through the kernels; return (relative error vs float64 reference, any NaN left, relative error
    vs the emulated FP8-activation or bf16 computation)."""
    g = torch.Generator().manual_seed(T * 1000 + E * 10 + k)
    x = torch.randn((T, 2 * H) if noncontig else (T, H), generator=g)
    if noncontig:
        x = x[:, ::2]
    w13 = torch.randn((E, 2 * I, H), generator=g) / H**0.5
    w2 = torch.randn((E, H, I), generator=g) / I**0.5
    if route == "one_expert":
        ids = torch.full((T, k), E - 1, dtype=torch.int64)
    else:
        ids = torch.rand((T, E), generator=g).topk(k, dim=-1).indices
    tw = torch.softmax(torch.randn((T, k), generator=g), -1)
    b13 = torch.randn((E, 2 * I), generator=g) if bias else None
    b2 = torch.randn((E, H), generator=g) if bias else None
    quant = {}
    if wfmt != "fp32":  # e4m3 weights (x 32, so they use the format's range) with their scales
        w13, w2 = (w13 * 32).to(torch.float8_e4m3fn), (w2 * 32).to(torch.float8_e4m3fn)
        if wfmt == "fp8_block":
            bn, bk = (128, 128) if split_n else block
            quant["block_shape"] = [bn, bk]
            quant["w13_scale"] = torch.rand((E, -(-2 * I // bn), -(-H // bk)), generator=g) / 32 + 1e-2
            quant["w2_scale"] = torch.rand((E, -(-H // bn), -(-I // bk)), generator=g) / 32 + 1e-2
        else:
            quant["w13_scale"], quant["w2_scale"] = torch.tensor(1 / 32), torch.tensor(1 / 40)
    if dtype == "bf16":  # activations, biases and unquantised weights
        x = x.bfloat16()
        b13, b2 = (None if b is None else b.bfloat16() for b in (b13, b2))
        if not quant:
            w13, w2 = w13.bfloat16(), w2.bfloat16()
    G = tmoe.GemmConfig
    tile = 64 if split_n else 16
    cfg = tmoe.MoEConfig(
        mode=mode,
        cap=cap,
        fused_sum=fused,
        a_fp8=a_fp8,
        fc1=G(BM=gemv[0] or 16, BN=bn1 or tile, BK=tile, swap=swap, split_k=split, gemv=gemv[0] > 0),
        fc2=G(BM=gemv[1] or 16, BN=tile, BK=tile, swap=swap, gemv=gemv[1] > 0),
    )
    if sms:  # the persistent grids on a GPU of ``sms`` SMs, ``occupancy`` programs per SM, item loops ``flatten``ed
        cfg = dataclasses.replace(
            cfg,
            fc1=dataclasses.replace(cfg.fc1, occupancy=occupancy[0], flatten=flatten[0]),
            fc2=dataclasses.replace(cfg.fc2, occupancy=occupancy[1], flatten=flatten[1]),
        )
    if join:
        cfg = dataclasses.replace(cfg, fc1=dataclasses.replace(cfg.fc1, join=True))
    out = torch.full((T, H), float("nan"), dtype=x.dtype)
    placement, domains = "", None
    if split_n:
        from rubin_compile.runtime import locality

        placement = "split_n:default:2:64"
        domains = locality.sequential(2, x.device, localized_memory=split_n == "copies")
    facts = tmoe._device_facts
    if sms:
        tmoe._device_facts = lambda device: ("cpu", sms, 0)
    try:
        tmoe.fused_moe(
            x, w13, w2, tw, ids, act, b13, b2, config=cfg, out=out, placement=placement, domains=domains, **quant
        )
    finally:
        tmoe._device_facts = facts
    if sms:  # which program computes an item (or the loop's shape) must not change a value: bitwise one per item
        items = -(-(T * k + E * 15) // 16) * -(-min(I, H) // tile)  # the smaller GEMM's work items
        assert sms * max(occupancy) < items, "the case must give a program several items"
        plain = dict(occupancy=1, flatten=False)
        one_each = dataclasses.replace(
            cfg, fc1=dataclasses.replace(cfg.fc1, **plain), fc2=dataclasses.replace(cfg.fc2, **plain)
        )
        if not torch.equal(tmoe.fused_moe(x, w13, w2, tw, ids, act, b13, b2, config=one_each, **quant), out):
            return float("inf"), False, float("inf")
    if join:  # joining the gate and up tiles must not change a value: bitwise the unjoined run
        apart = dataclasses.replace(cfg, fc1=dataclasses.replace(cfg.fc1, join=False))
        if not torch.equal(tmoe.fused_moe(x, w13, w2, tw, ids, act, b13, b2, config=apart, **quant), out):
            return float("inf"), False, float("inf")
    if split_n:  # the placement must not change a result: bitwise the whole call's
        whole = tmoe.fused_moe(x, w13, w2, tw, ids, act, b13, b2, config=cfg, **quant)
        if not torch.equal(whole, out):
            return float("inf"), False, float("inf")
    ref = moe_reference(
        x.double(),
        w13 if quant else w13.double(),  # e4m3 weights stay e4m3: the reference dequantises them
        w2 if quant else w2.double(),
        tw,
        ids,
        act,
        None if b13 is None else b13.double(),
        None if b2 is None else b2.double(),
        **{n: (v if n == "block_shape" else v.double()) for n, v in quant.items()},
    )
    if T == 0:
        return 0.0, False, 0.0
    emulated = 0.0
    if a_fp8:  # the same computation with e4m3 activations in groups of the tiles' widths, in float64
        emu = _emulate_fp8_activations(x, w13, w2, tw, ids, act, quant, b13, b2, group=tile)
        emulated = ((out.double() - emu).norm() / emu.norm()).item()
    elif dtype == "bf16":
        emu = _emulate_bf16(x, w13, w2, tw, ids, act, quant, b13, b2)
        emulated = ((out.double() - emu).norm() / emu.norm()).item()
    return ((out.double() - ref).norm() / ref.norm()).item(), bool(out.isnan().any()), emulated


def _dequantised(w, scale, block):
    if block is None:
        return w.double() * scale.double()
    s = scale.double().repeat_interleave(block[0], 1).repeat_interleave(block[1], 2)
    return w.double() * s[:, : w.shape[1], : w.shape[2]]


def _e4m3_groups(v: torch.Tensor, group: int) -> torch.Tensor:
    """v [..., n] through e4m3 with one scale (amax / 448) per ``group`` consecutive elements, back in float64."""
    n = v.shape[-1]
    pad = torch.nn.functional.pad(v, (0, -n % group)).reshape(*v.shape[:-1], -1, group)
    sc = (pad.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0).float()
    q = (pad.float() / sc).to(torch.float8_e4m3fn).double() * sc.double()
    return q.reshape(*v.shape[:-1], -1)[..., :n]


def _emulate_fp8_activations(x, w13, w2, tw, ids, act, quant, b13, b2, group):
    """rubin.moe as the FP8-activation path computes it: x in e4m3 groups of FC1's K tile, the activated
    intermediate in e4m3 groups of FC1's N tile (= FC2's K tile; FC2's own K tile when FC2 quantises it), biases
    and everything else in float64."""
    block = quant.get("block_shape")
    W13, W2 = _dequantised(w13, quant["w13_scale"], block), _dequantised(w2, quant["w2_scale"], block)
    I = W2.shape[2]  # noqa: E741
    xq = _e4m3_groups(x.double(), group)
    out = torch.zeros(x.shape, dtype=torch.float64)
    f = torch.nn.functional.silu if act == "silu" else (lambda v: torch.nn.functional.gelu(v, approximate="tanh"))
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            hh = W13[e] @ xq[t] + (0 if b13 is None else b13[e].double())
            h = (f(hh[:I]) * hh[I:]).float().double()  # the kernels' float32 accumulators
            y = W2[e] @ _e4m3_groups(h, group) + (0 if b2 is None else b2[e].double())
            out[t] += float(tw[t, j]) * y
    return out


def _emulate_bf16(x, w13, w2, tw, ids, act, quant, b13, b2):
    """rubin.moe with bf16 activations as the kernels round it: float32 products and sums (here float64), the
    activated intermediate, each slot's weighted row and the output rounded to bf16 (round to nearest even)."""
    block = quant.get("block_shape")
    W13 = _dequantised(w13, quant["w13_scale"], block) if quant else w13.double()
    W2 = _dequantised(w2, quant["w2_scale"], block) if quant else w2.double()
    I = W2.shape[2]  # noqa: E741
    f = torch.nn.functional.silu if act == "silu" else (lambda v: torch.nn.functional.gelu(v, approximate="tanh"))
    bf = lambda v: v.bfloat16().double()  # noqa: E731
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            hh = W13[e] @ x[t].double() + (0 if b13 is None else b13[e].double())
            h = bf(f(hh[:I]) * hh[I:])
            out[t] += bf((W2[e] @ h + (0 if b2 is None else b2[e].double())) * float(tw[t, j]))
    return bf(out)


@pytest.fixture(scope="module")
def interp_results():
    pytest.importorskip("triton", reason="the Triton provider needs the triton package")
    return run_file(__file__)


@pytest.mark.skipif(
    triton_version() < (3, 9),
    reason="Triton < 3.9's interpreter (3.6 on the H200 machine) fails on "
    "a loop bounded by a tensor value; the compiled kernels are tested on the GPU (tests/gpu)",
)
@pytest.mark.parametrize("i", range(len(INTERP_CASES)), ids=[f"{c[5]}-T{c[0]}-E{c[1]}-k{c[4]}" for c in INTERP_CASES])
def test_kernels_match_reference_in_interpreter(interp_results, i):
    err, has_nan, emulated = interp_results[i]
    assert not has_nan, "an output element was not written"
    if INTERP_CASES[i][6].get("a_fp8"):
        # against the float64 reference within e4m3's error, and exactly what the e4m3 path should compute
        assert err < FP8_ACT_TOL, f"relative error {err:.2e} >= {FP8_ACT_TOL} (e4m3 activations)"
        assert emulated < 1e-5, f"relative error {emulated:.2e} against the emulated e4m3 computation"
    elif INTERP_CASES[i][6].get("dtype") == "bf16":
        # bf16's roundings (tests/gpu/test_triton_moe.py: 1e-2), and what they should give: a value that rounds the
        # other way after a float32 sum in another order is one bf16 ulp (4e-3) on one element
        assert err < 1e-2, f"relative error {err:.2e} >= 1e-2 (bf16)"
        assert emulated < 1e-3, f"relative error {emulated:.2e} against the emulated bf16 computation"
    else:
        assert err < 1e-5, f"relative error {err:.2e} (float32, ieee dots)"


if __name__ == "__main__":  # the subprocess of interp_results
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from tests.cpu.kernels.triton_interp import gpu_rounding

    gpu_rounding()
    mod = importlib.import_module(PKG + ".moe")
    print(json.dumps([_interp_case(mod, *c[:6], **c[6]) for c in INTERP_CASES]))


def _fault_on_two(job):
    """A warm worker whose second job leaves its process unusable (as a GPU fault does: CUDA errors are sticky)."""
    import os

    if job == 2:
        os.environ["RUBIN_TEST_POISONED"] = "1"
        return "AcceleratorError: an illegal memory access was encountered"
    return "poisoned by an earlier job" if os.environ.get("RUBIN_TEST_POISONED") else None


def test_warm_compile_one_process_per_job_so_a_fault_drops_only_its_candidate():
    """The tuner's warm step runs each candidate in a fresh process: a faulting candidate is reported and dropped, the
    ones after it (same worker slot) still compile. With processes reused, jobs 3 and 4 would report the fault too."""
    from rubin_compile.kernels.triton.tune_moe import warm_compile

    assert warm_compile([1, 2, 3, 4], 1, _fault_on_two) == {
        2: "AcceleratorError: an illegal memory access was encountered"
    }


def test_random_calls_refresh_the_routing_in_place():
    """tune_moe.random_calls: the graph's input buffers keep their storage while refresh draws a new routing into
    them (the benchmarks and the choice's GPU test replay graphs over these buffers)."""
    from rubin_compile.kernels.triton.tune_moe import random_calls

    gen = torch.Generator().manual_seed(0)
    xs, routes, refresh = random_calls(5, 16, 4, 8, 3, gen, device="cpu")
    assert len(xs) == len(routes) == 3 and xs[0].shape == (5, 8) and xs[0].dtype == torch.bfloat16
    ptrs = [(tw.data_ptr(), ids.data_ptr()) for tw, ids in routes]
    before = [ids.clone() for _, ids in routes]
    refresh(0)
    assert [(tw.data_ptr(), ids.data_ptr()) for tw, ids in routes] == ptrs
    assert any(not torch.equal(b, ids) for b, (_, ids) in zip(before, routes))
    for tw, ids in routes:  # k distinct experts per token, weights summing to one
        assert all(len(set(row.tolist())) == 4 for row in ids) and torch.allclose(tw.sum(-1), torch.ones(5))
