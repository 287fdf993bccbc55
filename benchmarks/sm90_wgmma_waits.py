"""Does a K loop keep wgmma asynchronous on sm_90? Read from the PTX of an ahead-of-time compile (no GPU needed).

For each kernel this prints the ``wgmma.wait_group N`` instructions. ``N > 0`` inside the loop means the next K
step's MMAs are issued while earlier ones run. A loop whose only waits are ``0`` waits for every MMA before going on.
It compiles:

* the persistent MoE path's FC1 / FC2 (kernels/triton/moe_prefill.py) at tuner tiles: bf16, FP8 block W8A8, and
  FP8 block W8A16 (``a_fp8=False``, built after this probe's first run on what it showed);
* a W8A16 probe: FP8 weights dequantised with their block scale in registers and fed to a bf16 wgmma as the A
  operand (weights x activations^T, the swapped orientation), against the same loop on bf16 weights.

What it showed with Triton 3.6 (the H200's), 2026-12-05:
* bf16 FC1 waits ``2``, FC2 ``1`` (asynchronous);
* FP8 block FC1 / FC2 wait ``0`` only: each e4m3 product is scaled (the rows' activation scales, the columns' block
  scales) before it is added, so every K step waits for its MMAs. With twice the registers (250 against 110 at
  64-row FC1 tiles) this is why FP8 block ran at 0.5-0.9x of bf16 at prefill sizes on the H200;
* the W8A16 probe keeps its MMAs in flight (waits ``3`` / ``7``, A from registers);
* a W8A8 probe that scales step k's product in step k + 1, after issuing step k + 1's MMAs (so that the scaling
  could overlap them), still waits ``0`` only, with Triton 3.6 and 3.9: Triton's pipeliner
  (lib/Dialect/TritonGPU/Transforms/Pipeliner/WGMMAPipeline.cpp) leaves a wgmma asynchronous only if its result
  feeds nothing but later wgmmas as their accumulator until the next full wait, and a product that is scaled before
  it is added does not. The overlap that remains on sm_90 is between programs: two resident per SM
  (``GemmConfig.occupancy``), one's MMAs running while the other scales.

    PYTHONPATH=. python benchmarks/sm90_wgmma_waits.py       # with the Triton to read (e.g. 3.6 for the H200)
"""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@triton.jit
def w8a16_swapped(
    w_ptr, x_ptr, ws_ptr, o_ptr, N, K, M, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr
):
    """out^T [BN, BM] = dequant(w) [BN, K] . x^T: weights through TMA, scaled in registers (one 128 x 128 block scale
    per K step when BN <= 128), the A operand of a bf16 wgmma; x through TMA."""
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    pid = tl.program_id(0)
    acc = tl.zeros([BN, BM], tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        w = w_desc.load([pid * BN, k0])
        s = tl.load(ws_ptr + (pid * BN) // 128 * (K // 128) + k0 // 128)
        x = x_desc.load([0, k0])
        if w.dtype == tl.bfloat16:
            acc = tl.dot(w, x.T, acc)
        else:
            acc = tl.dot((w.to(tl.float32) * s).to(tl.bfloat16), x.T, acc)
    offs_n = pid * BN + tl.arange(0, BN)
    tl.store(o_ptr + tl.arange(0, BM)[None, :] * N + offs_n[:, None], acc.to(tl.bfloat16))


@triton.jit
def w8a8_block(
    a_ptr,
    w_ptr,
    sa_ptr,
    sw_ptr,
    o_ptr,
    M,
    N,
    K,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    STAGES: tl.constexpr,
    LAG: tl.constexpr,
):
    """out [BM, BN] = sum over K steps of (a . w^T) * row scales * the step's block scale, both operands e4m3 through
    TMA. ``LAG``: the product of step k is scaled and added in step k + 1, after step k + 1's MMAs are issued (a
    software-pipelined promotion, so the scaling could overlap the tensor cores' next product)."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    pid = tl.program_id(0)
    rows = tl.arange(0, BM)
    acc = tl.zeros([BM, BN], tl.float32)
    prev = tl.zeros([BM, BN], tl.float32)
    s_prev = tl.zeros([BM], tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        a = a_desc.load([0, k0])
        w = w_desc.load([pid * BN, k0])
        s = tl.load(sa_ptr + rows * (K // BK) + k0 // BK) * tl.load(sw_ptr + pid * (K // 128) + k0 // 128)
        if LAG:
            d = tl.dot(a, w.T)
            acc = acc + prev * s_prev[:, None]
            prev = d
            s_prev = s
        else:
            acc = acc + tl.dot(a, w.T) * s[:, None]
    acc = acc + prev * s_prev[:, None]
    tl.store(o_ptr + rows[:, None] * N + pid * BN + tl.arange(0, BN)[None, :], acc.to(tl.bfloat16))


def waits(ptx: str) -> str:
    w = collections.Counter(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx))
    return ", ".join(f"wait {n} x{c}" for n, c in sorted(w.items()))


def main() -> None:
    from tests.cpu.kernels import test_triton_moe_prefill as t
    from tests.cpu.kernels.triton_aot import load_plain

    print(f"Triton {triton.__version__}, sm_90")
    prefill = load_plain("moe_prefill", "rubin_moe_prefill_aot")
    from rubin_compile.kernels.triton.tune_moe import PERSISTENT_TILES_W8A16

    for kind, tile in [("bf16", 1), ("bf16", 5), ("fp8 block", 2), ("fp8 block", 3), ("w8a16", 0), ("w8a16", 3)]:
        fp8 = kind == "fp8 block"
        tiles = PERSISTENT_TILES_W8A16 if kind == "w8a16" else t._tuner_tiles(fp8)
        bm, (bn, bk, w1, s1), (bn2, bk2, w2, s2) = tiles[tile]
        scale = 0 if kind == "bf16" else 2
        common = dict(HAS_BIAS=False, A_FP8=fp8, W_SCALE=scale, BM=bm, GROUP=8, DOT_PREC="tf32", GDC=True)
        dt = t.F8 if fp8 else t.BF
        wt = t.BF if kind == "bf16" else t.F8
        ptx, use = t._compile(
            prefill._fc1_kernel,
            dict(common, ACT=0, BN=bn, BK=bk, NUM_STAGES=s1),
            dict(x_ptr=dt, w_ptr=wt, inter_ptr=dt),
            w1,
            s1,
        )
        fmt = kind
        print(f"FC1 {fmt:9s} {bm}x{bn}x{bk} w{w1} s{s1}: {waits(ptx)}; {use.get('REG')} registers")
        ptx, use = t._compile(
            prefill._fc2_kernel,
            dict(common, BN=bn2, BK=bk2, NUM_STAGES=s2),
            dict(inter_ptr=dt, w_ptr=wt, y_ptr=t.BF),
            w2,
            s2,
        )
        print(f"FC2 {fmt:9s} {bm}x{bn2}x{bk2} w{w2} s{s2}: {waits(ptx)}; {use.get('REG')} registers")
    for wt in ("*fp8e4nv", "*bf16"):
        for bn, bm, bk in ((128, 128, 64), (64, 128, 128)):
            sig = dict(w_ptr=wt, x_ptr="*bf16", ws_ptr="*fp32", o_ptr="*bf16", N="i32", K="i32", M="i32")
            sig.update(BN="constexpr", BM="constexpr", BK="constexpr", STAGES="constexpr")
            src = ASTSource(w8a16_swapped, sig, constexprs=dict(BN=bn, BM=bm, BK=bk, STAGES=4))
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 4})
            name = "W8A16 probe, FP8 weights" if wt != "*bf16" else "W8A16 probe, bf16 weights"
            print(f"{name:26s} {bn}x{bm}x{bk}: {waits(ptx.asm['ptx'])}")
    for lag in (0, 1):
        for bm, bn, warps in ((64, 128, 4), (128, 128, 8)):
            sig = dict(a_ptr="*fp8e4nv", w_ptr="*fp8e4nv", sa_ptr="*fp32", sw_ptr="*fp32", o_ptr="*bf16")
            sig.update(M="i32", N="i32", K="i32", BM="constexpr", BN="constexpr", BK="constexpr", STAGES="constexpr")
            sig["LAG"] = "constexpr"
            src = ASTSource(w8a8_block, sig, constexprs=dict(BM=bm, BN=bn, BK=128, STAGES=4, LAG=lag))
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 4})
            name = "W8A8 probe, lagged scaling" if lag else "W8A8 probe"
            print(f"{name:26s} {bm}x{bn}x128: {waits(k.asm['ptx'])}")


if __name__ == "__main__":
    main()
