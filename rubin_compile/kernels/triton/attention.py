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
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from rubin_compile.ops.attention import AttentionArgs
from rubin_compile.ops.registry import Launch

MAX_ROWS = 64  # query rows (S * Hq / Hkv) one program holds
MAX_QUERIES = 4  # query positions selection sends here (decode, short verification); more is prefill: SDPA
BLOCK_N = 64  # key positions per tile (Config.block_n)
MIN_SPLIT_TILES = 4  # a split reads at least this many tiles (Config.min_split_tiles)
SCAN_POSITIONS = 1024  # mask bytes (or elements) per load of the scan for the attended span
SPLIT_CHUNK = 32  # partial softmaxes merged per step
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
    Sem,
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
    MASK_SHARED: tl.constexpr,  # the mask is the same for every query row (stride 0 over heads and positions)
    SCAN: tl.constexpr,  # mask positions per load of the scan for the attended span
    CAUSAL: tl.constexpr,
    K_SCALED: tl.constexpr,
    V_SCALED: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: normalise and write Out
    COMBINE: tl.constexpr,  # several splits: the last one to finish merges them (else _combine does)
    SPLIT_CHUNK: tl.constexpr,  # splits merged per step of that combine
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
    start = split * split_len
    end = tl.minimum(start + split_len, Skv)
    if MASK_KIND != 0:
        # The span [lo, hi) of this split that some query row attends to, from the mask alone (a byte or two per
        # position, against 2 * D bytes of K and V per KV head): the keys and values outside it -- the unfilled
        # part of a static cache, padding -- are never read. Exact: a position no row attends to adds
        # exp(-inf) = 0. Found before the K / V loop, so that no K / V load waits on a mask load: the loop's
        # copies are predicated by loop bounds alone and Triton keeps num_stages - 1 tiles of them in flight.
        lo = end
        hi = start
        if MASK_SHARED:
            m_row = Mask + b * sm_b
            for c0 in range(start, end, SCAN):
                cols = c0 + tl.arange(0, SCAN)
                ok = cols < end
                mv = tl.load(m_row + cols * sm_n, mask=ok, other=0)
                if MASK_KIND == 1:
                    att = ok & (mv != 0)
                else:
                    att = ok & (mv.to(tl.float32) != float("-inf"))
                lo = tl.minimum(lo, tl.min(tl.where(att, cols, end), 0))
                hi = tl.maximum(hi, tl.max(tl.where(att, cols + 1, start), 0))
        else:
            for c0 in range(start, end, SCAN):
                cols = c0 + tl.arange(0, SCAN)
                ok = row_ok[:, None] & (cols < end)[None, :]
                mv = tl.load(
                    Mask + b * sm_b + head[:, None] * sm_h + s_idx[:, None] * sm_s + cols[None, :] * sm_n,
                    mask=ok,
                    other=0,
                )
                if MASK_KIND == 1:
                    att = ok & (mv != 0)
                else:
                    att = ok & (mv.to(tl.float32) != float("-inf"))
                if CAUSAL:
                    att = att & (cols[None, :] <= s_idx[:, None])
                any_row = tl.max(att.to(tl.int32), 0) > 0
                lo = tl.minimum(lo, tl.min(tl.where(any_row, cols, end), 0))
                hi = tl.maximum(hi, tl.max(tl.where(any_row, cols + 1, start), 0))
        start = lo
        end = tl.maximum(hi, lo)
    if CAUSAL:
        end = tl.minimum(end, S)  # query position s attends to keys 0..s
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BDV], tl.float32)
    k_base = K + b * sk_b + hk * sk_h
    v_base = V + b * sv_b + hk * sv_h
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        k = tl.load(k_base + cols[:, None] * sk_n + d[None, :], mask=col_ok[:, None] & (d[None, :] < D), other=0.0)
        v = tl.load(v_base + cols[:, None] * sv_n + dv[None, :], mask=col_ok[:, None] & (dv[None, :] < DV), other=0.0)
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
        tl.store(PartO + part[:, None] * BDV + dv[None, :], acc, mask=row_ok[:, None])
        tl.store(PartML + part * 2, m_i, mask=row_ok)
        tl.store(PartML + part * 2 + 1, l_i, mask=row_ok)
        if COMBINE:
            # The last split of this (batch, KV head) to finish merges all of them, in split order (deterministic),
            # so no second kernel is launched. The barrier orders every thread's partial stores before the
            # ticket's release; the ticket's acquire orders the merge's loads (.cg: from L2, where the other
            # programs' stores are) after every other split's release. The last program resets the ticket.
            tl.debug_barrier()
            ticket = tl.atomic_add(Sem + bh, 1, sem="acq_rel", scope="gpu")
            if ticket == nsplit - 1:
                _merge_splits(PartO, PartML, Out, bh * nsplit * ROWS, nsplit, b, hk, 0, S * GROUP, so_b, so_h, so_s,
                              GROUP, ROWS, DV, BDV, SPLIT_CHUNK, True)  # fmt: skip
                tl.atomic_xchg(Sem + bh, 0)


@triton.jit
def _merge_splits(PartO, PartML, Out, base, nsplit, b, hk, row_start, row_end, so_b, so_h, so_s, GROUP: tl.constexpr,
                  ROWS: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
                  FROM_L2: tl.constexpr):  # fmt: skip
    """Merge the ``nsplit`` partial softmaxes (acc, max, sum) of query rows ``row_start:row_end`` of KV head ``hk``
    and write those output rows: per row, online over chunks of splits (the running maximum rescales what came
    before)."""
    dv = tl.arange(0, BDV)
    splits = tl.arange(0, SPLIT_CHUNK)
    for row in range(row_start, row_end):
        head = hk * GROUP + row % GROUP
        s_idx = row // GROUP
        m_run = tl.full([1], float("-inf"), tl.float32)
        l_sum = tl.zeros([1], tl.float32)
        acc = tl.zeros([BDV], tl.float32)
        for s0 in range(0, nsplit, SPLIT_CHUNK):
            sp = s0 + splits
            ok = sp < nsplit
            at = base + sp * ROWS + row
            if FROM_L2:
                m_s = tl.load(PartML + at * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
                l_s = tl.load(PartML + at * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
                o = tl.load(PartO + at[:, None] * BDV + dv[None, :], mask=ok[:, None], other=0.0, cache_modifier=".cg")
            else:
                m_s = tl.load(PartML + at * 2, mask=ok, other=float("-inf"))
                l_s = tl.load(PartML + at * 2 + 1, mask=ok, other=0.0)
                o = tl.load(PartO + at[:, None] * BDV + dv[None, :], mask=ok[:, None], other=0.0)
            m_new = tl.maximum(m_run, tl.max(m_s, 0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_run - m_use)
            w = tl.exp2(m_s - m_use)
            l_sum = l_sum * alpha + tl.sum(w * l_s, 0)
            acc = acc * alpha + tl.sum(w[:, None] * o, 0)
            m_run = m_new
        tl.store(Out + b * so_b + head * so_h + s_idx * so_s + dv, (acc / l_sum).to(Out.dtype.element_ty), mask=dv < DV)


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
    SPLIT_CHUNK: tl.constexpr,
):
    """The separate merge (``Config.fused_combine`` off, or no ticket buffer): one program per (batch, KV head,
    query row)."""
    bh = tl.program_id(0)
    row = tl.program_id(1)
    _merge_splits(PartO, PartML, Out, bh * nsplit * ROWS, nsplit, bh // Hkv, bh % Hkv, row, row + 1, so_b, so_h, so_s,
                  GROUP, ROWS, DV, BDV, SPLIT_CHUNK, False)  # fmt: skip


def rows_of(S: int, Hq: int, Hkv: int) -> int:
    """Query rows one program holds: the S positions of the Hq / Hkv heads that share a KV head."""
    return S * (Hq // Hkv)


@dataclass(frozen=True)
class Config:
    """How a call is cut into programs (benchmarks/decode_attention.py --sweep measures the alternatives; the
    defaults are its winners on the H200, docs/kernels/decode_attention.md)."""

    block_n: int = BLOCK_N  # key positions per tile
    num_warps: int = 4
    num_stages: int = 3  # K / V tiles in flight per program: num_stages - 1
    programs_per_sm: int = 2  # (batch, KV head, split) programs aimed for per SM
    min_split_tiles: int = MIN_SPLIT_TILES  # a split reads at least this many tiles
    fused_combine: bool = True  # the last split merges (no second kernel)


DEFAULT = Config()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count if torch.cuda.is_available() else 132


def num_splits(B: int, Hkv: int, Skv: int, sms: int, config: Config = DEFAULT) -> int:
    """How many splits of the sequence: enough (batch, KV head, split) programs for ``config.programs_per_sm``
    per SM (a decode program is latency-bound: several per SM keep loads in flight), each split at least
    ``config.min_split_tiles`` tiles long."""
    tiles = triton.cdiv(Skv, config.block_n)
    wanted = triton.cdiv(config.programs_per_sm * sms, max(B * Hkv, 1))
    return max(1, min(wanted, tiles // config.min_split_tiles))


# Tickets of the fused merge: one int32 per (batch, KV head) of a launch, zero between launches (the last split
# resets its own). Allocated once per device, outside any CUDA-graph capture (a buffer made during a capture
# would belong to that graph's memory pool); a call captured before the first eager call merges with the
# separate _combine kernel instead. Consecutive launches take consecutive slices of a ring, so that launches
# running at once on two streams (vLLM's dual-batch overlap) do not share tickets.
TICKET_SLOTS = 4096  # (batch, KV head) pairs of one launch; more -> the separate _combine
TICKET_RING = 16
_tickets: dict[str, torch.Tensor] = {}
_ticket_next = [0]


def _ticket_slice(device: torch.device, programs: int) -> Optional[torch.Tensor]:
    if programs > TICKET_SLOTS:
        return None
    key = str(device)
    ring = _tickets.get(key)
    if ring is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        ring = _tickets[key] = torch.zeros(TICKET_RING * TICKET_SLOTS, dtype=torch.int32, device=device)
    i = _ticket_next[0] = (_ticket_next[0] + 1) % TICKET_RING
    return ring[i * TICKET_SLOTS : (i + 1) * TICKET_SLOTS]


def run(
    args: AttentionArgs, launch: Launch = Launch(), *, splits: Optional[int] = None, config: Optional[Config] = None
) -> torch.Tensor:
    """``rubin.attention`` with the split-KV decode kernel (the registered adapter). ``splits`` and ``config``
    override the heuristics (tests, the benchmark's sweep). The result has the op's layout ([B, S, Hq, Dv]
    seen as [B, Hq, S, Dv])."""
    cfg = config or DEFAULT
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
        mask_kind, mask_arg, mask_strides, shared = 0, q, (0, 0, 0, 0), True
    else:
        full = mask.expand(B, Hq, S, Skv)  # broadcast dimensions get stride 0
        mask_kind = 1 if mask.dtype == torch.bool else 2
        mask_arg, mask_strides = full, tuple(full.stride())
        shared = (Hq == 1 or full.stride(1) == 0) and (S == 1 or full.stride(2) == 0)
    k_scale, v_scale = args.k_scale, args.v_scale
    nsplit = splits if splits is not None else num_splits(B, Hkv, Skv, _sm_count(q.device.index or 0), cfg)
    nsplit = max(1, min(nsplit, triton.cdiv(Skv, cfg.block_n)))
    split_len = triton.cdiv(triton.cdiv(Skv, nsplit), cfg.block_n) * cfg.block_n
    nsplit = triton.cdiv(Skv, split_len) if Skv > 0 else 1
    BDV = max(16, triton.next_power_of_2(Dv))
    direct = nsplit == 1
    tickets = None
    if direct:
        part_o = part_ml = out
    else:
        part_o = torch.empty((B * Hkv * nsplit * ROWS, BDV), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((B * Hkv * nsplit * ROWS, 2), dtype=torch.float32, device=q.device)
        if cfg.fused_combine:
            tickets = _ticket_slice(q.device, B * Hkv)
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
        tickets if tickets is not None else part_ml,
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
        BLOCK_N=cfg.block_n,
        MASK_KIND=mask_kind,
        MASK_SHARED=shared,
        SCAN=SCAN_POSITIONS if shared else max(16, SCAN_POSITIONS // ROWS),
        CAUSAL=bool(args.is_causal),
        K_SCALED=k_scale is not None,
        V_SCALED=v_scale is not None,
        DIRECT=direct,
        COMBINE=tickets is not None,
        SPLIT_CHUNK=SPLIT_CHUNK,
        IEEE=q.dtype == torch.float32,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if not direct and tickets is None:
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
            SPLIT_CHUNK=SPLIT_CHUNK,
            num_warps=4,
        )
    return out
