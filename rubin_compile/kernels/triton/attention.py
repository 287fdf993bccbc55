"""Split-KV decode attention (flash-decoding) in Triton for ``rubin.attention``.

Contract: ``run(args, launch)`` computes ``rubin.attention`` (ops/attention.py) for a few query positions
(``S * Hq / Hkv <= MAX_ROWS``: decode, speculative verification) over a long key / value sequence, for
bf16 / fp16 / fp32 queries and keys / values in the query's dtype or FP8 (e4m3 / e5m2, per-tensor
``k_scale`` / ``v_scale``), with a bool or additive ``attn_mask`` broadcast over any dimension, or
``is_causal``. No host synchronisation (capturable in a CUDA graph). Within the tolerances of
tests/gpu/test_decode_attention.py of the float64 reference.

Why this shape: one decode step reads the whole KV cache once and does two FLOPs per byte, so the floor is
(bytes of K and V read) / (HBM bandwidth) and the kernel must (1) read each key / value head once for all the
query heads that share it -- GQA without repeating K / V, which the ATen form (``repeat_kv`` + SDPA) copies
``Hq / Hkv`` times over the whole cache --, (2) spread the sequence over enough programs to keep every SM
reading (one program per (batch, KV head) is 4-32 programs on a 132-SM GPU: split the sequence, then combine
the partial softmaxes), and (3) read only the part of a static cache that is filled: the keys and values of a
position whose mask entries all say "do not attend" (the positions past the current length in a Hugging Face
static cache, padding) are not loaded (their loads are predicated off after the mask tile is read). That is
exact, whatever the mask: a fully masked position contributes nothing to the softmax.

Layout: program (split, b * Hkv + hk) computes, for the ``S * n`` rows (query position s, head hk * n + g) of
KV head hk, the softmax over its slice of positions; ``n`` rows of one position share each K / V tile, so the
QK^T and PV products are ``tl.dot`` of [ROWS, D] x [D, BLOCK_N] (ROWS padded to 16, the MMA's minimum M).
With one split the program normalises and writes the output; otherwise it writes (acc, max, sum) partials
in fp32 and ``_combine`` merges the splits per row.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from rubin_compile.ops.attention import AttentionArgs
from rubin_compile.ops.registry import Launch

MAX_ROWS = 64  # query rows (S * Hq / Hkv) one program holds
MAX_QUERIES = 4  # query positions selection sends here (decode, short verification); more is prefill: SDPA
BLOCK_N = 64  # key positions per tile
MIN_SPLIT_BLOCKS = 2  # a split reads at least this many tiles (below, the combine costs more than it saves)
_LOG2E = 1.4426950408889634


@triton.jit
def _split_kv(
    Q,
    K,
    V,
    Mask,
    KScale,
    VScale,
    Out,
    PartO,
    PartML,
    sq_b,
    sq_h,
    sq_s,
    sk_b,
    sk_h,
    sk_n,
    sv_b,
    sv_h,
    sv_n,
    sm_b,
    sm_h,
    sm_s,
    sm_n,
    so_b,
    so_h,
    so_s,
    Hkv,
    S,
    Skv,
    split_len,
    qk_scale,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BD: tl.constexpr,
    BDV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_KIND: tl.constexpr,  # 0 none, 1 bool (True = attend), 2 additive
    CAUSAL: tl.constexpr,
    K_SCALED: tl.constexpr,
    V_SCALED: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: normalise and write Out
    IEEE: tl.constexpr,  # fp32 inputs: full-precision dots (no TF32)
):
    split = tl.program_id(0)
    bh = tl.program_id(1)
    nsplit = tl.num_programs(0)
    b = bh // Hkv
    hk = bh % Hkv
    rows = tl.arange(0, ROWS)
    s_idx = rows // GROUP
    head = hk * GROUP + rows % GROUP
    row_ok = rows < S * GROUP
    d = tl.arange(0, BD)
    dv = tl.arange(0, BDV)
    q = tl.load(
        Q + b * sq_b + head[:, None] * sq_h + s_idx[:, None] * sq_s + d[None, :],
        mask=row_ok[:, None] & (d[None, :] < D),
        other=0.0,
    )
    scale = qk_scale
    if K_SCALED:
        scale = scale * tl.load(KScale).to(tl.float32)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BDV], tl.float32)
    start = split * split_len
    end = tl.minimum(start + split_len, Skv)
    k_base = K + b * sk_b + hk * sk_h
    v_base = V + b * sv_b + hk * sv_h
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        # The mask first (a byte or two per position, against 2 * D bytes of K and V per KV head): a position no
        # row attends to -- the unfilled part of a static cache, padding -- has its K / V loads predicated off,
        # so it is never read. Exact: such a position adds exp(-inf) = 0. The loads stay unconditional in
        # the loop, so Triton still pipelines them (cp.async).
        allowed = row_ok[:, None] & col_ok[None, :]
        if MASK_KIND != 0:
            mv = tl.load(
                Mask + b * sm_b + head[:, None] * sm_h + s_idx[:, None] * sm_s + cols[None, :] * sm_n,
                mask=allowed,
                other=0,
            )
            if MASK_KIND == 1:
                allowed = allowed & (mv != 0)
            else:
                bias = tl.where(allowed, mv.to(tl.float32), float("-inf"))
                allowed = allowed & (bias != float("-inf"))
        if CAUSAL:
            allowed = allowed & (cols[None, :] <= s_idx[:, None])
        read = tl.max(allowed.to(tl.int32), 0) > 0  # [BLOCK_N]: some row attends to this position
        k = tl.load(k_base + cols[:, None] * sk_n + d[None, :], mask=read[:, None] & (d[None, :] < D), other=0.0)
        v = tl.load(v_base + cols[:, None] * sv_n + dv[None, :], mask=read[:, None] & (dv[None, :] < DV), other=0.0)
        if IEEE:
            qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k.to(q.dtype)))
        qk = qk * scale
        if MASK_KIND == 2:
            qk = qk + tl.where(allowed, bias, 0.0) * 1.4426950408889634
        qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing allowed yet stay empty
        p = tl.exp2(qk - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if V_SCALED:
        acc = acc * tl.load(VScale).to(tl.float32)
    if DIRECT:
        o = acc / l_i[:, None]
        tl.store(
            Out + b * so_b + head[:, None] * so_h + s_idx[:, None] * so_s + dv[None, :],
            o.to(Out.dtype.element_ty),
            mask=row_ok[:, None] & (dv[None, :] < DV),
        )
    else:
        part = (bh * nsplit + split) * ROWS + rows
        tl.store(PartO + part[:, None] * BDV + dv[None, :], acc)
        tl.store(PartML + part * 2, m_i)
        tl.store(PartML + part * 2 + 1, l_i)


@triton.jit
def _combine(
    PartO,
    PartML,
    Out,
    so_b,
    so_h,
    so_s,
    Hkv,
    nsplit,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    DV: tl.constexpr,
    BDV: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
):
    bh = tl.program_id(0)
    row = tl.program_id(1)
    b = bh // Hkv
    head = (bh % Hkv) * GROUP + row % GROUP
    s_idx = row // GROUP
    dv = tl.arange(0, BDV)
    splits = tl.arange(0, BLOCK_SPLITS)
    base = bh * nsplit * ROWS + row
    # Online over chunks of splits: the running maximum rescales what came before (as within a split).
    m_run = tl.full([1], float("-inf"), tl.float32)
    l_sum = tl.zeros([1], tl.float32)
    acc = tl.zeros([BDV], tl.float32)
    for s0 in range(0, nsplit, BLOCK_SPLITS):
        sp = s0 + splits
        ok = sp < nsplit
        m_s = tl.load(PartML + (base + sp * ROWS) * 2, mask=ok, other=float("-inf"))
        l_s = tl.load(PartML + (base + sp * ROWS) * 2 + 1, mask=ok, other=0.0)
        o = tl.load(PartO + (base + sp[:, None] * ROWS) * BDV + dv[None, :], mask=ok[:, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m_s, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_use)
        w = tl.exp2(m_s - m_use)
        l_sum = l_sum * alpha + tl.sum(w * l_s, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        m_run = m_new
    tl.store(Out + b * so_b + head * so_h + s_idx * so_s + dv, (acc / l_sum).to(Out.dtype.element_ty), mask=dv < DV)


def rows_of(S: int, Hq: int, Hkv: int) -> int:
    """Query rows one program holds: the S positions of the Hq / Hkv heads that share a KV head."""
    return S * (Hq // Hkv)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count if torch.cuda.is_available() else 132


def num_splits(B: int, Hkv: int, Skv: int, sms: int) -> int:
    """How many splits of the sequence: enough (batch, KV head, split) programs for four waves over the SMs
    (a decode program is latency-bound: several per SM keep its loads in flight), each split at least
    ``MIN_SPLIT_BLOCKS`` tiles long."""
    tiles = triton.cdiv(Skv, BLOCK_N)
    wanted = triton.cdiv(4 * sms, max(B * Hkv, 1))
    return max(1, min(wanted, tiles // MIN_SPLIT_BLOCKS))


def run(args: AttentionArgs, launch: Launch = Launch(), *, splits: Optional[int] = None) -> torch.Tensor:
    """``rubin.attention`` with the split-KV decode kernels (the registered adapter). ``splits`` overrides the
    heuristic (tests). The result has the op's layout ([B, S, Hq, Dv] seen as [B, Hq, S, Dv])."""
    q, k, v = args.query, args.key, args.value
    B, Hq, Hkv, S, Skv, D, Dv = args.B, args.Hq, args.Hkv, args.S, args.Skv, args.D, args.Dv
    group = Hq // Hkv
    rows = rows_of(S, Hq, Hkv)
    if rows > MAX_ROWS:
        raise NotImplementedError(
            f"rubin.attention[triton]: {S} query positions x {group} heads per KV head = {rows} rows exceeds "
            f"{MAX_ROWS}; the decode kernel is for a few query positions (selection sends prefill to SDPA)"
        )
    out = q.new_empty((B, S, Hq, Dv)).transpose(1, 2)
    if B == 0 or S == 0 or Hq == 0:
        return out
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.stride(3) != 1:
            raise NotImplementedError(f"rubin.attention[triton]: {name} needs a contiguous last (head) dim")
    ROWS = max(16, triton.next_power_of_2(rows))
    mask = args.attn_mask
    if mask is None:
        mask_kind, mask_arg, mask_strides = 0, q, (0, 0, 0, 0)
    else:
        full = mask.expand(B, Hq, S, Skv)  # broadcast dimensions get stride 0
        mask_kind = 1 if mask.dtype == torch.bool else 2
        mask_arg, mask_strides = full, tuple(full.stride())
    k_scale, v_scale = args.k_scale, args.v_scale
    nsplit = splits if splits is not None else num_splits(B, Hkv, Skv, _sm_count(q.device.index or 0))
    nsplit = max(1, min(nsplit, triton.cdiv(Skv, BLOCK_N)))
    split_len = triton.cdiv(triton.cdiv(Skv, nsplit), BLOCK_N) * BLOCK_N
    nsplit = triton.cdiv(Skv, split_len) if Skv > 0 else 1
    BDV = max(16, triton.next_power_of_2(Dv))
    direct = nsplit == 1
    if direct:
        part_o = part_ml = out
    else:
        part_o = torch.empty((B * Hkv * nsplit * ROWS, BDV), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((B * Hkv * nsplit * ROWS, 2), dtype=torch.float32, device=q.device)
    scale = args.scale if args.scale is not None else 1.0 / math.sqrt(D)
    so = out.stride()
    _split_kv[(nsplit, B * Hkv)](
        q,
        k,
        v,
        mask_arg,
        k_scale if k_scale is not None else q,
        v_scale if v_scale is not None else q,
        out,
        part_o,
        part_ml,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        *mask_strides,
        so[0],
        so[1],
        so[2],
        Hkv,
        S,
        Skv,
        split_len,
        scale * _LOG2E,
        GROUP=group,
        ROWS=ROWS,
        D=D,
        DV=Dv,
        BD=max(16, triton.next_power_of_2(D)),
        BDV=BDV,
        BLOCK_N=BLOCK_N,
        MASK_KIND=mask_kind,
        CAUSAL=bool(args.is_causal),
        K_SCALED=k_scale is not None,
        V_SCALED=v_scale is not None,
        DIRECT=direct,
        IEEE=q.dtype == torch.float32,
        num_warps=4,
        num_stages=2,
    )
    if not direct:
        _combine[(B * Hkv, rows)](
            part_o,
            part_ml,
            out,
            so[0],
            so[1],
            so[2],
            Hkv,
            nsplit,
            GROUP=group,
            ROWS=ROWS,
            DV=Dv,
            BDV=BDV,
            BLOCK_SPLITS=min(32, triton.next_power_of_2(nsplit)),
            num_warps=4,
        )
    return out
