"""The fused decode path of ``rubin.moe``'s Triton kernels: FC1, the activation, FC2 and the top-k sum in one
persistent launch with no kernel boundary (``MoEConfig.mode == "fused"``, decode sizes: ``T <= MAX_T``).

Contract: ``run(args, launch, tiles, num_sms)`` computes ``rubin.moe`` (ops/moe.py) for bf16 / fp16 / fp32
activations with weights in the activations' dtype, SiLU or GELU-tanh, no biases, ``T <= MAX_T`` tokens, within the
tolerances of the slot-mode kernels (the intermediate rounded to the activations' dtype, as they round it; the
output summed in float32); no host synchronisation (capturable in a CUDA graph); deterministic and bitwise the same
with PDL on and off and whatever order the GPU runs the programs in. ``problem`` names what it does not take;
moe.run then runs the slot-mode kernels.

Why this shape. At T = 1 a routed MoE is a few dozen MB of expert weights (Qwen3-30B-A3B: 75 MB, DeepSeek-V3 TP8:
88 MB) and almost no arithmetic, so a call is bound by HBM, and what it loses against the byte floor is time when
the memory system is not streaming: each kernel's ramp-up and tail, the FC1 -> FC2 boundary, and SMs without work
when a GEMM has fewer programs than SMs (Qwen3's FC1 at T = 1: 96 programs on 132 SMs; Nsight Compute, 2026-12-01:
FC1 at 2.8 TB/s, FC2 with its fused top-k sum at 2.0 TB/s). Here one launch of ``num_sms x occupancy`` programs
takes small work items from one queue until it is empty:

- FC1 items (slot ``s``, BN1 columns of I, one of ``fc1.split_k`` K ranges): the expert's BN1 gate rows and BN1 up
  rows against the token's hidden states. An unsplit item writes ``act(gate) * up``, rounded to the activations'
  dtype, into the ``[T k, I]`` intermediate, then makes one release increment of the token's counter. A split item
  writes float32 partials and takes a ticket; the last range of (slot, tile) to arrive adds the ranges in range
  order, then writes and counts.
- FC2 items (token ``t``, BN2 columns of H, one of ``fc2.split_k`` groups of the token's k slots): for the group's
  slots in slot order, the expert's BN2 rows of ``w2`` against that slot's intermediate row times its routing
  weight, all into one float32 accumulator. The last group of a (token, tile) to arrive adds the groups in group
  order and writes the output row once. No per-slot rows, no sum kernel, no float atomics. An FC2 item may first
  ask L2 for its weight tiles (``fc2.prefetch``; weights never depend on FC1), then waits (acquire loads of the
  token's counter) until all of its token's FC1 items are done. Only the first FC2 items taken, while the last FC1
  items finish, ever wait.

Items are taken in queue order through one integer atomic per item (the next one claimed while the current one
runs), FC1 items before FC2 items. That is what makes the wait safe: a program holding an FC2 item knows every FC1
item was already taken by a program that is running and never waits itself, so the FC1 items finish whatever the
GPU's scheduling, residency or occupancy (the argument of CUB's decoupled look-back, which takes its tile ids from a
counter for the same reason). Each item's K loop is Triton's cp.async software pipeline feeding ``tl.dot`` on
16-row tiles of which one row is the token's (the other rows are masked and move no bytes). Triton pipelines only
loads that feed a dot: a first form with GEMV loops (products summed per element in registers) kept one K step in
flight per program and streamed at 12 GB/s per SM (docs/kernels/triton_moe.md, "The fused decode path").

The queue's counters live in a per-device workspace of int32 (``workspace``, zeroed once, when first needed): the
claim counter, an exit counter, one counter per token and the K-split / slot-group tickets. The last program to
exit zeroes the counters and each ticket's last arriver zeroes its ticket, so the next call finds them zero. With
PDL a call waits (``gdc_wait``) before it touches them. Two consequences follow. Calls on one device must not run
this kernel concurrently on two streams; a split-N placement over locality domains would, so ``problem`` sends
such calls to the slot-mode kernels. And where ``passes/inline_kernels.py`` traces the launch into a graph, which
cannot own process state, the graph zeroes a workspace of its own for each call (one fill before the kernel).

Where it stands (H100, 2026-12-06): it ties the tuned two-kernel configs on DeepSeek-V3 TP8 at T = 1 and 2 and is
0.78-0.96x of them elsewhere, so no table selects it; the tuner tries it at T <= 8 in bf16.

PDL: every program waits before it reads the routing or the hidden states (the previous kernel's outputs; the expert
of an item is not known before, so no weight can be requested earlier), and lets the next kernel launch once the
queue is empty for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from rubin_compile.kernels.triton.activations import CODES as _ACT
from rubin_compile.kernels.triton.activations import gated
from rubin_compile.kernels.triton.launch import cdiv, launcher, tracing_into_graph
from rubin_compile.kernels.triton.pdl import INTERPRET, PREFETCH_CHUNK, gdc_launch_dependents, gdc_wait, has_gdc
from rubin_compile.kernels.triton.pdl import l2_prefetch_range
from rubin_compile.ops.moe import MoEArgs
from rubin_compile.ops.registry import Launch

MAX_T = 64  # tokens per call: one counter each in the workspace
# the workspace's int32 words: the claim counter, the exit counter, a counter per token, then a ticket per (slot, FC1
# tile) for K-split FC1 items and one per (token, FC2 tile) for FC2 items split into slot groups
WS_CLAIM, WS_EXIT, WS_TOKENS = 0, 1, 2
_MAX_T, _WS_CLAIM, _WS_EXIT, _WS_TOKENS = (tl.constexpr(v) for v in (MAX_T, WS_CLAIM, WS_EXIT, WS_TOKENS))
_CHUNK = tl.constexpr(PREFETCH_CHUNK)  # pdl.PREFETCH_CHUNK, as a constant the kernels can read
# The tiles the tuner tries (tune_moe.fused_candidates). FC1 items (BN1 gate and BN1 up rows, K step, pipeline stages,
# K ranges): 16 to 64 columns, and split over K where I / BN1 alone gives too few items for the SMs (DeepSeek-V3 TP8's
# I = 256); FC2 items (BN2 output columns, K step, stages, slot groups): the slots split into groups where H / BN2 alone
# gives too few (Qwen3-30B-A3B's H = 2048 at T = 1: 64 items of 32 columns); programs of 4 warps, two per SM
TUNE_FC1 = ((32, 128, 4, 1), (64, 128, 4, 1), (16, 128, 4, 2), (32, 128, 4, 4))
TUNE_FC2 = ((16, 256, 3, 1), (32, 128, 4, 1), (32, 128, 4, 2), (32, 128, 4, 4), (16, 256, 3, 4), (64, 128, 4, 8))
TUNE_GRIDS = ((4, 2),)  # (num_warps, occupancy): one program per SM lost every entry on the H100 (2026-12-06)


@dataclass(frozen=True)
class Tiles:
    """The fused path's tiles, from a ``MoEConfig`` of mode "fused": FC1 items of ``bn1`` gate (and as many up)
    columns over K steps of ``bk1`` in ``ns1`` pipeline stages, K split into ``split`` ranges (``fc1.split_k``); FC2
    items of ``bn2`` output columns over K steps of ``bk2`` in ``ns2`` stages, the token's k slots split into
    ``groups`` (``fc2.split_k``); ``num_warps`` per program, ``occupancy`` programs per SM; ``prefetch``: bytes of each
    of an FC2 item's slot tiles asked of L2 before it waits (0: none)."""

    bn1: int
    bk1: int
    ns1: int
    split: int
    bn2: int
    bk2: int
    ns2: int
    groups: int
    num_warps: int
    occupancy: int
    prefetch: int

    @staticmethod
    def of(config) -> "Tiles":
        f1, f2 = config.fc1, config.fc2
        return Tiles(
            bn1=f1.BN, bk1=f1.BK, ns1=f1.num_stages, split=f1.split_k, bn2=f2.BN, bk2=f2.BK, ns2=f2.num_stages,
            groups=f2.split_k, num_warps=f1.num_warps, occupancy=f1.occupancy, prefetch=f2.prefetch,
        )  # fmt: skip


def config_problem(config) -> Optional[str]:
    """Why a ``MoEConfig`` of mode "fused" is not one (None: it is); ``MoEConfig.problem`` calls it."""
    f1, f2 = config.fc1, config.fc2
    if f1.num_warps != f2.num_warps or f1.occupancy != f2.occupancy:
        return (
            "mode='fused' runs FC1 and FC2 in one kernel: fc1 and fc2 take the same num_warps and occupancy, not "
            f"{f1.num_warps} / {f2.num_warps} warps and occupancy {f1.occupancy} / {f2.occupancy}"
        )
    for name, g in (("fc1", f1), ("fc2", f2)):
        if g.BM != 16:
            return f"mode='fused': {name}.BM is 16 (the MMA's rows, one of them the token's), not {g.BM}"
        if g.swap or g.gemv or g.flatten or g.join or g.gluon or g.ws:
            return f"mode='fused': {name} takes none of swap, gemv, flatten, join, gluon, ws"
        for what, v in (("BN", g.BN), ("BK", g.BK)):
            if v < 16 or v & (v - 1):
                return f"mode='fused': {name}.{what}={v} must be a power of two >= 16 (tl.dot's smallest)"
    pf = f2.prefetch
    if pf and (pf % PREFETCH_CHUNK or (pf // PREFETCH_CHUNK) & (pf // PREFETCH_CHUNK - 1)):
        return f"mode='fused': fc2.prefetch={pf} bytes: 0 or {PREFETCH_CHUNK} times a power of two"
    if f1.prefetch:
        return "mode='fused': fc1.prefetch is not used (FC1's expert is known only after the wait); set it to 0"
    if config.a_fp8 or not config.fused_sum or config.w2_l2 or config.early_launch or config.chain:
        return "mode='fused' takes a_fp8=False, fused_sum=True and none of w2_l2, early_launch, chain"
    return None


def problem(args: MoEArgs, placed: bool = False) -> Optional[str]:
    """Why this path cannot run the call (None: it can); ``placed``: the call runs split-N over locality domains."""
    x = args.hidden_states
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"{x.dtype} activations (the fused decode kernel takes bf16 / fp16 / fp32)"
    if args.w13.dtype != x.dtype or args.w2.dtype != x.dtype:
        return f"weights in {args.w13.dtype} / {args.w2.dtype} (the fused decode kernel takes the activations' dtype)"
    if args.T > MAX_T:
        return f"T={args.T} tokens (the fused decode kernel takes up to {MAX_T})"
    if args.activation not in _ACT:
        return f"activation {args.activation} (the fused decode kernel has {', '.join(_ACT)})"
    if args.w13_bias is not None or args.w2_bias is not None:
        return "expert biases"
    if args.apply_router_weight_on_input or args.activation_constants is not None:
        return "the router weight on the input / runtime activation constants"
    if args.w13.stride(2) != 1 or args.w2.stride(2) != 1 or x.stride(1) != 1:
        return "weights or hidden states whose rows are not contiguous"
    if placed:
        return "a split-N placement over locality domains (its calls run on several streams at once)"
    return None


_WORKSPACES: dict[str, torch.Tensor] = {}


def workspace(dev: torch.device, tickets: int = 0) -> torch.Tensor:
    """The device's queue counters and at least ``tickets`` K-split tickets (zeroed when made, each call leaves them
    zero; made again, larger, when a call needs more)."""
    key = str(dev)
    words = WS_TOKENS + MAX_T + tickets
    ws = _WORKSPACES.get(key)
    if ws is None or ws.numel() < words:
        ws = _WORKSPACES[key] = torch.zeros(max(words, 1024), dtype=torch.int32, device=dev)
    return ws


@triton.jit
def _below(offs, k0, K, EVEN: tl.constexpr):
    """``offs + k0 < K``; with ``EVEN`` (K a multiple of the tile) a splat of ``k0 < K``, whose constancy keeps the
    masked loads vectorized."""
    if EVEN:
        return (tl.zeros_like(offs) + k0) < K
    return offs < K - k0


@triton.jit
def _fc1_item(
    x_ptr, w13_ptr, ids_ptr, inter_ptr, part_ptr, ws_ptr, item, H, I, K_TOP, NT1, SPLIT, KCH, stride_xt, stride_we,
    stride_wn, ACT: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr, NS1: tl.constexpr, EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """FC1 item ``item``: slot ``s``, gate / up columns [j BN1, (j + 1) BN1) of its expert, K range ``r`` of SPLIT."""
    per_slot = NT1 * SPLIT
    s = item // per_slot
    j = (item - s * per_slot) // SPLIT
    r = item - s * per_slot - j * SPLIT
    t = s // K_TOP
    e = tl.load(ids_ptr + s).to(tl.int64)
    row0 = tl.arange(0, 16) == 0  # the token's row of the MMA's 16 (the others are masked: no bytes move)
    offs_n = j * BN1 + tl.arange(0, BN1)
    offs_k = tl.arange(0, BK1)
    n_ok = _below(offs_n, 0, I, EVEN_N)
    k_lo = r * KCH
    k_end = tl.minimum(k_lo + KCH, H)
    x_ptrs = x_ptr + t * stride_xt + k_lo + (tl.zeros([16, 1], tl.int32) + offs_k[None, :])
    g_ptrs = w13_ptr + e * stride_we + offs_n[:, None] * stride_wn + k_lo + offs_k[None, :]
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros([16, BN1], tl.float32)
    acc_u = tl.zeros([16, BN1], tl.float32)
    for k0 in tl.range(0, k_end - k_lo, BK1, num_stages=NS1):  # Triton's cp.async pipeline, NS1 stages
        k_ok = _below(offs_k, k_lo + k0, H, EVEN_K)
        x = tl.load(x_ptrs + k0, mask=row0[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(g_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        wu = tl.load(u_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc_g = tl.dot(x, tl.trans(wg), acc_g, input_precision=DOT_PREC)
        acc_u = tl.dot(x, tl.trans(wu), acc_u, input_precision=DOT_PREC)
    out_mask = row0[:, None] & n_ok[None, :]
    cols = tl.zeros([16, 1], tl.int32) + offs_n[None, :]
    last = True
    if SPLIT > 1:
        # float32 partials of this K range; the last range of (slot, tile) to arrive sums them in range order
        p_ptrs = part_ptr + (s * SPLIT) * 2 * I + cols
        tl.store(p_ptrs + r * 2 * I, acc_g, mask=out_mask)
        tl.store(p_ptrs + r * 2 * I + I, acc_u, mask=out_mask)
        tl.debug_barrier()
        tick = ws_ptr + _WS_TOKENS + _MAX_T + s * NT1 + j
        last = tl.atomic_add(tick, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
        if last:
            acc_g = tl.zeros([16, BN1], tl.float32)
            acc_u = tl.zeros([16, BN1], tl.float32)
            for rr in range(0, SPLIT):
                acc_g += tl.load(p_ptrs + rr * 2 * I, mask=out_mask, other=0.0, cache_modifier=".cg")
                acc_u += tl.load(p_ptrs + rr * 2 * I + I, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(tick, 0)  # zero for the next call
    if last:
        h = gated(acc_g, ACT) * acc_u
        tl.store(inter_ptr + s * I + cols, h.to(inter_ptr.dtype.element_ty), mask=out_mask)
        # publish: every thread's stores, then one release increment of the token's counter
        tl.debug_barrier()
        tl.atomic_add(ws_ptr + _WS_TOKENS + t, 1, sem="release", scope="gpu")


@triton.jit
def _fc2_item(
    w2_ptr, ids_ptr, tw_ptr, inter_ptr, out_ptr, part2_ptr, ws_ptr, r, H, I, K_TOP, NT1, NT2, GROUPS, TICK2, stride_we,
    stride_wn, stride_ot, BN2: tl.constexpr, BK2: tl.constexpr, NS2: tl.constexpr, EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr, PREFETCH: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """FC2 item ``r``: token ``t``, output columns [m BN2, (m + 1) BN2), summed over the slots of group ``g`` of the
    token's k slots (GROUPS groups of cdiv(k, GROUPS) slots; with more than one, the last group of (token, tile) to
    arrive adds the groups' float32 sums in group order and writes the output)."""
    per_t = NT2 * GROUPS
    t = r // per_t
    tile = r - t * per_t  # (m, g) of token t
    m = tile // GROUPS
    g = tile - m * GROUPS
    spg = tl.cdiv(K_TOP, GROUPS)
    j_lo = g * spg
    j_n = tl.minimum(K_TOP - j_lo, spg)
    offs_n = m * BN2 + tl.arange(0, BN2)
    offs_k = tl.arange(0, BK2)
    n_ok = _below(offs_n, 0, H, EVEN_N)
    s0 = t * K_TOP + j_lo
    if PREFETCH > 0:  # the weights never depend on FC1: ask L2 for this item's tiles before waiting
        nbytes = tl.minimum(H - m * BN2, BN2) * I * (w2_ptr.dtype.element_ty.primitive_bitwidth // 8)
        nbytes = tl.minimum(nbytes, PREFETCH)
        for jj in range(0, j_n):
            e = tl.load(ids_ptr + s0 + jj).to(tl.int64)
            l2_prefetch_range(w2_ptr + e * stride_we + m * BN2 * stride_wn, nbytes, _CHUNK, PREFETCH // _CHUNK)
    # wait until every FC1 item of this token is done (acquire: their intermediate stores are visible after it)
    target = K_TOP * NT1
    done = tl.atomic_add(ws_ptr + _WS_TOKENS + t, 0, sem="acquire", scope="gpu")
    while done < target:
        done = tl.atomic_add(ws_ptr + _WS_TOKENS + t, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
    row0 = tl.arange(0, 16) == 0
    cols = tl.zeros([16, 1], tl.int32) + offs_k[None, :]
    w_rows = offs_n[:, None] * stride_wn + offs_k[None, :]
    nk = tl.cdiv(I, BK2)
    acc = tl.zeros([16, BN2], tl.float32)
    # the group's slots' K steps as one pipelined loop (the next slot's first tiles load during this one's last)
    for step in tl.range(0, j_n * nk, num_stages=NS2):
        jj = step // nk
        k0 = (step - jj * nk) * BK2
        s = s0 + jj
        e = tl.load(ids_ptr + s).to(tl.int64)
        wt = tl.load(tw_ptr + s).to(tl.float32)
        k_ok = _below(offs_k, k0, I, EVEN_K)
        a = tl.load(inter_ptr + s * I + k0 + cols, mask=row0[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w2_ptr + e * stride_we + k0 + w_rows, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(w), input_precision=DOT_PREC) * wt
    out_cols = tl.zeros([16, 1], tl.int32) + offs_n[None, :]
    out_mask = row0[:, None] & n_ok[None, :]
    last = True
    if GROUPS > 1:
        p_ptrs = part2_ptr + ((t * NT2 + m) * GROUPS) * BN2 + (tl.zeros([16, 1], tl.int32) + tl.arange(0, BN2)[None, :])
        tl.store(p_ptrs + g * BN2, acc, mask=out_mask)
        tl.debug_barrier()
        tick = ws_ptr + TICK2 + t * NT2 + m
        last = tl.atomic_add(tick, 1, sem="acq_rel", scope="gpu") == GROUPS - 1
        if last:
            acc = tl.zeros([16, BN2], tl.float32)
            for gg in range(0, GROUPS):  # in group order: deterministic
                acc += tl.load(p_ptrs + gg * BN2, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(tick, 0)  # zero for the next call
    if last:
        tl.store(out_ptr + t * stride_ot + out_cols, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["T", "K_TOP", "NT1", "NT2", "N1", "N_ALL", "SPLIT", "GROUPS", "TICK2"])
def _moe_decode_kernel(
    x_ptr, w13_ptr, w2_ptr, ids_ptr, tw_ptr, inter_ptr, part_ptr, part2_ptr, out_ptr, ws_ptr,
    T, H, I, K_TOP, NT1, NT2, N1, N_ALL, SPLIT, KCH, GROUPS, TICK2,
    stride_xt, stride_w13e, stride_w13n, stride_w2e, stride_w2n, stride_ot,
    ACT: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr, NS1: tl.constexpr, BN2: tl.constexpr,
    BK2: tl.constexpr, NS2: tl.constexpr, EVEN_N1: tl.constexpr, EVEN_K1: tl.constexpr, EVEN_N2: tl.constexpr,
    EVEN_K2: tl.constexpr, PREFETCH: tl.constexpr, DOT_PREC: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """The queue walk (module docstring): items [0, N1) are FC1's, [N1, N_ALL) FC2's."""
    if GDC:
        gdc_wait()  # the routing and hidden states are the previous kernel's; so is the workspace's reset
    item = tl.atomic_add(ws_ptr + _WS_CLAIM, 1, sem="relaxed", scope="gpu")
    while item < N_ALL:
        nxt = tl.atomic_add(ws_ptr + _WS_CLAIM, 1, sem="relaxed", scope="gpu")  # claimed now, its latency hidden
        if item < N1:
            _fc1_item(
                x_ptr, w13_ptr, ids_ptr, inter_ptr, part_ptr, ws_ptr, item, H, I, K_TOP, NT1, SPLIT, KCH, stride_xt,
                stride_w13e, stride_w13n, ACT, BN1, BK1, NS1, EVEN_N1, EVEN_K1, DOT_PREC,
            )  # fmt: skip
        else:
            _fc2_item(
                w2_ptr, ids_ptr, tw_ptr, inter_ptr, out_ptr, part2_ptr, ws_ptr, item - N1, H, I, K_TOP, NT1, NT2,
                GROUPS, TICK2, stride_w2e, stride_w2n, stride_ot, BN2, BK2, NS2, EVEN_N2, EVEN_K2, PREFETCH, DOT_PREC,
            )  # fmt: skip
        item = nxt
    if GDC:
        gdc_launch_dependents()  # the queue is empty for this program
    # the last program out leaves the counters zero for the next call (every other program has taken its last claim)
    tl.debug_barrier()
    left = tl.atomic_add(ws_ptr + _WS_EXIT, 1, sem="acq_rel", scope="gpu")
    if left == tl.num_programs(0) - 1:
        tl.store(ws_ptr + _WS_CLAIM, 0)
        tl.store(ws_ptr + _WS_EXIT, 0)
        offs = tl.arange(0, _MAX_T)
        tl.store(ws_ptr + _WS_TOKENS + offs, tl.zeros([_MAX_T], tl.int32), mask=offs < T)


def run(args: MoEArgs, launch: Launch, tiles: Tiles, num_sms: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``rubin.moe`` through the fused decode kernel (module docstring). ``num_sms`` times ``tiles.occupancy`` is
    the grid's size at most; ``out`` ([T, H], contiguous rows) receives the result."""
    why = problem(args)
    if why is not None:
        raise NotImplementedError(f"rubin.moe[triton, fused]: {why}")
    x = args.hidden_states
    T, H, I, k = args.T, args.H, args.I, args.k
    dev, dtype = x.device, x.dtype
    out = torch.empty((T, H), dtype=dtype, device=dev) if out is None else out
    S = T * k
    if S == 0:
        return out.zero_()
    ids, tw = args.flat_routing()
    inter = torch.empty((S, I), dtype=dtype, device=dev)
    # K ranges of whole BK1 steps, none empty
    kch = cdiv(cdiv(H, max(1, tiles.split)), tiles.bk1) * tiles.bk1
    split = cdiv(H, kch)
    part = torch.empty((S, split, 2 * I) if split > 1 else (1,), dtype=torch.float32, device=dev)
    nt1, nt2 = cdiv(I, tiles.bn1), cdiv(H, tiles.bn2)
    groups = cdiv(k, cdiv(k, max(1, tiles.groups)))  # FC2's slot groups, none empty
    part2 = torch.empty((T * nt2 * groups, tiles.bn2) if groups > 1 else (1,), dtype=torch.float32, device=dev)
    n1 = S * nt1 * split
    n_all = n1 + T * nt2 * groups
    tick2 = WS_TOKENS + MAX_T + S * nt1  # the FC2 tickets after FC1's
    grid = max(1, min(num_sms * tiles.occupancy, n_all))
    gdc = has_gdc()
    w13, w2 = args.w13, args.w2
    tickets = S * nt1 + T * nt2
    if tracing_into_graph():  # traced into a graph (inline_kernels): a zeroed workspace of its own per call
        ws = torch.zeros(WS_TOKENS + MAX_T + tickets, dtype=torch.int32, device=dev)
    else:
        ws = workspace(dev, tickets)
    launcher(_moe_decode_kernel)[(grid,)](
        x, w13, w2, ids, tw, inter, part, part2, out, ws,
        T, H, I, k, nt1, nt2, n1, n_all, split, kch, groups, tick2,
        x.stride(0), w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1), out.stride(0),
        ACT=_ACT[args.activation], BN1=tiles.bn1, BK1=tiles.bk1, NS1=tiles.ns1, BN2=tiles.bn2, BK2=tiles.bk2,
        NS2=tiles.ns2, EVEN_N1=I % tiles.bn1 == 0, EVEN_K1=H % tiles.bk1 == 0, EVEN_N2=H % tiles.bn2 == 0,
        EVEN_K2=I % tiles.bk2 == 0, PREFETCH=0 if INTERPRET else tiles.prefetch,
        DOT_PREC="ieee" if dtype == torch.float32 else "tf32", GDC=gdc,
        num_warps=tiles.num_warps, num_stages=max(tiles.ns1, tiles.ns2),
        **({"launch_pdl": True} if gdc and launch.pdl else {}),
    )  # fmt: skip
    return out
