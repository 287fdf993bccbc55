"""The fused decode path of the MoE kernels (rubin_compile/kernels/triton/moe_decode.py, ``MoEConfig.mode ==
"fused"``) on a CPU.

- Configs that cannot run are refused with the fix; calls the path does not take (FP8 weights, biases, a split-N
  placement, more than MAX_T tokens) are named by ``problem``, and moe.run gives them to the slot-mode kernels.
- The kernel under Triton's interpreter (a subprocess: Triton must see TRITON_INTERPRET=1 before it is first
  imported) against a float64 reference, float32 within 1e-5 (the interpreter's bf16 ``tl.dot`` is wrong; tests/gpu
  checks bf16 and fp16): tiles that do not divide H or I, FC1 split over K, FC2 over slot groups, GELU, duplicate experts within a token's
  slots, T = MAX_T, grids of fewer programs than items (each program takes several from the queue) and of more; the
  workspace's counters and tickets zero after every call; two calls back to back.
- (Its sm_90 compile: tests/cpu/kernels/test_triton_moe_sm90_compile.py.)
- The tuner's candidates of the path are valid configs, at decode sizes and bf16 only.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.cpu.kernels.test_triton_moe_config import tmoe  # noqa: F401 (the fixture: moe.py under the interpreter)
from tests.cpu.kernels.triton_interp import run_file, triton_version

ROOT = Path(__file__).resolve().parents[3]
PKG = "rubin_compile.kernels.triton"

pytest.importorskip("triton", reason="the Triton provider needs the triton package")


def _fused(tmoe, bn1=16, bk1=32, bn2=16, bk2=32, warps=4, occ=1, prefetch=0, split=1, groups=1, **kw):  # noqa: F811
    G = tmoe.GemmConfig
    return tmoe.MoEConfig(
        mode="fused",
        fc1=G(BM=16, BN=bn1, BK=bk1, num_warps=warps, num_stages=2, occupancy=occ, split_k=split),
        fc2=G(BM=16, BN=bn2, BK=bk2, num_warps=warps, num_stages=2, occupancy=occ, prefetch=prefetch, split_k=groups),
        **kw,
    )


# ------------------------------------------------------------------ configs and what the path takes


def test_fused_configs_that_cannot_run_are_refused_with_the_fix(tmoe):  # noqa: F811
    G = tmoe.GemmConfig
    ok = _fused(tmoe)
    assert ok.problem() is None and ok.mode == "fused"
    bad = {
        "same num_warps and occupancy": dict(fc2=G(BM=16, BN=16, BK=32, num_warps=8)),
        "BM is 16": dict(fc1=G(BM=1, BN=16, BK=32)),
        "takes none of swap": dict(fc2=G(BM=16, BN=16, BK=32, swap=True)),
        "a power of two >= 16": dict(fc1=G(BM=16, BN=8, BK=32)),
        "fc1.prefetch is not used": dict(fc1=G(BM=16, BN=16, BK=32, prefetch=4096)),
        "4096 times a power of two": dict(fc2=G(BM=16, BN=16, BK=32, prefetch=3 * 4096)),
        "a_fp8=False": dict(a_fp8=True),
    }
    for text, change in bad.items():
        with pytest.raises(ValueError, match=re.escape(text)):
            tmoe.MoEConfig(**{**ok.__dict__, **change})
    assert tmoe.MoEConfig.from_json(json.loads(json.dumps(ok.to_json()))) == ok


def _args(T=1, E=8, H=64, I=32, k=2, dtype=torch.float32, **kw):  # noqa: E741
    from rubin_compile.ops.moe import MoEArgs

    g = torch.Generator().manual_seed(0)
    x = torch.randn((T, H), generator=g, dtype=dtype)
    w13 = torch.randn((E, 2 * I, H), generator=g).to(kw.pop("wdt", dtype))
    w2 = torch.randn((E, H, I), generator=g).to(w13.dtype)
    ids = torch.rand((T, E), generator=g).topk(k, dim=-1).indices
    tw = torch.softmax(torch.randn((T, k), generator=g), -1)
    return MoEArgs(x, w13, w2, tw, ids, **kw)


def test_problem_names_the_calls_the_path_does_not_take(tmoe):  # noqa: F811
    dec = sys.modules[PKG + ".moe_decode"]
    assert dec.problem(_args()) is None
    f8 = torch.float8_e4m3fn
    scales = dict(w13_scale=torch.ones(8), w2_scale=torch.ones(8))
    assert "activations' dtype" in dec.problem(_args(dtype=torch.bfloat16, wdt=f8, **scales))
    assert "biases" in dec.problem(_args(w13_bias=torch.zeros(8, 64)))
    assert "split-N" in dec.problem(_args(), placed=True)
    assert "up to 64" in dec.problem(_args(T=65))
    assert "float64" in dec.problem(_args(dtype=torch.float64))


def test_tuner_tries_the_fused_path_at_decode_sizes_in_bf16(tmoe):  # noqa: F811
    tune = importlib.import_module(PKG + ".tune_moe")
    cands = tune.fused_candidates(tmoe, 1, "bf16")
    dec = tmoe.moe_decode
    assert len(cands) == len(dec.TUNE_FC1) * len(dec.TUNE_FC2) * len(dec.TUNE_GRIDS)
    assert all(c.mode == "fused" and c.problem() is None for c in cands)
    assert tune.fused_candidates(tmoe, tune.FUSED_MAX_T + 1, "bf16") == []
    assert tune.fused_candidates(tmoe, 1, "fp8_block") == []
    assert tune._overlap_variants(tmoe, cands[0], 2048, 768, "bf16") == []  # one kernel: no boundary options
    every = tune.candidate_configs(tmoe, 1, 128, 2048, 768, 8, "bf16", modes={"fused"})
    assert set(cands) <= set(every)


# ------------------------------------------------------------------ the kernel under the interpreter

# T, E, H, I, k, options (tiles, K split, dtype, activation, routing, grid)
INTERP_CASES = [
    (1, 8, 64, 32, 2, {}),
    # H = 100, I = 40: no tile divides them (masks on both axes of both GEMMs); an L2 request asked for
    (3, 8, 100, 40, 3, {"act": "gelu_tanh", "bn1": 16, "bk1": 32, "bn2": 32, "bk2": 16, "prefetch": 4096}),
    # FC1 split over K: 3 ranges of 32 over H = 80 (the last one short), summed in range order by the last to arrive
    (3, 8, 80, 48, 2, {"split": 3, "act": "gelu_tanh"}),
    (2, 8, 64, 32, 4, {"split": 2, "sms": 1}),  # one program takes every item, the split ranges in queue order
    # FC2 items over slot groups: k = 5 in 3 groups of 2, 2, 1 slots, summed in group order by the last to arrive
    (3, 8, 64, 48, 5, {"groups": 3, "split": 2}),
    (2, 8, 64, 32, 4, {"groups": 4, "sms": 2}),
    (4, 6, 64, 32, 3, {"route": "one_expert"}),  # every slot of a token on one expert
    (64, 4, 32, 16, 1, {}),  # T = MAX_T
    (5, 8, 64, 48, 2, {"sms": 2, "split": 2}),  # 2 programs for 5 x 2 x 3 x 2 + 5 x 4 items: many each
]


def _reference64(x, w13, w2, tw, ids, act):
    I = w2.shape[2]  # noqa: E741
    gate = torch.nn.functional.silu if act == "silu" else (lambda v: torch.nn.functional.gelu(v, approximate="tanh"))
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            hh = w13[e].double() @ x[t].double()
            h = (gate(hh[:I]) * hh[I:]).to(x.dtype).double()  # the intermediate in the activations' dtype
            out[t] += float(tw[t, j]) * (w2[e].double() @ h)
    return out


def _interp_case(moe, T, E, H, I, k, bn1=16, bk1=32, bn2=16, bk2=32, prefetch=0, act="silu", route="random",  # noqa: E741
                 sms=None, split=1, groups=1):  # fmt: skip
    from rubin_compile.ops.moe import MoEArgs
    from rubin_compile.ops.registry import Launch

    dec = sys.modules[PKG + ".moe_decode"]
    dt = torch.float32
    g = torch.Generator().manual_seed(T * 1000 + E * 10 + k)
    x = torch.randn((T, H), generator=g).to(dt)
    w13 = (torch.randn((E, 2 * I, H), generator=g) / H**0.5).to(dt)
    w2 = (torch.randn((E, H, I), generator=g) / I**0.5).to(dt)
    ids = torch.rand((T, E), generator=g).topk(k, dim=-1).indices.to(torch.int32)
    if route == "one_expert":
        ids = torch.full((T, k), E - 1, dtype=torch.int32)
    tw = torch.softmax(torch.randn((T, k), generator=g), -1)
    cfg = moe.MoEConfig(
        mode="fused",
        fc1=moe.GemmConfig(BM=16, BN=bn1, BK=bk1, num_stages=2, split_k=split),
        fc2=moe.GemmConfig(BM=16, BN=bn2, BK=bk2, num_stages=2, prefetch=prefetch, split_k=groups),
    )
    out = torch.full((T, H), float("nan"), dtype=dt)
    if sms is None:
        moe.fused_moe(x, w13, w2, tw, ids, act, config=cfg, out=out)
    else:
        dec.run(MoEArgs(x, w13, w2, tw, ids, act), Launch(), dec.Tiles.of(cfg), sms, out)
    ref = _reference64(x, w13, w2, tw, ids, act)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    ws_zero = int(dec.workspace(torch.device("cpu")).abs().sum()) == 0
    return err, bool(torch.isnan(out).any()), ws_zero


@pytest.fixture(scope="module")
def interp_results():
    return run_file(__file__)


@pytest.mark.skipif(
    triton_version() < (3, 9),
    reason="Triton < 3.9's interpreter fails on a loop bounded by a tensor value; tests/gpu runs the kernel compiled",
)
@pytest.mark.parametrize("i", range(len(INTERP_CASES)), ids=[f"T{c[0]}-E{c[1]}-H{c[2]}-I{c[3]}" for c in INTERP_CASES])
def test_fused_kernel_matches_reference_in_interpreter(interp_results, i):
    err, has_nan, ws_zero = interp_results["cases"][i]
    assert not has_nan, "an output element was not written"
    assert ws_zero, "the call left the workspace's counters non-zero (the next call would read them)"
    assert err < 1e-5, f"relative error {err:.2e} >= 1e-5 (float32, ieee dots)"


@pytest.mark.skipif(triton_version() < (3, 9), reason="see test_fused_kernel_matches_reference_in_interpreter")
def test_back_to_back_calls_share_the_workspace(interp_results):
    """A second call with other routing right after the first (the counters the first left) is right too."""
    first, second = interp_results["back_to_back"]
    assert first < 1e-5 and second < 1e-5, (first, second)


if __name__ == "__main__":  # the subprocess of interp_results
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from tests.cpu.kernels.triton_interp import gpu_rounding

    gpu_rounding()
    mod = importlib.import_module(PKG + ".moe")
    results = {"cases": [_interp_case(mod, *c[:5], **c[5]) for c in INTERP_CASES]}
    results["back_to_back"] = [_interp_case(mod, 3, 8, 64, 32, 2)[0], _interp_case(mod, 2, 8, 64, 32, 3)[0]]
    print(json.dumps(results))
