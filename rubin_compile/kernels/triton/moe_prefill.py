"""The prefill path of ``rubin.moe``'s Triton kernels: slots sorted by expert into M tiles on the GPU, then two
persistent grouped GEMMs on TMA tensor descriptors and wgmma, then the top-k sum (``MoEConfig.mode ==
"persistent"``).

Contract: ``run(args, launch, tiles, num_sms)`` computes ``rubin.moe`` (ops/moe.py) for bf16 / fp16 activations with
weights in their dtype (fp32 under Triton's interpreter, for the CPU tests) or in e4m3 with 128 x 128 block or
per-expert / per-tensor scales (with e4m3 activations or not, below), SiLU or GELU-tanh, with or without biases,
within the tolerances of tests/gpu/test_triton_moe.py (bf16: 1e-2; FP8 activations: 6e-2); no host synchronisation (capturable in a CUDA graph: every buffer is
sized by T, E and the tile, never by the routing); deterministic, and bitwise the same with PDL on and off and
whatever order the GPU runs the programs in.

Why this shape. At prefill sizes (hundreds of rows per expert) the MoE is two grouped GEMMs whose tensor-core work
outweighs their weight bytes (Qwen3-30B-A3B at T = 1024: 77 GFLOP against 288 MB), so what matters is what a dense
GEMM needs -- full 64- or 128-row wgmma tiles fed by TMA, every SM busy until the work runs out -- and that no step
around them costs more than it must:

1. ``_align_count`` and ``_align_scatter`` (two launches after one memset): the ``T * k`` slots counted per expert
   (integer atomics), each expert's run padded to a multiple of ``BM``, the slots written into their expert's run
   (a position claimed with an integer atomic: within a run the order varies from call to call, but every row of a
   tile is computed alone, so no value depends on it), the expert of every M tile and the number of tiles. No sort,
   no host synchronisation, fixed-size buffers (``P_MAX = T k + E (BM - 1)`` rows, ``cdiv(P_MAX, BM)`` tiles).
2. ``_fc1_kernel``: a persistent grid (one program per SM, or ``GemmConfig.occupancy``: two hide one's epilogue
   and, W8A8, its scaling behind the other's MMAs; ``GemmConfig.flatten``: the items' K steps as one pipelined loop)
   walks the (M tile, N tile) work items in groups of ``GROUP_M`` M tiles (so the tiles of one expert's weight
   columns run together and share them in L2); each item gathers its rows' tokens (``cp.async`` through pointers:
   TMA cannot gather rows on sm_90), loads the expert's gate and up weight tiles through a TMA descriptor over
   ``w13`` seen as ``[E * 2I, H]``, multiplies on wgmma into two float32 accumulators, and writes
   ``act(gate) * up`` through a TMA store into the intermediate ``[P_MAX, I]``, rows in sorted order.
3. ``_fc2_kernel``: the same walk; both operands through TMA (the intermediate's rows are already in tile order;
   ``w2`` seen as ``[E * H, I]``); each row rounded to the activations' dtype, as the reference rounds its expert
   output, and scattered to its slot's row of ``[T k, H]``.
4. ``_sum_kernel``: each token's k slot rows, times their routing weights, summed in float32 in slot order.

FP8 weights run W8A8 (``MoEConfig.a_fp8``): the hidden states in e4m3 once per call (``fp8.quantise_rows``: one
scale per token and FC1 K tile), each K step's e4m3 product scaled by its rows' and columns' scales (a per-expert
scale once, after the loop), and FC1's epilogue writing the intermediate in e4m3 with one scale per (row, FC1 N
tile), which is FC2's K tile. Each K step then waits for its MMAs before it scales them. Or W8A16 (``a_fp8=False``):
the activations stay in their dtype, each weight tile is dequantised in registers (its block scales applied, then
rounded to the activations' dtype) and is the MMA's register operand, accumulating weights x rows^T, so the K loop
keeps its MMAs in flight like the bf16 one.

Two options of FC1 and the W8A8 step (measured per shape by the tuner; docs/kernels/triton_moe.md):

- ``GemmConfig.join`` (``JOIN``): the gate tile and its up tile loaded as one TMA box over ``w13`` seen as
  ``[E * 2, I, H]`` (box ``[2, BN, BK]``, reshaped in shared memory to ``[2 BN, BK]``) and multiplied in one MMA of 2 BN
  columns, split into gate and up in registers after the loop: the gathered rows are read from shared memory once per
  K step instead of twice, and W8A8 waits for one product per K step instead of two. Bitwise the unjoined tiles.
- One weight scale per tile (``SCALAR_SW``, set by ``run`` where the 128 x 128 blocks hold whole tiles: BN divides the
  block and, FC1, the up rows start at a block): the K step folds that scale into its rows' scales and scales its
  product with one FMA an element, where column scales take an outer-product multiply and an FMA (the same float32
  values). A joined tile sees its product as ``[BM, 2, BN]``, each half with its own row scales.

W8A8 GEMMs may also run as the Gluon kernels of moe_prefill_gluon.py (``GemmConfig.gluon``, FC1's and FC2's): the
same items and float32 operations, with step k + 1's MMA in flight while step k's product is scaled; ``run`` launches
them where they can take the call, the Triton kernels on the same tiles elsewhere.

Tiles that reach past an expert's weight rows (``I`` or ``H`` not a multiple of ``BN``) read the next expert's rows
or TMA's zero fill into columns that are never stored; K past ``H`` or ``I`` reads TMA's zeros. Limits (``problem``):
rows of whole 16 bytes (``H`` and ``I`` multiples of 8, of 16 for e4m3), contiguous weights and hidden-state rows;
other calls run the other modes (moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from rubin_compile.kernels.triton import moe_prefill_gluon as gluon_k
from rubin_compile.kernels.triton import moe_prefill_ws as ws_k
from rubin_compile.kernels.triton.launch import cdiv, launcher, next_power_of_2
from rubin_compile.kernels.triton.moe_walk import tile_of
from rubin_compile.kernels.triton.activations import CODES as _ACT
from rubin_compile.kernels.triton.activations import gated
from rubin_compile.kernels.triton.fp8 import gather_quantise_rows, quantise_rows, scale_args
from rubin_compile.kernels.triton.pdl import INTERPRET, gdc_launch_dependents, gdc_wait, has_gdc
from rubin_compile.ops.moe import MoEArgs
from rubin_compile.ops.registry import Launch

ALIGN_BLOCK = 1024  # slots per program of the two alignment kernels
TILE_CHUNK = 64  # M tiles per step of _align_scatter's tile table
GROUP_M = 8  # M tiles walked together per N tile (their weight tiles are the same expert's while they last)


@triton.jit
def _align_count(ids_ptr, counts_ptr, sorted_ptr, S, P_MAX, FILL, BLOCK: tl.constexpr, GDC: tl.constexpr):
    """Slots per expert into ``counts`` (zeroed by the caller), and -1 into this program's share of ``sorted``."""
    pid = tl.program_id(0)
    if GDC:
        gdc_wait()  # the routing (ids) is an earlier kernel's output
        gdc_launch_dependents()
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < S
    e = tl.load(ids_ptr + offs, mask=ok, other=0)
    tl.atomic_add(counts_ptr + e, 1, mask=ok, sem="relaxed")
    lo = pid * FILL
    hi = tl.minimum(lo + FILL, P_MAX)
    for c in range(lo, hi, BLOCK):
        o = c + tl.arange(0, BLOCK)
        tl.store(sorted_ptr + o, tl.full([BLOCK], -1, tl.int32), mask=o < hi)


@triton.jit
def _align_scatter(
    ids_ptr,
    counts_ptr,
    cursor_ptr,
    sorted_ptr,
    tile_expert_ptr,
    ntiles_ptr,
    S,
    E,
    TILES_MAX,
    BM: tl.constexpr,
    E_P2: tl.constexpr,
    BLOCK: tl.constexpr,
    TCH: tl.constexpr,
    GDC: tl.constexpr,
):
    """Each slot into its expert's run of ``sorted`` (runs padded to ``BM``, in expert order); program 0 also
    writes the expert of every M tile and the number of tiles."""
    pid = tl.program_id(0)
    if GDC:
        gdc_wait()  # counts and the -1 fill are _align_count's
        gdc_launch_dependents()
    ce = tl.arange(0, E_P2)
    cnt = tl.load(counts_ptr + ce, mask=ce < E, other=0)
    padded = (cnt + BM - 1) // BM * BM
    incl = tl.cumsum(padded, 0)
    start = incl - padded
    if pid == 0:
        tl.store(ntiles_ptr, tl.sum(padded, 0) // BM)
        tile_end = tl.where(ce < E, incl // BM, 1 << 30)  # expert e owns tiles [start / BM, incl / BM)
        for t0 in range(0, TILES_MAX, TCH):
            t = t0 + tl.arange(0, TCH)
            ex = tl.sum((tile_end[None, :] <= t[:, None]).to(tl.int32), axis=1)
            tl.store(tile_expert_ptr + t, tl.minimum(ex, E - 1), mask=t < TILES_MAX)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < S
    e = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
    rank = tl.atomic_add(cursor_ptr + e, 1, mask=ok, sem="relaxed")
    tl.store(sorted_ptr + tl.gather(start, e, axis=0) + rank, offs, mask=ok)


@triton.jit
def _step(a, w, acc, sa, sw, A_FP8: tl.constexpr, W_SCALE: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc + a . w^T over one K tile (a [BM, BK], w [BN, BK]). FP8 (``A_FP8``): e4m3 operands on the FP8 tensor
    cores, the product scaled by the rows' activation scales ``sa`` [BM] and, with 128 x 128 block scales
    (``W_SCALE == 2``), the columns' weight scales ``sw`` [BN] of this K tile; a per-tensor / per-expert weight scale
    (``W_SCALE == 1``) is applied once, after the loop."""
    if A_FP8:
        d = tl.dot(a, w.T)
        if W_SCALE == 2:
            return acc + d * (sa[:, None] * sw[None, :])
        return acc + d * sa[:, None]
    return tl.dot(a, w.T, acc, input_precision=DOT_PREC)


@triton.jit
def _step_w8a16(a, w, acc, sw, W_SCALE: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc^T + w . a^T over one K tile for e4m3 weights and activations in their own dtype (``acc`` [BN, BM]): the
    weight tile [BN, BK] dequantised in registers (times the columns' block scales ``sw`` [BN] with ``W_SCALE == 2``;
    a per-expert scale is applied after the loop) and fed to the MMA as its register operand, so the K loop keeps
    its MMAs in flight (the W8A8 step waits for each product before scaling it; benchmarks/sm90_wgmma_waits.py)."""
    if W_SCALE == 2:
        wd = (w.to(tl.float32) * sw[:, None]).to(a.dtype)
    else:
        wd = w.to(a.dtype)
    return tl.dot(wd, a.T, acc, input_precision=DOT_PREC)


@triton.jit
def _col_scales(ws_ptr, e, rows, row_ok, k0, stride_se, stride_sn, stride_sk, SBN, SBK):
    """The 128 x 128 block scales of weight rows ``rows`` of expert ``e`` at K offset ``k0`` (float32 [len(rows)])."""
    return tl.load(ws_ptr + e * stride_se + (rows // SBN) * stride_sn + (k0 // SBK) * stride_sk, mask=row_ok, other=0.0)


@triton.jit
def _fc1_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    sorted_ptr,
    tile_expert_ptr,
    ntiles_ptr,
    inter_ptr,
    isc_ptr,
    E,
    H,
    I,
    P_MAX,
    K_TOP,
    stride_xt,
    stride_xst,
    stride_se,
    stride_sn,
    stride_sk,
    SBN,
    SBK,
    stride_be,
    stride_ist,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    A_FP8: tl.constexpr,
    W_SCALE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_PREC: tl.constexpr,
    GDC: tl.constexpr,
    FLATTEN: tl.constexpr = False,
    JOIN: tl.constexpr = False,
    SCALAR_SW: tl.constexpr = False,
):
    """inter[p, n] = act(x[tok] . w13[e, n] + b) * (x[tok] . w13[e, I + n] + b) for every row p of every tile.
    FP8 (``A_FP8``): ``x`` is e4m3 with scales ``xs`` [T, H / BK]; the intermediate is written in e4m3 with one
    scale (amax / 448 over the tile's real columns) per (row, N tile) into ``isc`` [P_MAX, I / BN]: FC2's A tile,
    FC2's K tile being this BN."""
    W8A16: tl.constexpr = W_SCALE != 0 and not A_FP8  # e4m3 weights, activations in their dtype: accumulated transposed
    SCALAR: tl.constexpr = A_FP8 and W_SCALE == 2 and SCALAR_SW  # each weight tile within one 128 x 128 scale block
    ROWS3: tl.constexpr = SCALAR and JOIN
    if GDC:
        gdc_wait()  # hidden states (and their scales), tile table and sorted slots are earlier kernels' writes
        gdc_launch_dependents()
    # The descriptors after the wait: they are written to scratch memory the launch took from torch's allocator,
    # which may be a block the previous kernel still reads: under PDL, stream order no longer
    # means the previous kernel has finished (see _ensure_allocator)
    if JOIN:  # w13 seen as [E * 2, I, H]: one box holds a gate tile and its up tile, one MMA of 2 BN columns
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * 2, I, H], strides=[I * H, H, 1], block_shape=[2, BN, BK])
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * 2 * I, H], strides=[H, 1], block_shape=[BN, BK])
    o_desc = tl.make_tensor_descriptor(inter_ptr, shape=[P_MAX, I], strides=[I, 1], block_shape=[BM, BN])
    num_m = tl.load(ntiles_ptr)
    num_n = tl.cdiv(I, BN)
    offs_k = tl.arange(0, BK)
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=FLATTEN):
        m, n = tile_of(tile, num_m, num_n, GROUP)
        e = tl.load(tile_expert_ptr + m)
        rows = m * BM + tl.arange(0, BM)
        slot = tl.load(sorted_ptr + rows)
        real = slot >= 0
        tok = tl.where(real, slot // K_TOP, 0).to(tl.int64)
        a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]
        cols = n * BN + tl.arange(0, BN)
        gate_row = e * 2 * I + n * BN
        if JOIN:  # the joined tile's columns: gate n * BN + j, then up I + n * BN + j
            j2 = tl.arange(0, 2 * BN)
            wrow2 = (j2 // BN) * I + n * BN + j2 % BN
            ok2 = n * BN + j2 % BN < I
            if W8A16:  # [2 BN, BM]
                acc = tl.zeros([2 * BN, BM], tl.float32)
            elif ROWS3:  # [BM, 2, BN]: gate, up
                acc = tl.zeros([BM, 2, BN], tl.float32)
            else:
                acc = tl.zeros([BM, 2 * BN], tl.float32)
            s2 = tl.zeros([2 * BN], tl.float32)
        elif W8A16:  # [BN, BM]
            acc_g = tl.zeros([BN, BM], tl.float32)
            acc_u = tl.zeros([BN, BM], tl.float32)
        else:
            acc_g = tl.zeros([BM, BN], tl.float32)
            acc_u = tl.zeros([BM, BN], tl.float32)
        sa = tl.zeros([BM], tl.float32)
        sg = tl.zeros([BN], tl.float32)
        su = tl.zeros([BN], tl.float32)
        sg0 = 0.0
        su0 = 0.0
        for k0 in tl.range(0, H, BK, num_stages=NUM_STAGES):
            a = tl.load(a_ptrs, mask=real[:, None] & (offs_k[None, :] < H - k0), other=0.0)
            if A_FP8:
                sa = tl.load(xs_ptr + tok * stride_xst + k0 // BK, mask=real, other=0.0)
            if SCALAR:  # the gate tile's one block scale and the up tile's
                sk = e * stride_se + (k0 // SBK) * stride_sk
                sg0 = tl.load(ws_ptr + sk + (n * BN // SBN) * stride_sn)
                su0 = tl.load(ws_ptr + sk + ((I + n * BN) // SBN) * stride_sn)
            elif W_SCALE == 2:
                if JOIN:
                    s2 = _col_scales(ws_ptr, e, wrow2, ok2, k0, stride_se, stride_sn, stride_sk, SBN, SBK)
                else:
                    sg = _col_scales(ws_ptr, e, cols, cols < I, k0, stride_se, stride_sn, stride_sk, SBN, SBK)
                    su = _col_scales(ws_ptr, e, I + cols, cols < I, k0, stride_se, stride_sn, stride_sk, SBN, SBK)
            if JOIN:
                wj = w_desc.load([2 * e, n * BN, k0]).reshape([2 * BN, BK])
                if ROWS3:  # the product seen as [BM, 2, BN], each half times its row scales: one FMA an element
                    d = tl.dot(a, wj.T).reshape([BM, 2, BN])
                    acc = acc + d * tl.join(sa * sg0, sa * su0)[:, :, None]
                elif W8A16:
                    acc = _step_w8a16(a, wj, acc, s2, W_SCALE, DOT_PREC)
                else:
                    acc = _step(a, wj, acc, sa, s2, A_FP8, W_SCALE, DOT_PREC)
            else:
                wg = w_desc.load([gate_row, k0])
                wu = w_desc.load([gate_row + I, k0])
                if SCALAR:  # row scales times the tile's one weight scale
                    acc_g = _step(a, wg, acc_g, sa * sg0, sg, A_FP8, 1, DOT_PREC)
                    acc_u = _step(a, wu, acc_u, sa * su0, su, A_FP8, 1, DOT_PREC)
                elif W8A16:
                    acc_g = _step_w8a16(a, wg, acc_g, sg, W_SCALE, DOT_PREC)
                    acc_u = _step_w8a16(a, wu, acc_u, su, W_SCALE, DOT_PREC)
                else:
                    acc_g = _step(a, wg, acc_g, sa, sg, A_FP8, W_SCALE, DOT_PREC)
                    acc_u = _step(a, wu, acc_u, sa, su, A_FP8, W_SCALE, DOT_PREC)
            a_ptrs += BK
        if ROWS3:
            acc_g, acc_u = acc.permute(0, 2, 1).split()
        elif JOIN:
            if W8A16:
                acc = acc.T
            acc_g, acc_u = acc.reshape([BM, 2, BN]).permute(0, 2, 1).split()
        elif W8A16:
            acc_g = acc_g.T
            acc_u = acc_u.T
        if W_SCALE == 1:
            s = tl.load(ws_ptr + e * stride_se).to(tl.float32)
            acc_g *= s
            acc_u *= s
        if HAS_BIAS:
            bg = tl.load(b_ptr + e * stride_be + cols, mask=cols < I, other=0.0).to(tl.float32)
            bu = tl.load(b_ptr + e * stride_be + I + cols, mask=cols < I, other=0.0).to(tl.float32)
            acc_g += bg[None, :]
            acc_u += bu[None, :]
        h = gated(acc_g, ACT) * acc_u
        if A_FP8:  # e4m3 for FC2, one scale per row over this tile's real columns
            hs = tl.maximum(tl.max(tl.abs(tl.where((cols < I)[None, :], h, 0.0)), axis=1), 1e-12) / 448.0
            tl.store(isc_ptr + rows.to(tl.int64) * stride_ist + n, hs)
            h = h / hs[:, None]
        o_desc.store([m * BM, n * BN], h.to(inter_ptr.dtype.element_ty))


@triton.jit
def _fc2_kernel(
    inter_ptr,
    isc_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    sorted_ptr,
    tile_expert_ptr,
    ntiles_ptr,
    y_ptr,
    E,
    H,
    I,
    P_MAX,
    stride_ist,
    stride_se,
    stride_sn,
    stride_sk,
    SBN,
    SBK,
    stride_be,
    HAS_BIAS: tl.constexpr,
    A_FP8: tl.constexpr,
    W_SCALE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_PREC: tl.constexpr,
    GDC: tl.constexpr,
    FLATTEN: tl.constexpr = False,
    SCALAR_SW: tl.constexpr = False,
):
    """y[slot, n] = inter[p] . w2[e, n] + b, rounded to y's dtype (the activations'), for every real row p. FP8
    (``A_FP8``): the intermediate is e4m3 with FC1's scales ``isc`` [P_MAX, I / BK]."""
    W8A16: tl.constexpr = W_SCALE != 0 and not A_FP8  # as in _fc1_kernel
    SCALAR: tl.constexpr = A_FP8 and W_SCALE == 2 and SCALAR_SW  # as in _fc1_kernel
    if GDC:
        gdc_wait()  # the intermediate (and its scales) are FC1's
        gdc_launch_dependents()
    # after the wait, as in _fc1_kernel: FC1's descriptors may sit in the same scratch block
    a_desc = tl.make_tensor_descriptor(inter_ptr, shape=[P_MAX, I], strides=[I, 1], block_shape=[BM, BK])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * H, I], strides=[I, 1], block_shape=[BN, BK])
    num_m = tl.load(ntiles_ptr)
    num_n = tl.cdiv(H, BN)
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=FLATTEN):
        m, n = tile_of(tile, num_m, num_n, GROUP)
        e = tl.load(tile_expert_ptr + m)
        rows = (m * BM + tl.arange(0, BM)).to(tl.int64)
        cols = n * BN + tl.arange(0, BN)
        if W8A16:  # [BN, BM]
            acc = tl.zeros([BN, BM], tl.float32)
        else:
            acc = tl.zeros([BM, BN], tl.float32)
        sa = tl.zeros([BM], tl.float32)
        sw = tl.zeros([BN], tl.float32)
        for k0 in tl.range(0, I, BK, num_stages=NUM_STAGES):
            a = a_desc.load([m * BM, k0])
            w = w_desc.load([e * H + n * BN, k0])
            if A_FP8:
                sa = tl.load(isc_ptr + rows * stride_ist + k0 // BK)
            if SCALAR:  # the row scales times the tile's one weight scale: one FMA an element
                sw0 = tl.load(ws_ptr + e * stride_se + (n * BN // SBN) * stride_sn + (k0 // SBK) * stride_sk)
                acc = _step(a, w, acc, sa * sw0, sw, A_FP8, 1, DOT_PREC)
            else:
                if W_SCALE == 2:
                    sw = _col_scales(ws_ptr, e, cols, cols < H, k0, stride_se, stride_sn, stride_sk, SBN, SBK)
                if W8A16:
                    acc = _step_w8a16(a, w, acc, sw, W_SCALE, DOT_PREC)
                else:
                    acc = _step(a, w, acc, sa, sw, A_FP8, W_SCALE, DOT_PREC)
        if W8A16:
            acc = acc.T
        if W_SCALE == 1:
            acc *= tl.load(ws_ptr + e * stride_se).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(b_ptr + e * stride_be + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :]
        slot = tl.load(sorted_ptr + rows)
        ptrs = y_ptr + tl.where(slot >= 0, slot, 0).to(tl.int64)[:, None] * H + cols[None, :]
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=(slot >= 0)[:, None] & (cols < H)[None, :])


@triton.jit
def _sum_kernel(y_ptr, w_ptr, out_ptr, H, K_TOP, stride_ot, BLOCK: tl.constexpr, GDC: tl.constexpr):
    """out[t] = sum over j < k of w[t, j] * y[t k + j], in float32, in slot order."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    if GDC:
        gdc_wait()  # y is FC2's
        gdc_launch_dependents()
    acc = tl.zeros([BLOCK], tl.float32)
    for j in range(0, K_TOP):
        s = t * K_TOP + j
        w = tl.load(w_ptr + s).to(tl.float32)
        acc += w * tl.load(y_ptr + s.to(tl.int64) * H + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


# ------------------------------------------------------------------------------------------------
# host side
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tiles:
    """The persistent path's tiles (``MoEConfig.fc1`` / ``fc2`` give them: BM, BN, BK, num_warps, num_stages);
    FC1 and FC2 share BM, the sorted rows' padding."""

    BM: int
    fc1: tuple[int, int, int, int]  # BN, BK, num_warps, num_stages
    fc2: tuple[int, int, int, int]
    a_fp8: bool = True  # e4m3 weights: W8A8 (the activations quantised); False: W8A16 (the weights dequantised)
    occupancy: tuple[int, int] = (1, 1)  # FC1's and FC2's programs per SM (GemmConfig.occupancy)
    flatten: tuple[bool, bool] = (False, False)  # FC1's and FC2's item loops flattened (GemmConfig.flatten)
    join: bool = False  # FC1's gate and up tiles in one TMA box and one MMA (GemmConfig.join)
    gluon: tuple[bool, bool] = (False, False)  # FC1 / FC2 by the Gluon kernels where they can run (GemmConfig.gluon)
    unroll: tuple[int, int] = (2, 2)  # the Gluon FC1's and FC2's K steps per loop iteration (GemmConfig.unroll)
    ws: tuple[bool, bool] = (False, False)  # FC1 / FC2 by the warp-specialized Gluon kernels (GemmConfig.ws)

    @staticmethod
    def of(config) -> "Tiles":
        """From a ``moe.MoEConfig`` of mode "persistent" (its ``problem`` has checked the tiles; moe.py imports this
        module, not the reverse)."""
        f1, f2 = config.fc1, config.fc2
        return Tiles(
            f1.BM,
            (f1.BN, f1.BK, f1.num_warps, f1.num_stages),
            (f2.BN, f2.BK, f2.num_warps, f2.num_stages),
            config.a_fp8,
            (f1.occupancy, f2.occupancy),
            (f1.flatten, f2.flatten),
            f1.join,
            (f1.gluon, f2.gluon),
            (f1.unroll, f2.unroll),
            (f1.ws, f2.ws),
        )


def problem(args: MoEArgs, tiles: Optional[Tiles] = None) -> Optional[str]:
    """Why this path cannot run the call (with these ``tiles``; None: it can)."""
    x = args.hidden_states
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"{x.dtype} activations (the persistent path takes bf16 / fp16)"
    fp8 = args.w13.dtype == torch.float8_e4m3fn and args.w2.dtype == torch.float8_e4m3fn
    if not fp8 and (args.w13.dtype != x.dtype or args.w2.dtype != x.dtype):
        return f"weights in {args.w13.dtype} / {args.w2.dtype} (the persistent path takes the activations' or e4m3)"
    if fp8 and args.w13_scale is None:
        return "e4m3 weights without scales"
    if args.fp4 is not None or args.w13_scale_2 is not None:
        return "FP4 weights"
    if args.activation not in _ACT:
        return f"activation {args.activation} (the persistent path has {', '.join(_ACT)})"
    if args.apply_router_weight_on_input or args.activation_constants is not None:
        return "the router weight on the input / runtime activation constants"
    row = 16 if fp8 else 8
    if args.H % row or args.I % row:
        return f"H={args.H}, I={args.I}: TMA takes rows of whole 16 bytes (multiples of {row} elements)"
    if not (args.w13.is_contiguous() and args.w2.is_contiguous()):
        return "weights that are not contiguous (the TMA descriptors see them as [E * rows, K])"
    if x.stride(1) != 1:
        return "hidden states whose rows are not contiguous"
    if fp8 and tiles is not None:
        (bn1, bk1, _, _), (_, bk2, _, _) = tiles.fc1, tiles.fc2
        if tiles.a_fp8 and bk2 != bn1:
            return f"FP8: FC2's K tile ({bk2}) must be FC1's N tile ({bn1}), the intermediate's scale groups"
        sbk = int(args.block_shape[1]) if args.block_shape is not None else 0
        if sbk and (sbk % bk1 or sbk % bk2):
            return f"FP8 block scales {sbk} wide along K: the K tiles ({bk1}, {bk2}) must divide them"
    return None


def _alloc(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device=torch.cuda.current_device() if not INTERPRET else "cpu")


def _ensure_allocator() -> None:
    """The TMA descriptors are built on the device, in scratch memory Triton asks an allocator for at launch: ours
    allocates through torch (so it is graph-safe under capture), set where none is (an application's -- vLLM sets
    one -- is kept). The block is freed when the launch returns, so the next launch may get it while this kernel
    still runs; with PDL that next kernel is running too, so the kernels write their descriptors only after
    gdc_wait (a fault on the H100 before they did). Triton has no public getter; the allocator lives in a ContextVar (per thread), so this looks
    on every call."""
    holder = getattr(getattr(triton.runtime, "_allocation", None), "_allocator", None)
    null = getattr(getattr(triton.runtime, "_allocation", None), "NullAllocator", ())
    if holder is None or isinstance(holder.get(), null):
        triton.set_allocator(_alloc)


def run(args: MoEArgs, launch: Launch, tiles: Tiles, num_sms: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``rubin.moe`` through the persistent path (module docstring). ``tiles`` from the call's ``MoEConfig``;
    ``num_sms`` times the tiles' occupancy: the persistent grids' size; ``out`` ([T, H], contiguous rows) receives
    the result."""
    why = problem(args, tiles)
    if why is not None:
        raise NotImplementedError(f"rubin.moe[triton, persistent]: {why}")
    x = args.hidden_states
    T, H, E, I, k = args.T, args.H, args.E, args.I, args.k
    dev, dtype = x.device, x.dtype
    out = torch.empty((T, H), dtype=dtype, device=dev) if out is None else out
    S = T * k
    if S == 0:
        return out.zero_()
    _ensure_allocator()
    BM = tiles.BM
    p_max = S + E * (BM - 1)
    tiles_max = cdiv(p_max, BM)
    gdc = has_gdc()
    pdl = {"launch_pdl": True} if (gdc and launch.pdl) else {}
    chain = {"launch_pdl": True} if gdc else {}  # our own kernels after the first: always safe (each waits)
    i32 = torch.int32
    ids, tw = args.flat_routing()
    bn1, bk1, nw1, ns1 = tiles.fc1
    bn2, bk2, nw2, ns2 = tiles.fc2
    fp8 = args.w13.dtype == torch.float8_e4m3fn
    a8 = fp8 and tiles.a_fp8  # W8A8; e4m3 weights without it run W8A16
    block = args.block_shape is not None
    w_scale = 2 if (fp8 and block) else 1 if fp8 else 0
    sbn, sbk = (int(args.block_shape[0]), int(args.block_shape[1])) if block else (1, 1)
    # 128 x 128 block scales over tiles that each lie in one block (BN divides the block; the up rows start at a
    # block: I a multiple of it): one weight scale per tile and K step, folded into the rows' scales, so a K step
    # scales its products with one FMA an element instead of an outer product and an FMA (the same float32 values)
    scalar1 = a8 and block and sbn % bn1 == 0 and I % sbn == 0
    scalar2 = a8 and block and sbn % bn2 == 0
    # the Gluon kernels where they can run these tiles (else the Triton kernels run them); the warp-specialized FC1
    # reads rows quantised in tile order (after the alignment) instead of gathering them
    ws1 = tiles.ws[0] and not INTERPRET and ws_k.problem(BM, bn1, bk1, nw1, ns1, w_scale, scalar1, a8, fc1=True) is None
    ws2 = tiles.ws[1] and not INTERPRET and ws_k.problem(BM, bn2, bk2, nw2, ns2, w_scale, scalar2, a8) is None
    gl1 = not tiles.ws[0] and tiles.gluon[0] and not INTERPRET
    gl1 = gl1 and gluon_k.problem(BM, bn1, bk1, nw1, ns1, w_scale, scalar1, a8, fc1=True) is None
    gl2 = not tiles.ws[1] and tiles.gluon[1] and not INTERPRET
    gl2 = gl2 and gluon_k.problem(BM, bn2, bk2, nw2, ns2, w_scale, scalar2, a8) is None
    # a warp-specialized GEMM that cannot run: its 128-row tile on the Triton kernel at 8 warps (two warpgroups)
    nw1 = 8 if tiles.ws[0] and not ws1 else nw1
    nw2 = 8 if tiles.ws[1] and not ws2 else nw2
    if a8 and not ws1:  # the call's first kernel: activations to e4m3, one scale per (token, FC1 K tile)
        xa, xs = quantise_rows(x, bk1, gdc, pdl)
        pdl = chain
    else:
        xa, xs = x, x
    counters = torch.zeros(2 * E, dtype=i32, device=dev)  # counts, then cursors
    sorted_slots = torch.empty(p_max, dtype=i32, device=dev)
    tile_expert = torch.empty(tiles_max, dtype=i32, device=dev)
    ntiles = torch.empty(1, dtype=i32, device=dev)
    g_align = cdiv(S, ALIGN_BLOCK)
    launcher(_align_count)[(g_align,)](
        ids, counters, sorted_slots, S, p_max, cdiv(p_max, g_align), BLOCK=ALIGN_BLOCK, GDC=gdc, num_warps=4, **pdl
    )
    launcher(_align_scatter)[(g_align,)](
        ids,
        counters,
        counters[E:],
        sorted_slots,
        tile_expert,
        ntiles,
        S,
        E,
        tiles_max,
        BM=BM,
        E_P2=next_power_of_2(E),
        BLOCK=ALIGN_BLOCK,
        TCH=TILE_CHUNK,
        GDC=gdc,
        num_warps=4,
        **chain,
    )
    inter = torch.empty((p_max, I), dtype=torch.float8_e4m3fn if a8 else dtype, device=dev)
    isc = torch.empty((p_max, cdiv(I, bn1)), dtype=torch.float32, device=dev) if a8 else x
    y = torch.empty((S, H), dtype=dtype, device=dev)
    dot_prec = "ieee" if dtype == torch.float32 else "tf32"
    b13, b2 = args.w13_bias, args.w2_bias
    s13, s13e, s13n, s13k = scale_args(args.w13_scale, block) if fp8 else (x, 0, 0, 0)
    s2, s2e, s2n, s2k = scale_args(args.w2_scale, block) if fp8 else (x, 0, 0, 0)
    occ1, occ2 = tiles.occupancy
    grid1 = (max(1, min(occ1 * num_sms, tiles_max * cdiv(I, bn1))),)
    # the constexprs and launch options every FC1 kernel (warp-specialized, Gluon, Triton) takes, and every FC2 one
    fc1_kw = dict(ACT=_ACT[args.activation], HAS_BIAS=b13 is not None, W_SCALE=w_scale, BM=BM, BN=bn1, BK=bk1)
    fc1_kw.update(GROUP=GROUP_M, NUM_STAGES=ns1, GDC=gdc, num_warps=nw1, **chain)
    fc2_kw = dict(HAS_BIAS=b2 is not None, W_SCALE=w_scale, BM=BM, BN=bn2, BK=bk2, GROUP=GROUP_M, NUM_STAGES=ns2)
    fc2_kw.update(GDC=gdc, num_warps=nw2, **chain)
    if ws1:
        xq, xsq = gather_quantise_rows(x, sorted_slots, k, bk1, gdc, chain)
        a_desc, w_desc = ws_k.fc1_descriptors(xq, args.w13, E, H, I, BM, bn1, bk1)
        launcher(ws_k._fc1_ws_kernel)[grid1](
            a_desc,
            w_desc,
            xsq,
            s13,
            b13 if b13 is not None else x,
            tile_expert,
            ntiles,
            inter,
            isc,
            H,
            I,
            xsq.stride(0),
            s13e,
            s13n,
            s13k,
            sbn,
            sbk,
            b13.stride(0) if b13 is not None else 0,
            isc.stride(0),
            UNROLL=tiles.unroll[0],
            **fc1_kw,
        )
    elif gl1:
        launcher(gluon_k._fc1_w8a8_kernel)[grid1](
            gluon_k.fc1_descriptor(args.w13, E, H, I, bn1, bk1),
            xa,
            xs,
            s13,
            b13 if b13 is not None else x,
            sorted_slots,
            tile_expert,
            ntiles,
            inter,
            isc,
            H,
            I,
            k,
            xa.stride(0),
            xs.stride(0),
            s13e,
            s13n,
            s13k,
            sbn,
            sbk,
            b13.stride(0) if b13 is not None else 0,
            isc.stride(0),
            UNROLL=tiles.unroll[0],
            **fc1_kw,
        )
    else:
        launcher(_fc1_kernel)[grid1](
            xa,
            xs,
            args.w13,
            s13,
            b13 if b13 is not None else x,
            sorted_slots,
            tile_expert,
            ntiles,
            inter,
            isc,
            E,
            H,
            I,
            p_max,
            k,
            xa.stride(0),
            xs.stride(0),
            s13e,
            s13n,
            s13k,
            sbn,
            sbk,
            b13.stride(0) if b13 is not None else 0,
            isc.stride(0),
            A_FP8=a8,
            DOT_PREC=dot_prec,
            FLATTEN=tiles.flatten[0],
            JOIN=tiles.join,
            SCALAR_SW=scalar1,
            **fc1_kw,
        )
    grid2 = (max(1, min(occ2 * num_sms, tiles_max * cdiv(H, bn2))),)
    if ws2 or gl2:  # the two Gluon FC2s take the same arguments
        a_desc, w_desc = gluon_k.descriptors(inter, args.w2, E, H, I, BM, bn2, bk2)
        launcher(ws_k._fc2_ws_kernel if ws2 else gluon_k._fc2_w8a8_kernel)[grid2](
            a_desc,
            w_desc,
            isc,
            s2,
            b2 if b2 is not None else x,
            sorted_slots,
            tile_expert,
            ntiles,
            y,
            H,
            I,
            isc.stride(0),
            s2e,
            s2n,
            s2k,
            sbn,
            sbk,
            b2.stride(0) if b2 is not None else 0,
            UNROLL=tiles.unroll[1],
            **fc2_kw,
        )
    else:
        launcher(_fc2_kernel)[grid2](
            inter,
            isc,
            args.w2,
            s2,
            b2 if b2 is not None else x,
            sorted_slots,
            tile_expert,
            ntiles,
            y,
            E,
            H,
            I,
            p_max,
            isc.stride(0),
            s2e,
            s2n,
            s2k,
            sbn,
            sbk,
            b2.stride(0) if b2 is not None else 0,
            A_FP8=a8,
            DOT_PREC=dot_prec,
            FLATTEN=tiles.flatten[1],
            SCALAR_SW=scalar2,
            **fc2_kw,
        )
    width = min(1024, next_power_of_2(H))
    launcher(_sum_kernel)[(T, cdiv(H, width))](
        y, tw, out, H, k, out.stride(0), BLOCK=width, GDC=gdc, num_warps=4, **chain
    )
    return out
