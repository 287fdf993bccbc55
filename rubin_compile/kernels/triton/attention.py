"""Split-KV decode attention (flash-decoding) in Triton for ``rubin.attention``.

Contract: ``run(args, launch)`` computes ``rubin.attention`` (ops/attention.py) for a few query positions
(``S * Hq / Hkv <= MAX_ROWS``: decode, speculative verification) over a long key / value sequence, for
bf16 / fp16 / fp32 queries and keys / values in the query's dtype or FP8 (e4m3 / e5m2, per-tensor
``k_scale`` / ``v_scale``; with a 16-bit query the products run on fp16 MMAs), with a bool or additive
``attn_mask`` broadcast over any dimension, or ``is_causal``, and attention ``sinks`` (a logit per query head in
each row's denominator, added after the K / V loop: ``_add_sink``). No host synchronisation (capturable in a CUDA graph). Within the tolerances of
tests/gpu/test_decode_attention.py of the float64 reference.

Why this shape: one decode step reads the whole KV cache once and does two FLOPs per byte, so the floor is
(bytes of K and V read) / (HBM bandwidth) and the kernel must (1) read each key / value head once for all the
query heads that share it -- GQA without repeating K / V, which the ATen form (``repeat_kv`` + SDPA) copies
``Hq / Hkv`` times over the whole cache --, (2) spread the sequence over enough programs to keep every SM
reading (one program per (batch, KV head) is 4-32 programs on a 132-SM GPU: split the sequence, then combine
the partial softmaxes), and (3) read only the part of a static cache that is filled: each program first scans
the mask over its slice for the span some query row attends to (the positions past the current length of a
Hugging Face static cache are outside it) and reads keys and values only inside that span. That is exact,
whatever the mask: a fully masked position contributes nothing to the softmax. The scan comes before the K / V
loop so that no K / V load waits on a mask load of its iteration: Triton then keeps ``num_stages - 1`` tiles in
flight (predicating each tile's loads by its mask tile instead put one memory latency on every tile).

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

from rubin_compile.kernels.triton.launch import aligned16, cdiv, launcher, next_power_of_2, tracing_into_graph
from rubin_compile.kernels.triton.pdl import gdc_launch_dependents, gdc_wait, has_gdc, l2_prefetch
from rubin_compile.ops.attention import AttentionArgs
from rubin_compile.ops.registry import Launch

MAX_ROWS = 64  # query rows (S * Hq / Hkv) one program holds
MAX_QUERIES = 4  # query positions selection sends here (decode, short verification); more is prefill: SDPA
BLOCK_N = 64  # key positions per tile (Config.block_n)
SCAN_POSITIONS = 1024  # mask bytes (or elements) per load of the scan for the attended span
SPLIT_CHUNK = 64  # at most this many partial softmaxes merged per step (combine_chunk)
_LOG2E = 1.4426950408889634


@triton.jit
def _split_kv(
    Q,
    K,
    V,
    Mask,
    KScale,
    VScale,
    Sinks,
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
    MASK_SHARED: tl.constexpr,  # the mask is the same for every query row (stride 0 over heads and positions)
    SCAN: tl.constexpr,  # mask positions per load of the scan for the attended span
    CAUSAL: tl.constexpr,
    K_SCALED: tl.constexpr,
    V_SCALED: tl.constexpr,
    SINKS: tl.constexpr,  # a sink logit per query head joins each row's softmax denominator (GPT-OSS)
    DIRECT: tl.constexpr,  # one split: normalise and write Out
    IEEE: tl.constexpr,  # fp32 inputs: full-precision dots (no TF32)
    F16_KV: tl.constexpr,  # FP8 keys / values with a 16-bit query: the products on fp16 MMAs (see below)
    GDC: tl.constexpr,  # launched with PDL: wait before the first read of another kernel's output
    EARLY_TRIGGER: tl.constexpr,  # let the next kernel launch right after the wait (else after the K / V loop)
    PF_TILES: tl.constexpr,  # K / V tiles of the split asked into L2 before the wait (0: none)
    PF_K_ROW: tl.constexpr,  # bytes of one key position (keys contiguous along positions); 0: no prefetch
    PF_V_ROW: tl.constexpr,
    PF_NCHUNK: tl.constexpr,  # L2 requests per tile (PF_TILES * PF_NCHUNK = the program's threads)
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
    start = split * split_len
    end = tl.minimum(start + split_len, Skv)
    k_base = K + b * sk_b + hk * sk_h
    v_base = V + b * sv_b + hk * sv_h
    if PF_TILES > 0:
        # Keys and values are written by earlier decode steps (the position this step appends is a predecessor's
        # write, but an L2 request is only a hint: the loads below read whatever the predecessor wrote): ask for
        # the split's first tiles now, so that they are on their way during the predecessor's tail (with PDL) and
        # the mask scan below, whose result the K / V loads must wait for.
        _prefetch_tiles(k_base, start, end, sk_n, PF_K_ROW, BLOCK_N, PF_TILES, PF_NCHUNK)
        _prefetch_tiles(v_base, start, end, sv_n, PF_V_ROW, BLOCK_N, PF_TILES, PF_NCHUNK)
    if GDC:
        gdc_wait()  # the query, the mask and the appended key / value are earlier kernels' writes
        if EARLY_TRIGGER:
            gdc_launch_dependents()
    q = tl.load(
        Q + b * sq_b + head[:, None] * sq_h + s_idx[:, None] * sq_s + d[None, :],
        mask=row_ok[:, None] & (d[None, :] < D),
        other=0.0,
    )
    # fp32 whoever launches: Triton's launcher passes a Python float as fp32, Inductor's (the kernel traced into the
    # graph, passes/inline_kernels.py) as fp64.
    scale = tl.cast(qk_scale, tl.float32)
    if K_SCALED:
        scale = scale * tl.load(KScale).to(tl.float32)
    if F16_KV:
        # e4m3 / e5m2 keys and values convert exactly to fp16 in one instruction per pair (to bf16 the conversion
        # goes through fp16: three per pair, a third of the K / V loop's instructions on sm_90), so the products run
        # on fp16 MMAs. A bf16 query converts exactly where it is inside fp16's range: a power of two brings it
        # there (exact), folded into the scores' scale; the probabilities round to fp16's 11 bits (bf16: 8).
        if q.dtype != tl.float16:
            qf = q.to(tl.float32)
            qmax = tl.max(tl.max(tl.abs(qf), 1), 0)
            qs = tl.where(qmax > 32768.0, tl.exp2(tl.ceil(tl.log2(qmax / 32768.0))), 1.0)
            q = (qf / qs).to(tl.float16)
            scale = scale * qs
    if MASK_KIND != 0:
        # The span [lo, hi) of this split that some query row attends to, from the mask alone (a byte or two per
        # position, against 2 * D bytes of K and V per KV head): the keys and values outside it -- the unfilled
        # part of a static cache, padding -- are never read. Exact: a position no row attends to adds
        # exp(-inf) = 0. Found before the K / V loop, so that no K / V load waits on a mask load: the loop's
        # copies are predicated by loop bounds alone and Triton keeps num_stages - 1 tiles of them in flight. An
        # additive mask counts as masked where its value in log2 units is -inf in fp32: -inf, or the finfo.min of a
        # bf16 / fp32 mask, which eager attention writes (x log2(e) overflows) -- the loop adds exactly that value,
        # so such a position adds 0 either way.
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
                    att = ok & (mv.to(tl.float32) * 1.4426950408889634 != float("-inf"))
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
                    att = ok & (mv.to(tl.float32) * 1.4426950408889634 != float("-inf"))
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
    if GDC and not EARLY_TRIGGER:
        # The K / V stream is done: the next kernel (the combine, or the next layer's projection, which asks for its
        # weights before its own wait) may launch while this program writes its partials.
        gdc_launch_dependents()
    if V_SCALED:
        acc = acc * tl.load(VScale).to(tl.float32)
    if DIRECT:
        if SINKS:
            alpha, l_i = _add_sink(m_i, l_i, tl.load(Sinks + head, mask=row_ok, other=0.0))
            acc = acc * alpha[:, None]
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


@triton.jit
def _prefetch_tiles(base, start, end, stride_n, ROW_BYTES: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
                    NCHUNK: tl.constexpr):  # fmt: skip
    """L2 requests for the first ``TILES`` tiles of ``BLOCK_N`` positions from ``start`` (not past ``end``) of a key or
    value head at ``base``, whose positions are contiguous (``stride_n`` elements of ``ROW_BYTES`` bytes): ``NCHUNK``
    requests per tile, ``TILES * NCHUNK`` = the program's threads, so each thread issues one (a smaller tensor would
    be replicated over the threads, each copy issuing the same request)."""
    CHUNK: tl.constexpr = (BLOCK_N * ROW_BYTES // NCHUNK + 15) // 16 * 16
    pos = start + tl.arange(0, TILES) * BLOCK_N
    nbytes = tl.minimum(tl.maximum(end - pos, 0), BLOCK_N) * ROW_BYTES
    offs = tl.arange(0, NCHUNK) * CHUNK
    sizes = tl.minimum(tl.maximum(nbytes[:, None] - offs[None, :], 0), CHUNK).to(tl.int32)
    ptrs = (base + pos * stride_n).to(tl.pointer_type(tl.int8))[:, None] + offs[None, :]
    l2_prefetch(ptrs, (sizes // 16) * 16)


@triton.jit
def _add_sink(m, l, sink):
    """(alpha, sum) for a softmax with running maximum ``m`` (log2 units) and sum ``l`` when the sink logit ``sink``
    (natural-log units, as the model's) joins its denominator: the accumulator times ``alpha`` and the new sum are
    both at the new maximum. A row with nothing attended (m = -inf) gets alpha 0: zeros out, as the model's softmax
    over [scores, sink] gives."""
    sk = sink.to(tl.float32) * 1.4426950408889634
    m_new = tl.maximum(m, sk)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_use)
    return alpha, l * alpha + tl.exp2(sk - m_use)


@triton.jit
def _merge_splits(PartO, PartML, Out, Sinks, base, nsplit, b, hk, row_start, row_end, so_b, so_h, so_s,
                  GROUP: tl.constexpr, ROWS: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr,
                  SPLIT_CHUNK: tl.constexpr, SINKS: tl.constexpr):  # fmt: skip
    """Merge the ``nsplit`` partial softmaxes (acc, max, sum) of query rows ``row_start:row_end`` of KV head ``hk``
    and write those output rows: per row, online over chunks of splits (the running maximum rescales what came
    before); with ``SINKS``, the row's head's sink logit joins the denominator last."""
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
        if SINKS:
            alpha, l_sum = _add_sink(m_run, l_sum, tl.load(Sinks + head))
            acc = acc * alpha
        tl.store(Out + b * so_b + head * so_h + s_idx * so_s + dv, (acc / l_sum).to(Out.dtype.element_ty), mask=dv < DV)


@triton.jit
def _combine(
    PartO,
    PartML,
    Out,
    Sinks,
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
    SINKS: tl.constexpr,
    GDC: tl.constexpr,
):
    """The merge of the splits: one program per (batch, KV head, query row), PDL-launched after the split kernel
    where PDL is available (it waits for the partials before reading them). (Merging in the last split to
    finish, with an acq_rel ticket, saves this launch but measured slower at every benchmark shape on the H200:
    docs/kernels/decode_attention.md.)"""
    bh = tl.program_id(0)
    row = tl.program_id(1)
    if GDC:
        gdc_wait()  # the partials are the split kernel's
        gdc_launch_dependents()
    _merge_splits(PartO, PartML, Out, Sinks, bh * nsplit * ROWS, nsplit, bh // Hkv, bh % Hkv, row, row + 1, so_b, so_h,
                  so_s, GROUP, ROWS, DV, BDV, SPLIT_CHUNK, SINKS)  # fmt: skip


def rows_of(S: int, Hq: int, Hkv: int) -> int:
    """Query rows one program holds: the S positions of the Hq / Hkv heads that share a KV head."""
    return S * (Hq // Hkv)


@dataclass(frozen=True)
class Config:
    """How a call is cut into programs. ``config_for`` picks one per call from the sweep of all of them
    (benchmarks/decode_attention.py --sweep; docs/kernels/decode_attention.md)."""

    block_n: int = BLOCK_N  # key positions per tile
    num_warps: int = 4
    num_stages: int = 3  # K / V tiles in flight per program: num_stages - 1
    programs_per_sm: int = 1  # (batch, KV head, split) programs aimed for per SM (split_positions)
    min_split_tiles: int = 2  # a split reads at least this many tiles
    # PDL-launched programs only (Launch.pdl; docs/kernels/decode_attention.md "PDL" has the measurements):
    prefetch_tiles: int = 0  # K / V tiles of its split asked into L2 before the wait (a power of 2; 0: none)
    early_trigger: bool = True  # launch_dependents right after the wait (False: after the K / V loop)
    # Launched without PDL: the combine still PDL-chained to the split kernel, which triggers after its K / V loop
    pdl_combine: bool = True


# KV positions a call reads (B * Hkv * Skv) -> the Config of the sweep on an H100 (2026-12-06, bf16; 32 / 4 heads of
# 128; benchmarks/results/decode-attention-b1-h100-2026-12-06/): DEFAULT within 1% of the best at batch 1 / 4k, 16k
# and 32k and 3.5% at batch 8 / 4k; LONG the best at batch 8 / 16k (DEFAULT 6% behind there).
DEFAULT = Config()  # one program per SM, splits of as few 64-position tiles as fill the SMs (at least 2)
LONG = Config(block_n=128, num_stages=2, programs_per_sm=2, min_split_tiles=4)  # 128-position tiles, 2 per SM
LONG_POSITIONS = 160 * 1024  # more positions than this: LONG


def config_for(B: int, Hkv: int, Skv: int) -> Config:
    return LONG if B * Hkv * Skv > LONG_POSITIONS else DEFAULT


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count if torch.cuda.is_available() else 132


def split_positions(B: int, Hkv: int, Skv: int, sms: int, config: Config) -> int:
    """Key positions per split, whole tiles: the fewest tiles that keep the (batch, KV head, split) programs within
    ``config.programs_per_sm`` per SM (a decode program is latency-bound: several per SM keep loads in flight), and at
    least ``config.min_split_tiles``. Counted in whole splits, so that the programs fill the SMs without a partial
    wave: at batch 1 / 16k (4 KV heads, 258 tiles of 64) one program per SM makes 33 splits of 8 tiles, 132
    programs on 132 SMs, where rounding a split count up and then its length made 29 splits of 9 tiles (116
    programs; 5% slower on an H100); at batch 8 / 4k, 4 splits of 17 tiles (128 programs), not 5 (160).
    benchmarks/results/decode-attention-b1-h100-2026-12-06/ has the measurements."""
    tiles = cdiv(Skv, config.block_n)
    splits = max(1, (config.programs_per_sm * sms) // max(B * Hkv, 1))  # the most splits that many programs allow
    return max(cdiv(tiles, splits), min(config.min_split_tiles, tiles), 1) * config.block_n


def num_splits(B: int, Hkv: int, Skv: int, sms: int, config: Config) -> int:
    """How many splits of the sequence ``split_positions`` makes."""
    return max(1, cdiv(Skv, split_positions(B, Hkv, Skv, sms, config)))


def run(
    args: AttentionArgs, launch: Launch = Launch(), *, splits: Optional[int] = None, config: Optional[Config] = None
) -> torch.Tensor:
    """``rubin.attention`` with the split-KV decode kernels (the registered adapter). ``splits`` and ``config``
    override the heuristics (tests, the benchmark's sweep). The result has the op's layout ([B, S, Hq, Dv]
    seen as [B, Hq, S, Dv])."""
    q, k, v = args.query, args.key, args.value
    B, Hq, Hkv, S, Skv, D, Dv = args.B, args.Hq, args.Hkv, args.S, args.Skv, args.D, args.Dv
    cfg = config or config_for(B, Hkv, Skv)
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
    ROWS = max(16, next_power_of_2(rows))
    mask = args.attn_mask
    if mask is None:
        mask_kind, mask_arg, mask_strides, shared = 0, q, (0, 0, 0, 0), True
    else:
        full = mask.expand(B, Hq, S, Skv)  # broadcast dimensions get stride 0
        mask_kind = 1 if mask.dtype == torch.bool else 2
        mask_arg, mask_strides = full, tuple(full.stride())
        shared = (Hq == 1 or full.stride(1) == 0) and (S == 1 or full.stride(2) == 0)
    k_scale, v_scale, sinks = args.k_scale, args.v_scale, args.sinks
    if sinks is not None:
        sinks = sinks.contiguous()  # the kernels read sinks[head] (a strided view, from a graph, is copied)
    if splits is not None:  # a split count asked for: whole tiles per split, as many splits as that leaves
        nsplit = max(1, min(splits, cdiv(Skv, cfg.block_n)))
        split_len = cdiv(cdiv(Skv, nsplit), cfg.block_n) * cfg.block_n
    else:
        split_len = split_positions(B, Hkv, Skv, _sm_count(q.device.index or 0), cfg)
    nsplit = cdiv(Skv, split_len) if Skv > 0 else 1
    BDV = max(16, next_power_of_2(Dv))
    direct = nsplit == 1
    # Launched without PDL, the split kernel waits for no predecessor; its combine is still PDL-chained to it
    # (Config.pdl_combine), the split kernel triggering only after its K / V loop: the combine's launch overlaps the
    # splits' last tiles and partial stores, its CTAs wait for them. Measured on an H100 (2026-12-06): 2-7% faster at
    # batch 1 from 16k and with 4 queries, the same elsewhere. (Triggering at the split kernel's start instead kept
    # the combine's CTAs resident for the whole call: up to 28% slower on the H200.) Not when traced into the graph
    # (passes/inline_kernels.py): Inductor's launcher takes no PDL launch.
    pdl = bool(launch.pdl) and has_gdc()
    chain = not pdl and not direct and cfg.pdl_combine and has_gdc() and not tracing_into_graph()
    # L2 requests before the wait pay where the program waits for a predecessor (PDL); without PDL they would only
    # add the bytes of splits that the mask then skips (a static cache far longer than its filled part).
    pf_k = pf_v = pf_tiles = 0
    if pdl and cfg.prefetch_tiles:
        pf_k, pf_v = _prefetch_row_bytes(k, D), _prefetch_row_bytes(v, Dv)
        pf_tiles = cfg.prefetch_tiles if (pf_k and pf_v) else 0
    pf_nchunk = max(1, 32 * cfg.num_warps // max(pf_tiles, 1))
    if direct:
        part_o = part_ml = out
    else:
        part_o = torch.empty((B * Hkv * nsplit * ROWS, BDV), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((B * Hkv * nsplit * ROWS, 2), dtype=torch.float32, device=q.device)
    scale = args.scale if args.scale is not None else 1.0 / math.sqrt(D)
    so = out.stride()
    launcher(_split_kv)[(nsplit, B * Hkv)](
        q,
        k,
        v,
        mask_arg,
        k_scale if k_scale is not None else q,
        v_scale if v_scale is not None else q,
        sinks if sinks is not None else q,
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
        BD=max(16, next_power_of_2(D)),
        BDV=BDV,
        BLOCK_N=cfg.block_n,
        MASK_KIND=mask_kind,
        MASK_SHARED=shared,
        SCAN=SCAN_POSITIONS if shared else max(16, SCAN_POSITIONS // ROWS),
        CAUSAL=bool(args.is_causal),
        K_SCALED=k_scale is not None,
        V_SCALED=v_scale is not None,
        SINKS=sinks is not None,
        DIRECT=direct,
        IEEE=q.dtype == torch.float32,
        F16_KV=q.dtype != torch.float32 and k.element_size() == 1 and v.element_size() == 1,
        GDC=pdl or chain,
        EARLY_TRIGGER=cfg.early_trigger and not chain,
        PF_TILES=pf_tiles,
        PF_K_ROW=pf_k,
        PF_V_ROW=pf_v,
        PF_NCHUNK=pf_nchunk,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    if not direct:
        launcher(_combine)[(B * Hkv, rows)](
            part_o,
            part_ml,
            out,
            sinks if sinks is not None else q,
            so[0],
            so[1],
            so[2],
            Hkv,
            nsplit,
            GROUP=group,
            ROWS=ROWS,
            DV=Dv,
            BDV=BDV,
            SPLIT_CHUNK=combine_chunk(nsplit),
            SINKS=sinks is not None,
            GDC=pdl or chain,
            num_warps=4,
            # PDL-chained after the split kernel (it waits for the partials): its launch overlaps the split's tail.
            **({"launch_pdl": True} if pdl or chain else {}),
        )
    return out


def combine_chunk(nsplit: int) -> int:
    """Partials ``_combine`` loads per step: all of them up to ``SPLIT_CHUNK`` (each step is one round trip to L2)."""
    return max(16, min(SPLIT_CHUNK, next_power_of_2(nsplit)))


def _prefetch_row_bytes(t: torch.Tensor, width: int) -> int:
    """Bytes of one position of key / value ``t`` [B, H, S, width] when its positions are contiguous and every
    position starts 16-byte aligned (what ``cp.async.bulk.prefetch.L2`` takes), else 0 (no prefetch)."""
    row = width * t.element_size()
    strides = (t.stride(0), t.stride(1))
    aligned = all((st * t.element_size()) % 16 == 0 for st in strides) and aligned16(t)
    return row if (t.stride(3) == 1 and t.stride(2) == width and row % 16 == 0 and aligned) else 0
