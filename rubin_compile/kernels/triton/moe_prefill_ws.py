"""The persistent MoE path's two FP8 (W8A8) GEMMs as warp-specialized Gluon kernels (``GemmConfig.ws``): 128-row M
tiles whose two 64-row halves are two consumer warpgroups multiplying the same weight tile, and one producer warp
that issues every TMA load.

Why. A grouped GEMM's operands come to the SMs from L2 (the hidden states and the experts' tiles are read by many
programs), so the bytes a K step moves per FLOP are set by the tile: an M x N tile moves (M + N) x K bytes in e4m3
for 2 M N K FLOPs. The Triton W8A8 tiles that win the tuning on sm_90 are 64 rows (``moe_prefill_gluon.py`` says why
FP8 products must be waited for and scaled each K step: 64 x 128 fp32 products fit two programs per SM, which hide
each other's waits): (64 + 128) bytes a row of K for 2 x 64 x 128 FLOPs, 85 FLOPs a byte -- the same as the bf16
128 x 256 tiles (twice the bytes per element), which is why FP8 ran no faster than bf16 on the H100 (786 against
793 us, Qwen3-30B-A3B at T = 4096; benchmarks/results/moe-h100-2026-12-05-s9/). A 128 x 128 tile is 128 FLOPs a
byte. With one program per SM it needs its two warpgroups to hide each other's scaling, which the 8-warp kernels
of moe_prefill_gluon.py do not do: a CTA barrier before every stage refill keeps them in lockstep. Here nothing
joins the two warpgroups: each waits only for its own MMAs and arrives on the stage's ``empty`` mbarrier (count 2)
when it no longer reads it, and the producer warp refills a stage once both have. Each warpgroup still keeps its
next K step's MMA in flight while it scales the last (``UNROLL`` steps an iteration, as in moe_prefill_gluon.py).

- ``_fc2_ws_kernel``: the intermediate [P_MAX, I] (e4m3, rows in tile order) and ``w2`` seen as [E * H, I] through
  host-side TMA descriptors (a [128, BK] box, each warpgroup's MMA reading its half); rows scattered to their slots of
  ``y`` [T k, H] as ``moe_prefill_gluon._fc2_w8a8_kernel`` does.
- ``_fc1_ws_kernel``: the rows read through TMA as well: the activations are quantised into the sorted rows' order
  after the alignment, by ``fp8.gather_quantise_rows`` ([P_MAX, H] e4m3 with one scale per (row, K tile): the same
  numbers ``fp8.quantise_rows`` gives each row's token; padding rows unwritten, their outputs never stored), so FC1
  needs no gather of its own
  (the 8-warp Gluon FC1 gathers with cp.async and a CTA barrier per K step). The gate and up tiles of ``w13`` are two
  TMA boxes into the halves of a [2 BN, BK] buffer, one MMA of 2 BN columns; the epilogue is
  ``moe_prefill_gluon._store_fc1``'s, each warpgroup through its own shared scratch.

Measured (H100, FP8 block, T = 4096; benchmarks/results/moe-h100-2026-12-06/): correct, and slower than the 64-row
Triton tiles at two programs per SM (Qwen3-30B-A3B FC1 478 against 368 us, FC2 345 against 332; DeepSeek-V3 TP8
FC1 628 against 460, FC2 580 against 684): the Triton tiles turned out not to be bound by L2 (Nsight Compute: 51-62%
of its peak, tensor pipes 18-34% busy) but by the latency of each K step's wait, which two programs per SM cover
better than two warpgroups here; ``mbarrier.arrive`` adds a warpgroup barrier every K step. They stay tuner candidates,
chosen only where measured faster.

Registers: the kernel runs 4 (the first consumer) + 4 + 1 warps; the second consumer gets ``WS_REGS`` registers a
thread and the producer 24 (``setmaxnreg``), within the SM's 64 K. Scope (``problem``): as the Gluon kernels', with
BM = 128 at 4 warps (a consumer warpgroup's). Gluon has no interpreter: the CPU tests compile both kernels for sm_90
(tests/cpu/kernels/test_triton_moe_prefill_ws.py); the GPU tests check their values.
"""

from __future__ import annotations

from typing import Optional

from rubin_compile.kernels.triton import moe_prefill_gluon as _g

WS_BM = 128  # rows per M tile: two consumer warpgroups of 64
WS_WARPS = 4  # the kernel's num_warps: the first consumer warpgroup (the default partition)
WS_REGS = 232  # registers a thread of the second consumer warpgroup (the first gets the kernel's maxnreg)

if _g.GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from rubin_compile.kernels.triton.moe_prefill_gluon import _item, _scales, _store, _store_fc1, _tma_load

    _WS_REGS = gl.constexpr(WS_REGS)  # what the kernels read (a jitted function reads constexpr globals only)


def problem(
    BM: int,
    BN: int,
    BK: int,
    num_warps: int,
    num_stages: int,
    w_scale: int,
    scalar_sw: bool,
    a_fp8: bool,
    fc1: bool = False,
) -> Optional[str]:
    """Why the warp-specialized FC2 (``fc1``: FC1) cannot run these tiles (None: it can)."""
    name = "FC1" if fc1 else "FC2"
    if BM != WS_BM or num_warps != WS_WARPS:
        return f"BM={BM} at {num_warps} warps: the warp-specialized {name} takes BM = {WS_BM} at {WS_WARPS} warps"
    # the rest as the Gluon kernels' (64 rows a warpgroup, the same register tiles)
    return _g.problem(64, BN, BK, 4, num_stages, w_scale, scalar_sw, a_fp8, fc1=fc1)


if _g.GLUON:

    @gluon.jit
    def _ws_steps(ntiles_ptr, N, K, BN: gl.constexpr, BK: gl.constexpr):
        """(M tiles, N tiles, K steps, this program's flat steps) of a GEMM over N x K weights."""
        num_m = gl.load(ntiles_ptr)
        num_n = gl.cdiv(N, BN)
        num_k = gl.cdiv(K, BK)
        items = gl.maximum(num_m * num_n - gl.program_id(0) + gl.num_programs(0) - 1, 0) // gl.num_programs(0)
        return num_m, num_n, num_k, items * num_k

    @gluon.jit
    def _ws_load(
        a_desc,
        w_desc,
        a_s,
        w_s,
        ready,
        empty,
        tile_expert_ptr,
        ntiles_ptr,
        N,
        K,
        W_ROWS,
        UP,
        BM: gl.constexpr,
        BN: gl.constexpr,
        BK: gl.constexpr,
        GROUP: gl.constexpr,
        NUM_STAGES: gl.constexpr,
        JOINED: gl.constexpr,
    ):
        """The producer warp: every flat step's A box ([BM, BK] rows of the M tile) and weight tile(s) into its
        stage, once both consumers have released the stage's previous step. The weights are seen as [E * W_ROWS, K];
        ``JOINED`` (FC1): the gate tile and the up tile (UP rows further) into the two halves of the stage."""
        num_m, num_n, num_k, total = _ws_steps(ntiles_ptr, N, K, BN, BK)
        e = gl.to_tensor(0)
        for g in range(total):
            s = g % NUM_STAGES
            m, n, kk = _item(g, num_k, num_m, num_n, GROUP)
            if kk == 0:  # an item's expert, loaded once per item (a load's latency on every step would pace the loads)
                e = gl.load(tile_expert_ptr + m)
            # a stage's first use passes at once: a fresh mbarrier counts its phase before the first as completed
            mbarrier.wait(empty.index(s), ((g // NUM_STAGES) & 1) ^ 1)
            bar = ready.index(s)
            wrow = e * W_ROWS + n * BN
            if JOINED:
                mbarrier.expect(bar, BM * BK + 2 * BN * BK)
                _tma_load(a_desc, [m * BM, kk * BK], bar, a_s.index(s))
                _tma_load(w_desc, [wrow, kk * BK], bar, w_s.index(s).slice(0, BN))
                _tma_load(w_desc, [wrow + UP, kk * BK], bar, w_s.index(s).slice(BN, BN))
            else:
                mbarrier.expect(bar, BM * BK + BN * BK)
                _tma_load(a_desc, [m * BM, kk * BK], bar, a_s.index(s))
                _tma_load(w_desc, [wrow, kk * BK], bar, w_s.index(s))

    @gluon.jit
    def _ws_scales_fc1(
        xs_ptr,
        ws_ptr,
        tile_expert_ptr,
        g,
        num_k,
        num_m,
        num_n,
        I,
        stride_xsp,
        stride_se,
        stride_sn,
        stride_sk,
        SBN,
        SBK,
        BM: gl.constexpr,
        BN: gl.constexpr,
        BK: gl.constexpr,
        GROUP: gl.constexpr,
        W_SCALE: gl.constexpr,
        row_layout: gl.constexpr,
        TILE_M: gl.constexpr,
        ROW0: gl.constexpr,
    ):
        """Step ``g``'s row scales of its gate and up products ([BM] each, the rows ROW0.. of the M tile): the
        sorted row's activation scale of the K tile, times (128 x 128 block scales) the gate tile's one weight scale,
        and the up tile's."""
        m, n, kk = _item(g, num_k, num_m, num_n, GROUP)
        rows = (m * TILE_M + ROW0 + gl.arange(0, BM, layout=row_layout)).to(gl.int64)
        sa = gl.load(xs_ptr + rows * stride_xsp + kk)
        if W_SCALE == 2:
            e = gl.load(tile_expert_ptr + m)
            sk = e * stride_se + (kk * BK // SBK) * stride_sk
            sg = sa * gl.load(ws_ptr + sk + (n * BN // SBN) * stride_sn)
            su = sa * gl.load(ws_ptr + sk + ((I + n * BN) // SBN) * stride_sn)
            return sg, su
        return sa, sa

    @gluon.jit
    def _fc2_ws_mma(
        a_s,
        w_s,
        ready,
        empty,
        isc_ptr,
        ws_ptr,
        b_ptr,
        sorted_ptr,
        tile_expert_ptr,
        ntiles_ptr,
        y_ptr,
        H,
        I,
        stride_ist,
        stride_se,
        stride_sn,
        stride_sk,
        SBN,
        SBK,
        stride_be,
        HAS_BIAS: gl.constexpr,
        W_SCALE: gl.constexpr,
        BM: gl.constexpr,
        BN: gl.constexpr,
        BK: gl.constexpr,
        GROUP: gl.constexpr,
        NUM_STAGES: gl.constexpr,
        UNROLL: gl.constexpr,
        HALF: gl.constexpr,
    ):
        """A consumer warpgroup of the FC2: rows HALF x 64.. of every M tile, each K step's MMA issued before the
        previous step's product is waited for and scaled; a stage released (``empty``) once this warpgroup's MMA
        of it is done."""
        HM: gl.constexpr = BM // 2
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32]
        )
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        TN: gl.constexpr = BN // 8 if BN // 8 < 32 else 32
        out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TN, TN], [4, 1], [1, 0])
        num_m, num_n, num_k, total = _ws_steps(ntiles_ptr, H, I, BN, BK)
        zero = gl.zeros([HM, BN], gl.float32, layout=mma_layout)
        acc = zero
        for g0 in range(0, total, UNROLL):
            st = g0 % NUM_STAGES
            mbarrier.wait(ready.index(st), (g0 // NUM_STAGES) & 1)
            a_half = a_s.index(st).slice(HALF * HM, HM)
            prev = warpgroup_mma(a_half, w_s.index(st).permute((1, 0)), zero, use_acc=False, is_async=True)
            s_prev = _scales(
                isc_ptr,
                ws_ptr,
                tile_expert_ptr,
                g0,
                num_k,
                num_m,
                num_n,
                stride_ist,
                stride_se,
                stride_sn,
                stride_sk,
                SBN,
                SBK,
                HM,
                BN,
                BK,
                GROUP,
                W_SCALE,
                row_layout,
                BM,
                HALF * HM,
            )
            for u in gl.static_range(UNROLL):
                g = g0 + u  # the step whose product is finished in this round
                if u + 1 < UNROLL:  # issue step g + 1, then wait for step g's product alone
                    nxt = g + 1
                    sn = nxt % NUM_STAGES
                    # past ``total`` (the last iteration) nothing fills the stage: the MMA reads a stale one, whose
                    # product is dropped
                    mbarrier.wait(ready.index(sn), (nxt // NUM_STAGES) & 1, pred=nxt < total)
                    cur = warpgroup_mma(
                        a_s.index(sn).slice(HALF * HM, HM),
                        w_s.index(sn).permute((1, 0)),
                        zero,
                        use_acc=False,
                        is_async=True,
                    )
                    s_cur = _scales(
                        isc_ptr,
                        ws_ptr,
                        tile_expert_ptr,
                        gl.minimum(nxt, total - 1),
                        num_k,
                        num_m,
                        num_n,
                        stride_ist,
                        stride_se,
                        stride_sn,
                        stride_sk,
                        SBN,
                        SBK,
                        HM,
                        BN,
                        BK,
                        GROUP,
                        W_SCALE,
                        row_layout,
                        BM,
                        HALF * HM,
                    )
                    done = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))
                else:
                    done = warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
                mbarrier.arrive(empty.index(g % NUM_STAGES), count=1, pred=g < total)
                if g < total:
                    acc = acc + done * gl.expand_dims(s_prev, 1)
                if (g < total) & (g % num_k == num_k - 1):  # step g ended its item
                    _store(
                        acc,
                        y_ptr,
                        ws_ptr,
                        b_ptr,
                        sorted_ptr,
                        tile_expert_ptr,
                        g,
                        num_k,
                        num_m,
                        num_n,
                        H,
                        stride_se,
                        stride_be,
                        HM,
                        BN,
                        GROUP,
                        W_SCALE,
                        HAS_BIAS,
                        out_layout,
                        BM,
                        HALF * HM,
                    )
                    acc = zero
                if u + 1 < UNROLL:
                    prev = cur
                    s_prev = s_cur

    @gluon.jit
    def _fc2_ws_kernel(
        a_desc,
        w_desc,
        isc_ptr,
        ws_ptr,
        b_ptr,
        sorted_ptr,
        tile_expert_ptr,
        ntiles_ptr,
        y_ptr,
        H,
        I,
        stride_ist,
        stride_se,
        stride_sn,
        stride_sk,
        SBN,
        SBK,
        stride_be,
        HAS_BIAS: gl.constexpr,
        W_SCALE: gl.constexpr,
        BM: gl.constexpr,
        BN: gl.constexpr,
        BK: gl.constexpr,
        GROUP: gl.constexpr,
        NUM_STAGES: gl.constexpr,
        GDC: gl.constexpr,
        UNROLL: gl.constexpr,
    ):
        """y[slot, n] = sum over K tiles of (inter[p] . w2[e, n]) * scale(p, K tile) (+ b), for every real row p."""
        a_s = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BM, BK], a_desc.layout)
        w_s = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, BN, BK], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumer warpgroups release a stage
        if GDC:  # the partitions start after this (the workers wait while the first warps run the code before)
            gdc_wait()  # the intermediate, its scales and the tile table are earlier kernels'
            gdc_launch_dependents()
        # each partition's arguments spelled out: a tuple kept in a variable turns its constexprs into tensors, and one
        # joined to the constexprs fails on the bools (Triton 3.6 and 3.9)
        gl.warp_specialize(
            [
                (
                    _fc2_ws_mma,
                    (
                        a_s,
                        w_s,
                        ready,
                        empty,
                        isc_ptr,
                        ws_ptr,
                        b_ptr,
                        sorted_ptr,
                        tile_expert_ptr,
                        ntiles_ptr,
                        y_ptr,
                        H,
                        I,
                        stride_ist,
                        stride_se,
                        stride_sn,
                        stride_sk,
                        SBN,
                        SBK,
                        stride_be,
                        HAS_BIAS,
                        W_SCALE,
                        BM,
                        BN,
                        BK,
                        GROUP,
                        NUM_STAGES,
                        UNROLL,
                        0,
                    ),
                ),
                (
                    _fc2_ws_mma,
                    (
                        a_s,
                        w_s,
                        ready,
                        empty,
                        isc_ptr,
                        ws_ptr,
                        b_ptr,
                        sorted_ptr,
                        tile_expert_ptr,
                        ntiles_ptr,
                        y_ptr,
                        H,
                        I,
                        stride_ist,
                        stride_se,
                        stride_sn,
                        stride_sk,
                        SBN,
                        SBK,
                        stride_be,
                        HAS_BIAS,
                        W_SCALE,
                        BM,
                        BN,
                        BK,
                        GROUP,
                        NUM_STAGES,
                        UNROLL,
                        1,
                    ),
                ),
                (
                    _ws_load,
                    (
                        a_desc,
                        w_desc,
                        a_s,
                        w_s,
                        ready,
                        empty,
                        tile_expert_ptr,
                        ntiles_ptr,
                        H,
                        I,
                        H,
                        0,
                        BM,
                        BN,
                        BK,
                        GROUP,
                        NUM_STAGES,
                        False,
                    ),
                ),
            ],
            [4, 1],
            [_WS_REGS, 24],
        )

    @gluon.jit
    def _fc1_ws_mma(
        a_s,
        w_s,
        ready,
        empty,
        scratch,
        xs_ptr,
        ws_ptr,
        b_ptr,
        tile_expert_ptr,
        ntiles_ptr,
        inter_ptr,
        isc_ptr,
        H,
        I,
        stride_xsp,
        stride_se,
        stride_sn,
        stride_sk,
        SBN,
        SBK,
        stride_be,
        stride_ist,
        ACT: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        W_SCALE: gl.constexpr,
        BM: gl.constexpr,
        BN: gl.constexpr,
        BK: gl.constexpr,
        GROUP: gl.constexpr,
        NUM_STAGES: gl.constexpr,
        UNROLL: gl.constexpr,
        HALF: gl.constexpr,
    ):
        """A consumer warpgroup of the FC1: rows HALF x 64.. of every M tile, [64, 2 BN] products (gate, then up),
        pipelined and released as in ``_fc2_ws_mma``; its items' epilogue through its own half of ``scratch``."""
        HM: gl.constexpr = BM // 2
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 2 * BN, 32]
        )
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        TN: gl.constexpr = BN // 4 if BN // 4 < 32 else 32
        out_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TN, TN], [4, 1], [1, 0])
        num_m, num_n, num_k, total = _ws_steps(ntiles_ptr, I, H, BN, BK)
        zero = gl.zeros([HM, 2 * BN], gl.float32, layout=mma_layout)
        acc = zero
        # the product's columns: gate, then up (each half scaled by its own row scales)
        up = gl.expand_dims(gl.arange(0, 2 * BN, layout=gl.SliceLayout(0, mma_layout)) >= BN, 0)
        my_scratch = scratch.index(HALF)
        for g0 in range(0, total, UNROLL):
            st = g0 % NUM_STAGES
            mbarrier.wait(ready.index(st), (g0 // NUM_STAGES) & 1)
            prev = warpgroup_mma(
                a_s.index(st).slice(HALF * HM, HM), w_s.index(st).permute((1, 0)), zero, use_acc=False, is_async=True
            )
            sg, su = _ws_scales_fc1(
                xs_ptr,
                ws_ptr,
                tile_expert_ptr,
                g0,
                num_k,
                num_m,
                num_n,
                I,
                stride_xsp,
                stride_se,
                stride_sn,
                stride_sk,
                SBN,
                SBK,
                HM,
                BN,
                BK,
                GROUP,
                W_SCALE,
                row_layout,
                BM,
                HALF * HM,
            )
            for u in gl.static_range(UNROLL):
                g = g0 + u  # the step whose product is finished in this round
                if u + 1 < UNROLL:  # issue step g + 1, then wait for step g's product alone
                    nxt = g + 1
                    sn = nxt % NUM_STAGES
                    mbarrier.wait(ready.index(sn), (nxt // NUM_STAGES) & 1, pred=nxt < total)
                    cur = warpgroup_mma(
                        a_s.index(sn).slice(HALF * HM, HM),
                        w_s.index(sn).permute((1, 0)),
                        zero,
                        use_acc=False,
                        is_async=True,
                    )
                    sg_cur, su_cur = _ws_scales_fc1(
                        xs_ptr,
                        ws_ptr,
                        tile_expert_ptr,
                        gl.minimum(nxt, total - 1),
                        num_k,
                        num_m,
                        num_n,
                        I,
                        stride_xsp,
                        stride_se,
                        stride_sn,
                        stride_sk,
                        SBN,
                        SBK,
                        HM,
                        BN,
                        BK,
                        GROUP,
                        W_SCALE,
                        row_layout,
                        BM,
                        HALF * HM,
                    )
                    done = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))
                else:
                    done = warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
                mbarrier.arrive(empty.index(g % NUM_STAGES), count=1, pred=g < total)
                if g < total:
                    acc = acc + done * gl.where(up, gl.expand_dims(su, 1), gl.expand_dims(sg, 1))
                if (g < total) & (g % num_k == num_k - 1):  # step g ended its item
                    _store_fc1(
                        acc,
                        my_scratch,
                        inter_ptr,
                        isc_ptr,
                        ws_ptr,
                        b_ptr,
                        tile_expert_ptr,
                        g,
                        num_k,
                        num_m,
                        num_n,
                        I,
                        stride_se,
                        stride_be,
                        stride_ist,
                        ACT,
                        HM,
                        BN,
                        GROUP,
                        W_SCALE,
                        HAS_BIAS,
                        out_layout,
                        BM,
                        HALF * HM,
                    )
                    acc = zero
                if u + 1 < UNROLL:
                    prev = cur
                    sg = sg_cur
                    su = su_cur

    @gluon.jit
    def _fc1_ws_kernel(
        a_desc,
        w_desc,
        xs_ptr,
        ws_ptr,
        b_ptr,
        tile_expert_ptr,
        ntiles_ptr,
        inter_ptr,
        isc_ptr,
        H,
        I,
        stride_xsp,
        stride_se,
        stride_sn,
        stride_sk,
        SBN,
        SBK,
        stride_be,
        stride_ist,
        ACT: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        W_SCALE: gl.constexpr,
        BM: gl.constexpr,
        BN: gl.constexpr,
        BK: gl.constexpr,
        GROUP: gl.constexpr,
        NUM_STAGES: gl.constexpr,
        GDC: gl.constexpr,
        UNROLL: gl.constexpr,
    ):
        """inter[p, n] = act(xq[p] . w13[e, n] + b) * (xq[p] . w13[e, I + n] + b), in e4m3 with one scale per row and
        N tile, for every row p of every tile (``xq``: the rows quantised in tile order, ``a_desc``)."""
        a_s = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BM, BK], a_desc.layout)
        w_s = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, 2 * BN, BK], w_desc.layout)
        scratch = gl.allocate_shared_memory(
            gl.float32, [2, BM // 2, 2 * BN], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        )
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumer warpgroups release a stage
        if GDC:  # the partitions start after this (the workers wait while the first warps run the code before)
            gdc_wait()  # the quantised rows, their scales and the tile table are earlier kernels'
            gdc_launch_dependents()
        # w13 seen as [E * 2 I, H]: the gate tile at e * 2 I + n * BN, its up tile I rows further (the partitions'
        # arguments spelled out, as in _fc2_ws_kernel)
        gl.warp_specialize(
            [
                (
                    _fc1_ws_mma,
                    (
                        a_s,
                        w_s,
                        ready,
                        empty,
                        scratch,
                        xs_ptr,
                        ws_ptr,
                        b_ptr,
                        tile_expert_ptr,
                        ntiles_ptr,
                        inter_ptr,
                        isc_ptr,
                        H,
                        I,
                        stride_xsp,
                        stride_se,
                        stride_sn,
                        stride_sk,
                        SBN,
                        SBK,
                        stride_be,
                        stride_ist,
                        ACT,
                        HAS_BIAS,
                        W_SCALE,
                        BM,
                        BN,
                        BK,
                        GROUP,
                        NUM_STAGES,
                        UNROLL,
                        0,
                    ),
                ),
                (
                    _fc1_ws_mma,
                    (
                        a_s,
                        w_s,
                        ready,
                        empty,
                        scratch,
                        xs_ptr,
                        ws_ptr,
                        b_ptr,
                        tile_expert_ptr,
                        ntiles_ptr,
                        inter_ptr,
                        isc_ptr,
                        H,
                        I,
                        stride_xsp,
                        stride_se,
                        stride_sn,
                        stride_sk,
                        SBN,
                        SBK,
                        stride_be,
                        stride_ist,
                        ACT,
                        HAS_BIAS,
                        W_SCALE,
                        BM,
                        BN,
                        BK,
                        GROUP,
                        NUM_STAGES,
                        UNROLL,
                        1,
                    ),
                ),
                (
                    _ws_load,
                    (
                        a_desc,
                        w_desc,
                        a_s,
                        w_s,
                        ready,
                        empty,
                        tile_expert_ptr,
                        ntiles_ptr,
                        I,
                        H,
                        2 * I,
                        I,
                        BM,
                        BN,
                        BK,
                        GROUP,
                        NUM_STAGES,
                        True,
                    ),
                ),
            ],
            [4, 1],
            [_WS_REGS, 24],
        )


def fc1_descriptors(xq, w13, E: int, H: int, I: int, BM: int, BN: int, BK: int):
    """Host-side TMA descriptors of the rows quantised in tile order ``xq`` [P_MAX, H] (box [BM, BK]) and of ``w13``
    seen as [E * 2 I, H] (box [BN, BK]: a gate or an up tile)."""
    a_layout = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.float8e4nv)
    a = TensorDescriptor(xq, list(xq.shape), [H, 1], [BM, BK], a_layout)
    return a, _g.fc1_descriptor(w13, E, H, I, BN, BK)
