"""The split-KV decode attention kernels (rubin_compile/kernels/triton/attention.py) on the CPU: run by Triton's
interpreter against the float64 reference of rubin.attention, compiled ahead of time for sm_90 (the K / V
tiles stream through 16-byte cp.async copies, so the loop is software-pipelined), and how selection takes them.
Speed and the compiled numerics (bf16 included, which the interpreter does not model) are tested on the GPU:
tests/gpu/test_decode_attention.py."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from rubin_compile import target as target_mod
from rubin_compile.ops.attention import ATTENTION, SINKS
from rubin_compile.ops.registry import KernelSpec
from tests.cpu.kernels.triton_interp import run_file, triton_version

ROOT = Path(__file__).resolve().parents[3]

# name: (B, Hq, Hkv, S, Skv, D, Dv, options)
CASES = {
    "mha-odd-length": (1, 4, 4, 1, 100, 32, 32, {}),
    "gqa4-splits3": (2, 8, 2, 1, 130, 32, 32, {"splits": 3}),
    "gqa8-many-splits": (1, 8, 1, 1, 300, 64, 64, {"splits": 5}),
    "gqa4-dv-differs": (1, 8, 2, 1, 77, 32, 16, {}),
    # a static cache: each batch row filled to its own length, the rest NaN (never read) and masked
    "static-cache-bool": (2, 8, 2, 1, 300, 32, 32, {"mask": "bool", "lengths": (70, 261), "splits": 4}),
    "static-cache-additive": (2, 8, 2, 1, 300, 32, 32, {"mask": "additive", "lengths": (1, 300), "splits": 3}),
    "static-cache-one-split": (2, 4, 1, 1, 200, 32, 32, {"mask": "bool", "lengths": (150, 33), "splits": 1}),
    # left padding: holes at the start of a row (masked, read: inside [first, last] allowed position)
    "left-padding": (2, 8, 2, 1, 160, 32, 32, {"mask": "bool", "lengths": (160, 120), "left_pad": (0, 25)}),
    # a finite additive mask (finfo.min, as eager attention writes it): -inf once in log2 units (the loop's scores),
    # so the positions past the length are skipped as with -inf (poisoned: never read)
    "finite-additive-mask": (1, 8, 2, 1, 150, 32, 32, {"mask": "finite", "lengths": (90,)}),
    "finite-mask-sinks": (2, 8, 2, 1, 300, 32, 32, {"mask": "finite", "lengths": (70, 261), "sinks": 1.0}),
    # a shared mask whose attended span has a hole inside one split, or a finite bias: every mask tile counts
    "shared-mask-with-hole": (1, 8, 2, 1, 300, 32, 32, {"mask": "bool", "lengths": (280,), "hole": (40, 60)}),
    "shared-additive-hole": (1, 8, 2, 1, 300, 32, 32, {"mask": "additive", "lengths": (280,), "hole": (60, 61)}),
    "shared-additive-bias": (1, 8, 2, 1, 300, 32, 32, {"mask": "additive-bias", "lengths": (250,), "splits": 2}),
    "mask-per-head": (1, 4, 2, 1, 90, 32, 32, {"mask": "bool-per-head", "splits": 2}),
    "causal-three-queries": (1, 4, 1, 3, 50, 32, 32, {"causal": True}),
    "verify-four-queries-mask": (2, 8, 2, 4, 140, 32, 32, {"mask": "bool4", "lengths": (100, 140), "splits": 2}),
    "fp16": (2, 8, 2, 1, 200, 64, 64, {"dtype": "float16", "splits": 3}),
    "fp8-kv-fp16-query": (2, 8, 2, 1, 200, 64, 64, {"dtype": "float16", "fp8": True, "splits": 3}),
    "fp8-kv-no-scales": (1, 8, 2, 1, 90, 32, 32, {"dtype": "float16", "fp8": True, "scales": False}),
    # FP8 keys / values with a bf16 query: the products on fp16 MMAs, the query converted to fp16 (exact), also where
    # it lies beyond fp16's range (x 1e5: a power of two brings it inside, folded into the scale); e5m2 too
    "fp8-kv-bf16-query": (2, 8, 2, 1, 200, 64, 64, {"dtype": "bfloat16", "fp8": True, "splits": 3}),
    "fp8-kv-bf16-query-beyond-fp16": (1, 8, 2, 1, 90, 32, 32, {"dtype": "bfloat16", "fp8": True, "q_mul": 1e5}),
    "fp8-e5m2-kv-bf16-query": (1, 8, 2, 1, 90, 32, 32, {"dtype": "bfloat16", "fp8": "e5m2", "mask": "bool"}),
    # the Configs config_for picks: 128-position tiles, two programs per SM (LONG); one per SM, 2-tile splits
    "long-config": (2, 8, 2, 1, 900, 32, 32, {"mask": "bool", "lengths": (70, 861), "config": "LONG"}),
    "default-config": (1, 8, 2, 1, 300, 32, 32, {"mask": "bool", "lengths": (290,), "config": "DEFAULT"}),
    # attention sinks (GPT-OSS): a logit per query head in each row's denominator, merged by the combine (several
    # splits) or by the split kernel itself (one); large sinks that outweigh the scores too
    "sinks-splits": (2, 8, 2, 1, 300, 32, 32, {"mask": "bool", "lengths": (70, 261), "splits": 3, "sinks": 1.0}),
    "sinks-one-split": (1, 8, 2, 1, 90, 32, 32, {"mask": "additive", "lengths": (60,), "splits": 1, "sinks": 1.0}),
    "sinks-dominant-fp16": (1, 8, 1, 1, 200, 64, 64, {"dtype": "float16", "splits": 4, "sinks": 12.0}),
    # sinks as a strided view (a column of a 2-D tensor, as a graph may pass them): read by head, not by offset
    "sinks-strided": (1, 8, 2, 1, 90, 32, 32, {"splits": 3, "sinks": 2.0, "sinks_stride": 3}),
    "tile-128": (
        2,
        8,
        2,
        2,
        700,
        32,
        32,
        {"mask": "bool4", "lengths": (700, 333), "splits": 3, "config": {"block_n": 128, "num_stages": 2}},
    ),
}
TOLERANCE = {"float32": 2e-6, "float16": 4e-3, "bfloat16": 8e-3}


def _case(B, Hq, Hkv, S, Skv, D, Dv, *, splits=None, mask=None, lengths=None, left_pad=None, causal=False,
          dtype="float32", fp8=False, scales=True, config=None, q_mul=1.0, hole=None, sinks=None,
          sinks_stride=1):  # fmt: skip
    """Run one case: (max |out - ref| / max |ref|, whether every output is finite)."""
    from rubin_compile.kernels.triton import attention
    from rubin_compile.ops.attention import AttentionArgs, reference

    g = torch.Generator().manual_seed(B * 1000 + Skv)
    dt = getattr(torch, dtype)
    q = (torch.randn((B, S, Hq, D), generator=g) * q_mul).to(dt).transpose(1, 2)  # the layout models give
    k = torch.randn((B, Hkv, Skv, D), generator=g)
    v = torch.randn((B, Hkv, Skv, Dv), generator=g)
    k_scale = v_scale = None
    if fp8:
        f8 = torch.float8_e5m2 if fp8 == "e5m2" else torch.float8_e4m3fn
        k, v = k.to(f8), v.to(f8)
        if scales:
            k_scale, v_scale = torch.tensor(0.5), torch.tensor(1.5)
    else:
        k, v = k.to(dt), v.to(dt)
    lengths = torch.tensor(lengths if lengths else [Skv] * B)
    starts = torch.tensor(left_pad if left_pad else [0] * B)
    pos = torch.arange(Skv)
    filled = (pos[None, :] < lengths[:, None]) & (pos[None, :] >= starts[:, None])  # [B, Skv]
    attended = filled & ~((pos >= hole[0]) & (pos < hole[1]))[None, :] if hole else filled  # a hole: masked, not NaN
    m = None
    if mask in ("bool", "additive", "finite", "additive-bias"):
        m = attended[:, None, None, :]
        if mask == "additive":
            m = torch.where(m, 0.0, float("-inf")).to(dt)
        elif mask == "additive-bias":  # a finite bias per position (ALiBi-like) where attended
            m = torch.where(m, torch.randn((B, 1, 1, Skv), generator=g), float("-inf")).to(dt)
        elif mask == "finite":
            m = torch.where(m, 0.0, torch.finfo(dt).min).to(dt)
    elif mask == "bool-per-head":
        m = torch.rand((B, Hq, S, Skv), generator=g) < 0.7
        m[..., 0] = True
    elif mask == "bool4":  # S query positions at the end of each row's filled part, causal among themselves
        last = lengths[:, None] - S + torch.arange(S)[None, :]  # [B, S]
        m = (pos[None, None, :] <= last[:, :, None]) & filled[:, None, :]
        m = m[:, None]
    ref_k = k.double() * (k_scale.double() if k_scale is not None else 1.0)
    ref_v = v.double() * (v_scale.double() if v_scale is not None else 1.0)
    if mask in ("bool", "additive", "bool4", "additive-bias", "finite"):
        # What a static cache holds past a row's length is masked for every query: the kernel must not read it.
        # Poisoned with NaN in the kernel's input (reading it anywhere shows in the output), zero in the reference's.
        tail = (pos[None, :] >= lengths[:, None])[:, None, :, None]
        nan = torch.tensor(float("nan")).to(k.dtype)
        if k.element_size() == 1:  # FP8: through the bytes (masked_fill has no e5m2 on the CPU)
            nan = nan.view(torch.uint8)
            k, v = (t.view(torch.uint8).masked_fill(tail, nan).view(t.dtype) for t in (k, v))
        else:
            k, v = k.masked_fill(tail, nan), v.masked_fill(tail, nan)
        ref_k, ref_v = ref_k.masked_fill(tail, 0.0), ref_v.masked_fill(tail, 0.0)
    ref_mask = m.double() if m is not None and m.dtype != torch.bool else m
    sk = None if sinks is None else (torch.randn(Hq, sinks_stride, generator=g) * sinks).to(dt)[:, -1]
    ref = reference(
        AttentionArgs(q.double(), ref_k, ref_v, ref_mask, causal, sinks=None if sk is None else sk.double())
    )
    cfg = getattr(attention, config) if isinstance(config, str) else attention.Config(**config) if config else None
    args = AttentionArgs(q, k, v, m, causal, None, k_scale, v_scale, sk)
    out = attention.run(args, splits=splits, config=cfg)
    assert out.shape == ref.shape and out.stride() == reference(AttentionArgs(q, k, v, m, causal)).stride()
    err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    return err, bool(torch.isfinite(out).all())


@pytest.fixture(scope="module")
def interp_results():
    pytest.importorskip("triton", reason="the Triton kernels need the triton package")
    return run_file(__file__)


@pytest.mark.skipif(
    triton_version() < (3, 9),
    reason="Triton < 3.9's interpreter fails on a loop bounded by a tensor value; tests/gpu runs the kernels",
)
@pytest.mark.parametrize("name", list(CASES))
def test_decode_attention_matches_reference_in_interpreter(interp_results, name):
    err, finite = interp_results[name]
    dtype = CASES[name][-1].get("dtype", "float32")
    assert finite, "an output is not finite: the kernel read a masked (NaN-poisoned) position of the cache"
    assert err < TOLERANCE[dtype], f"error {err:.2e} of the output's scale ({dtype})"


# ------------------------------------------------------------------ compiled ahead of time for sm_90


@pytest.fixture(scope="module")
def kernels():
    from tests.cpu.kernels.triton_aot import load_plain

    yield load_plain("attention", "rubin_attention_aot")
    del sys.modules["rubin_attention_aot"]


def _qwen3_ints(Skv: int) -> dict:
    """What a Qwen3-30B-A3B decode call passes (32 query / 4 KV heads of 128, batch 1, a [B, 1, 1, Skv] mask)."""
    return dict(
        sq_b=32 * 128, sq_h=128, sq_s=32 * 128, sk_b=4 * Skv * 128, sk_h=Skv * 128, sk_n=128, sv_b=4 * Skv * 128,
        sv_h=Skv * 128, sv_n=128, sm_b=Skv, sm_h=0, sm_s=0, sm_n=1, so_b=32 * 128, so_h=128, so_s=32 * 128, Hkv=4,
        S=1, Skv=Skv, split_len=512,
    )  # fmt: skip


@pytest.mark.parametrize(
    "kv,mask_kind,rows,width",
    [("*bf16", 1, 16, 128), ("*bf16", 0, 64, 128), ("*fp8e4nv", 2, 16, 128), ("*bf16", 1, 32, 256)],
    ids=["bf16-bool-mask", "bf16-64-rows", "fp8-additive-mask", "bf16-head-256"],
)
def test_split_kernel_compiles_for_sm90_with_pipelined_kv_tiles(kernels, kv, mask_kind, rows, width):
    from tests.cpu.kernels.triton_aot import async_copy_sizes, compile_like_a_launch, loop_bodies

    fp8 = kv != "*bf16"
    consts = dict(
        GROUP=8, ROWS=rows, D=width, DV=width, BD=width, BDV=width, BLOCK_N=kernels.BLOCK_N, MASK_KIND=mask_kind,
        MASK_SHARED=rows == 16, SCAN=kernels.SCAN_POSITIONS, CAUSAL=False, K_SCALED=fp8, V_SCALED=fp8, DIRECT=False,
        IEEE=False, F16_KV=fp8, SINKS=False, **_PDL_OFF,
    )  # fmt: skip
    ptrs = dict(Q="*bf16", K=kv, V=kv, Mask="*i1" if mask_kind == 1 else "*bf16", KScale="*fp32", VScale="*fp32",
                Sinks="*bf16", Out="*bf16", PartO="*fp32", PartML="*fp32")  # fmt: skip
    stages = kernels.config_for(1, 4, 16384).num_stages
    ttgir = {}
    ptx = compile_like_a_launch(
        kernels._split_kv, consts, ptrs, _qwen3_ints(4224), num_stages=stages, floats=("qk_scale",), asm=ttgir
    )
    assert "mma.sync" in ptx or "wgmma" in ptx, "QK^T / PV are not on the tensor cores"
    assert "0x10" in async_copy_sizes(ptx), f"K / V tiles are not 16-byte cp.async copies: {async_copy_sizes(ptx)}"
    # No K / V copy waits on a load of the same iteration (a mask tile feeding their predicate would put one
    # DRAM latency on every tile): inside the pipelined loop, no copy's mask is computed from a tt.load.
    copies, loaded = _copy_masks_from_loads(ttgir["ttgir"])
    assert copies, "the K / V loop has no asynchronous copies"
    assert not loaded, f"K / V copies predicated by a load of the same iteration: {loaded}"
    # FP8 keys / values: fp16 MMAs, each pair of e4m3 values converted by one instruction (to bf16 it took three:
    # e4m3x2 -> f16x2, then each f16 -> bf16, a third of the loop's instructions)
    mma_loops = ["\n".join(body) for body in loop_bodies(ptx) if any("mma" in ln for ln in body)]
    assert len(mma_loops) == 1, "the K / V loop is not the one loop with MMAs"
    loop = mma_loops[0]
    assert re.search(r"mma[\w.]*\.f32\." + ("f16.f16" if fp8 else "bf16.bf16"), loop)
    assert "cvt.bf16.f16" not in loop
    if fp8:
        assert re.findall(r"cvt\.rn\.f16x2\.e4m3x2", loop)


_PDL_OFF = dict(GDC=False, EARLY_TRIGGER=False, PF_TILES=0, PF_K_ROW=0, PF_V_ROW=0, PF_NCHUNK=1)


@pytest.mark.parametrize("early", [False, True], ids=["late-trigger", "early-trigger"])
@pytest.mark.parametrize("pf_tiles", [2, 0], ids=["prefetch-2-tiles", "no-prefetch"])
def test_split_kernel_with_pdl_waits_after_its_l2_requests_and_before_any_load(kernels, pf_tiles, early):
    """Built for PDL (what a launch with ``launch.pdl`` compiles): the program's first instructions ask L2 for its
    split's first K / V tiles (``cp.async.bulk.prefetch.L2``: one request per thread for K and one for V, the tiles
    cut into as many requests as the program has threads, so no request is issued twice by replicated threads),
    then ``griddepcontrol.wait``, and only then the first global load (the query; the mask scan) -- a load above
    the wait could read what the predecessor is still writing. The K / V loop stays pipelined. The next kernel is
    let launch (``launch_dependents``) right after the wait (the default), or after the K / V loop."""
    from tests.cpu.kernels.triton_aot import async_copy_sizes, compile_like_a_launch

    consts = dict(
        GROUP=8, ROWS=16, D=128, DV=128, BD=128, BDV=128, BLOCK_N=kernels.BLOCK_N, MASK_KIND=1, MASK_SHARED=True,
        SCAN=kernels.SCAN_POSITIONS, CAUSAL=False, K_SCALED=False, V_SCALED=False, DIRECT=False, IEEE=False,
        F16_KV=False, SINKS=False, GDC=True,
        EARLY_TRIGGER=early, PF_TILES=pf_tiles, PF_K_ROW=256, PF_V_ROW=256, PF_NCHUNK=128 // max(pf_tiles, 1),
    )  # fmt: skip
    ptrs = dict(Q="*bf16", K="*bf16", V="*bf16", Mask="*i1", KScale="*fp32", VScale="*fp32", Sinks="*bf16",
                Out="*bf16", PartO="*fp32", PartML="*fp32")  # fmt: skip
    ptx = compile_like_a_launch(kernels._split_kv, consts, ptrs, _qwen3_ints(16512), num_stages=3, floats=("qk_scale",))
    body = ptx[ptx.index(".entry") :]
    wait = body.index("griddepcontrol.wait")
    assert body.count("griddepcontrol.wait") == 1 and body.count("griddepcontrol.launch_dependents") == 1
    trigger = body.index("griddepcontrol.launch_dependents")
    last_copy = max(m.start() for m in re.finditer(r"cp\.async\.c[ag]\.shared\.global", body))
    assert trigger > wait and (trigger < last_copy if early else trigger > last_copy)
    first_load = min(body.index(op) for op in ("ld.global", "cp.async.ca", "cp.async.cg") if op in body)
    assert first_load > wait, "a global load comes before griddepcontrol.wait"
    prefetches = [m.start() for m in re.finditer(r"cp\.async\.bulk\.prefetch\.L2", body)]
    if pf_tiles:
        assert len(prefetches) == 2, len(prefetches)  # per thread: one request into K's tiles, one into V's
        assert max(prefetches) < wait, "the L2 requests must come before the wait (that is their point)"
    else:
        assert not prefetches
    assert "0x10" in async_copy_sizes(ptx)


def test_combine_kernel_with_pdl_waits_before_reading_the_partials(kernels):
    from tests.cpu.kernels.triton_aot import compile_sm90

    ptx = compile_sm90(
        kernels._combine,
        dict(GROUP=8, ROWS=16, DV=128, BDV=128, SPLIT_CHUNK=kernels.SPLIT_CHUNK, SINKS=False, GDC=True),
        dict(PartO="*fp32", PartML="*fp32", Out="*bf16", Sinks="*bf16"),
    )
    body = ptx[ptx.index(".entry") :]
    assert body.index("griddepcontrol.wait") < body.index("ld.global")


def _copy_masks_from_loads(ttgir: str) -> tuple[list[str], list[str]]:
    """In the loop that holds ``async_copy_global_to_local`` (TTGIR text): the copies, and those whose mask
    operand is computed (through any chain of ops in the loop body) from a ``tt.load`` of the loop body."""
    body = ttgir.split("scf.for")
    body = next(b for b in body[1:] if "async_copy_global_to_local" in b.split("scf.yield")[0])
    body = body.split("scf.yield")[0]
    defs = {}
    for line in body.splitlines():
        m = re.match(r"\s*(%[\w#]+)(?::\d+)? = (\S+)(.*)", line)
        if m:
            op = m.group(2).split("(")[0].strip('"')  # a region op prints as "tt.reduce"(%operand)
            defs[m.group(1)] = (op, re.findall(r"%[\w]+", (m.group(2) + m.group(3)).split(" : ")[0]))
    copies, loaded = [], []
    for name, (op, _) in defs.items():
        if op != "ttg.async_copy_global_to_local":
            continue
        copies.append(name)
        line = next(ln for ln in body.splitlines() if ln.strip().startswith(name + " ="))
        mask = re.search(r" mask (%[\w]+)", line)
        todo, seen = [mask.group(1)] if mask else [], set()
        while todo:
            v = todo.pop()
            if v in seen or v not in defs:
                continue
            seen.add(v)
            if defs[v][0] == "tt.load":
                loaded.append(name)
                break
            todo.extend(defs[v][1])
    return copies, loaded


@pytest.mark.parametrize("direct", [True, False], ids=["one-split", "partials"])
def test_kernels_with_sinks_compile_for_sm90_and_read_the_sinks_after_the_loop(kernels, direct):
    """With ``SINKS`` the split kernel (one split: it normalises) or the combine (several: it merges) reads each row's
    head's sink after the K / V loop, outside it: the loop is the same pipelined loop, with no extra load."""
    from tests.cpu.kernels.triton_aot import compile_like_a_launch, compile_sm90, loop_bodies

    consts = dict(
        GROUP=8, ROWS=16, D=64, DV=64, BD=64, BDV=64, BLOCK_N=kernels.BLOCK_N, MASK_KIND=1, MASK_SHARED=True,
        SCAN=kernels.SCAN_POSITIONS, CAUSAL=False, K_SCALED=False, V_SCALED=False, DIRECT=direct, IEEE=False,
        F16_KV=False, **_PDL_OFF,
    )  # fmt: skip
    ptrs = dict(Q="*bf16", K="*bf16", V="*bf16", Mask="*i1", KScale="*fp32", VScale="*fp32", Sinks="*bf16",
                Out="*bf16", PartO="*fp32", PartML="*fp32")  # fmt: skip
    split = {}
    for sinks in (False, True):
        split[sinks] = compile_like_a_launch(
            kernels._split_kv, {**consts, "SINKS": sinks}, ptrs, _qwen3_ints(4224), num_stages=3, floats=("qk_scale",)
        )
    mma = [["\n".join(b) for b in loop_bodies(split[x]) if any("mma" in ln for ln in b)] for x in (False, True)]
    assert len(mma[1]) == 1 and mma[1][0].count("ld.global") == mma[0][0].count("ld.global")
    body = split[True][split[True].index(".entry") :]
    # the sinks' loads (one split; the combine reads them otherwise), after the loop
    extra = body.count("ld.global") - split[False][split[False].index(".entry") :].count("ld.global")
    assert extra > 0 if direct else extra == 0, extra
    if not direct:
        combine = compile_sm90(
            kernels._combine,
            dict(GROUP=8, ROWS=16, DV=64, BDV=64, SPLIT_CHUNK=kernels.SPLIT_CHUNK, SINKS=True, GDC=False),
            dict(PartO="*fp32", PartML="*fp32", Out="*bf16", Sinks="*bf16"),
        )
        assert "ex2.approx" in combine and "st.global" in combine


def test_combine_kernel_compiles_for_sm90(kernels):
    from tests.cpu.kernels.triton_aot import compile_sm90

    ptx = compile_sm90(
        kernels._combine,
        dict(GROUP=8, ROWS=16, DV=128, BDV=128, SPLIT_CHUNK=kernels.SPLIT_CHUNK, SINKS=False, GDC=False),
        dict(PartO="*fp32", PartML="*fp32", Out="*bf16", Sinks="*bf16"),
    )
    assert "st.global" in ptx and "griddepcontrol" not in ptx


# ------------------------------------------------------------------ selection


def _spec(S=1, Hq=32, Hkv=4, D=128, act="bfloat16", kv="bfloat16", quant="none", Skv=4224, sinks=False):
    shape = (("D", D), ("Dv", D), ("Hq", Hq), ("Hkv", Hkv), ("S", S), ("Skv", Skv), ("B", 1))
    shape = tuple((n, s) for n, s in shape if s is not None)
    return KernelSpec("attention", quant, act, kv, None, shape, "mask", features=(SINKS,) if sinks else ())


@pytest.mark.parametrize(
    "spec,target,kernel",
    [
        (_spec(), "sm90", "triton"),  # decode: the split-KV kernel (FA3 outranks it only where it can run)
        (_spec(S=4), "sm90", "triton"),  # 4 positions x 8 heads = 32 rows: speculative verification
        (_spec(S=16), "sm90", "torch"),  # 128 rows: prefill, SDPA
        (_spec(S=8, Hq=4, Hkv=4), "sm90", "torch"),  # 8 rows, but 8 query positions: a prefill chunk
        (_spec(kv="float8_e4m3fn", quant="fp8_tensor"), "sm90", "triton"),  # SDPA has no FP8 KV cache
        (_spec(act="float32", kv="float32"), "sm90", "triton"),
        (_spec(S=None), "sm90", "triton"),  # symbolic query length: decided per call
        (_spec(D=512), "sm90", "torch"),
        (_spec(), "sm100", "torch"),  # not measured on Blackwell: SDPA keeps it
        (_spec(), "cpu", "reference"),
        (_spec(Hq=64, Hkv=8, D=64, sinks=True), "sm90", "triton"),  # GPT-OSS's attention sinks
        (_spec(S=16, sinks=True), "sm90", "torch"),  # prefill with sinks: the ATen form, as the model wrote it
        (_spec(sinks=True), "cpu", "reference"),
    ],
    ids="decode verify prefill prefill-mha fp8-kv fp32 symbolic-S head-512 sm100 cpu sinks sinks-prefill sinks-cpu".split(),
)
def test_selection_takes_the_decode_kernel_for_decode_shapes_on_sm90(spec, target, kernel):
    # FlashInfer's kernels are declared for plans (FA3 outranks on sm_90 where it can run: the FlashInfer issue);
    # what is asserted is the choice among the kernels with an adapter.
    t = target_mod.resolve(target)
    supported = [k for k in ATTENTION.kernels() if not k.name.startswith("flashinfer") and k.check(t, spec) is None]
    assert max(supported, key=lambda k: k.rank(t, spec)).name == kernel


def test_flashinfer_attention_declines_sinks_with_the_reason():
    """FlashInfer's attention kernels do not take rubin.attention's sinks: selection never gives them such a node."""
    spec = _spec(sinks=True)
    for kernel in ATTENTION.kernels():
        if kernel.name.startswith("flashinfer"):
            assert kernel.check(target_mod.resolve("sm90"), spec) == f"{kernel.name} does not implement {SINKS}"


if __name__ == "__main__":  # the subprocess of interp_results
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from tests.cpu.kernels.triton_interp import gpu_rounding

    gpu_rounding()  # the bf16 outputs rounded as the GPU rounds them
    results = {}
    for name, (*dims, options) in CASES.items():
        results[name] = _case(*dims, **options)
    print(json.dumps(results))


def test_selection_launches_the_decode_attention_without_pdl_with_the_measured_reason():
    """The kernels are PDL-safe (the tests above), but the decode step measured no gain from launching them so:
    chain_pdl reads the kernel's declaration and leaves them without PDL, saying why."""
    from rubin_compile.kernels.triton import ATTENTION_PDL_DECLINED
    from rubin_compile.passes.chain_pdl import decide

    kernel = ATTENTION.kernel("triton")
    assert kernel.pdl_unsupported(_spec()) == ATTENTION_PDL_DECLINED
    sm90 = target_mod.resolve("sm90")
    assert decide("auto", sm90, kernel.pdl_unsupported(_spec()), True) == (False, ATTENTION_PDL_DECLINED)
    assert "641" in ATTENTION_PDL_DECLINED  # the numbers of benchmarks/results/generate-h200-2026-12-02 step 4
