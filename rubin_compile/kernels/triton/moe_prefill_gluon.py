"""The persistent MoE path's two GEMMs in FP8 (W8A8) as Gluon kernels: each K step's e4m3 product stays in flight
while the previous step's product is scaled (``GemmConfig.gluon``, FC1's and FC2's).

Why Gluon. A W8A8 K step with 128 x 128 block scales computes ``acc += (a . w^T) * s``, ``s`` the rows' activation
scales of that K tile times its weight block's scale: the product must be finished before it is scaled, and Triton's
own pipeliner keeps a wgmma asynchronous only while its result feeds nothing but later wgmmas (WGMMAPipeline.cpp;
``benchmarks/sm90_wgmma_waits.py`` shows the ``wgmma.wait_group 0`` it emits), so every Triton K step waits for its
MMA and the tensor cores idle while it scales. Gluon (``triton.experimental.gluon``, Triton >= 3.5) exposes the
asynchronous wgmma and its wait: here step k + 1's MMA is issued into a second register tile before the wait for
step k (``warpgroup_mma_wait(num_outstanding=1)``), so the scaling of one step, the refill of its stage and an item's
epilogue run while the next step's MMA does. That costs a third float32 register tile (accumulator + two products):
64 x 128 per warpgroup at most (FC2: BN <= 128; FC1, whose one MMA covers the gate and up tiles: BN <= 64).

The loop must not carry an MMA in flight across its back-edge: ptxas then serialises every wgmma of the kernel (its
note C7514, "wgmma.mma_async instructions are serialized due to non wgmma instructions reading accumulator
registers"; the first form of these kernels did, found by reading its ptxas log). So each iteration runs ``UNROLL``
steps (``GemmConfig.unroll``: 2 or 4), unrolled: the overlap above inside it, and its last step waited for alone
(``num_outstanding=0``), so 2 leaves half the steps' scaling exposed and 4 a quarter, for twice the loop body. Steps
past the program's last (in its last iteration) multiply a stale stage and their products are dropped. The CPU tests
run ptxas on every tile and fail on C7514.

Both kernels walk the same (M tile, N tile) items as moe_prefill.py's (``moe_walk.tile_of``'s order), as one flat
loop over the program's (item, K step) pairs: loads run ``NUM_STAGES`` steps ahead across item boundaries, each
stage's weight tiles on its own mbarrier, a stage refilled once every warp group's MMA of it is done (a CTA barrier),
and a step's scales are loaded while the previous step's product is awaited.

- ``_fc2_w8a8_kernel``: the intermediate [P_MAX, I] (e4m3, rows in tile order) and ``w2`` seen as [E * H, I] through
  host-side TMA descriptors; rows rounded to y's dtype and scattered to their slots of ``y`` [T k, H], as
  ``moe_prefill._fc2_kernel`` does.
- ``_fc1_w8a8_kernel``: the gate tile and the up tile of ``w13`` seen as [E * 2 I, H] through TMA into the two halves
  of a [2 BN, BK] buffer, one MMA of 2 BN columns (``GemmConfig.join``'s product); the rows' tokens gathered from the
  e4m3 hidden states by 16-byte cp.async copies (TMA cannot gather rows on sm_90), one commit group per step, waited
  for, made visible across the CTA and to the MMA's async proxy (``fence_async_shared``) before the MMA. The epilogue
  splits the sums into gate and up through shared memory and writes ``act(gate) * up`` in e4m3 with one scale per
  (row, N tile), as ``moe_prefill._fc1_kernel`` does.

Same float32 operations per element as the Triton kernels' ``SCALAR_SW`` steps (the tile's weight scale folded into
the row scales), in the same order, so the two agree up to the MMA's own summation order.

Scope (``problem``): e4m3 activations and weights with 128 x 128 block scales whose blocks hold whole tiles, or
per-tensor / per-expert scales; BM = 16 x num_warps (4 or 8 warps). Calls outside it run the Triton kernels on the
same tiles. Launches take Triton's own launch path (the host TMA descriptors are arguments ``launch.Launcher`` does not
bind), and ``passes/inline_kernels.py`` leaves a call with them an op call. Gluon has no interpreter: the CPU tests
compile both kernels for sm_90 (tests/cpu/kernels/test_triton_moe_prefill_gluon.py); the GPU tests check their values.
"""

from __future__ import annotations

from typing import Optional

try:  # Gluon is Triton's explicit-layout dialect (Triton >= 3.5); without it the Triton kernels run
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    # Triton functions, which Gluon code can call
    from rubin_compile.kernels.triton.activations import gated
    from rubin_compile.kernels.triton.moe_walk import tile_of

    # TMA's global -> shared copy: ``async_load`` in Triton 3.9 (which refuses the old name), the old name in 3.6
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # the CTA barrier (bar.sync): ``barrier`` in Triton 3.9, ``thread_barrier`` in 3.6
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    # cp.async's global -> shared copy (gathered rows): the same rename
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

GLUON = gluon is not None


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
    """Why the Gluon FC2 (``fc1``: FC1) cannot run these tiles (None: it can)."""
    name = "FC1" if fc1 else "FC2"
    if not GLUON:
        return "this Triton has no Gluon (triton.experimental.gluon, Triton >= 3.5)"
    if not a_fp8:
        return f"the Gluon {name} is the W8A8 one (e4m3 activations and weights)"
    if w_scale == 0:
        return "e4m3 weights without scales"
    if w_scale == 2 and not scalar_sw:
        return "128 x 128 block scales must hold whole tiles (BN and BK dividing the blocks, FC1: I a multiple of them)"
    if num_warps not in (4, 8) or BM != 16 * num_warps:
        return f"BM={BM} with {num_warps} warps: the Gluon {name} takes BM = 16 x num_warps (4 or 8 warps)"
    widths = (32, 64) if fc1 else (32, 64, 128)
    if BN not in widths:
        return (
            f"BN={BN}: the Gluon {name} keeps three float32 tiles of BM x {'2 BN' if fc1 else 'BN'} in registers; "
            f"BN in {', '.join(map(str, widths))}"
        )
    if BK not in (32, 64, 128):
        return f"BK={BK}: e4m3 K tiles of 32, 64 or 128"
    if num_stages < 2:
        return f"num_stages={num_stages}: the Gluon {name} loads at least one step ahead (2 or more stages)"
    return None


if GLUON:

    @gluon.jit
    def _item(g, num_k, num_m, num_n, GROUP: gl.constexpr):
        """(M tile, N tile, K step) of this program's flat step ``g``: its items in ``moe_walk.tile_of``'s order."""
        # (a step past the program's last, whose loads are predicated off, still gets a real item: no zero divisor)
        tile = gl.minimum(gl.program_id(0) + (g // num_k) * gl.num_programs(0), num_m * num_n - 1)
        m, n = tile_of(tile, num_m, num_n, GROUP)
        return m, n, g % num_k

    @gluon.jit
    def _issue(
        a_desc,
        w_desc,
        a_s,
        w_s,
        ready,
        tile_expert_ptr,
        g,
        total,
        num_k,
        num_m,
        num_n,
        H,
        BM: gl.constexpr,
        BN: gl.constexpr,
        BK: gl.constexpr,
        GROUP: gl.constexpr,
        NUM_STAGES: gl.constexpr,
    ):
        """Start the TMA loads of flat step ``g`` (none when g >= total) into its stage."""
        ok = g < total
        m, n, kk = _item(g, num_k, num_m, num_n, GROUP)
        e = gl.load(tile_expert_ptr + m, mask=ok, other=0)
        s = g % NUM_STAGES
        bar = ready.index(s)
        mbarrier.expect(bar, BM * BK + BN * BK, pred=ok)
        _tma_load(a_desc, [m * BM, kk * BK], bar, a_s.index(s), pred=ok)
        _tma_load(w_desc, [e * H + n * BN, kk * BK], bar, w_s.index(s), pred=ok)

    @gluon.jit
    def _scales(
        isc_ptr,
        ws_ptr,
        tile_expert_ptr,
        g,
        num_k,
        num_m,
        num_n,
        stride_ist,
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
        """The float32 scale of each row of step ``g``'s product: the rows' activation scales of its K tile, times
        (128 x 128 block scales) the tile's one weight scale. Its BM rows start ROW0 rows into the TILE_M-row M tile
        (the warp-specialized kernels' warpgroups each take half a tile)."""
        m, n, kk = _item(g, num_k, num_m, num_n, GROUP)
        rows = (m * TILE_M + ROW0 + gl.arange(0, BM, layout=row_layout)).to(gl.int64)
        sa = gl.load(isc_ptr + rows * stride_ist + kk)
        if W_SCALE == 2:
            e = gl.load(tile_expert_ptr + m)
            sa = sa * gl.load(ws_ptr + e * stride_se + (n * BN // SBN) * stride_sn + (kk * BK // SBK) * stride_sk)
        return sa

    @gluon.jit
    def _store(
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
        BM: gl.constexpr,
        BN: gl.constexpr,
        GROUP: gl.constexpr,
        W_SCALE: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        out_layout: gl.constexpr,
        TILE_M: gl.constexpr,
        ROW0: gl.constexpr,
    ):
        """The finished item of step ``g``: per-expert weight scale, bias, rounded to y's dtype and scattered to the
        rows' slots (padding rows, slot -1, are not stored). Its BM rows start ROW0 rows into the TILE_M-row M tile."""
        m, n, kk = _item(g, num_k, num_m, num_n, GROUP)
        e = gl.load(tile_expert_ptr + m)
        # scale and bias in float32 where the sums are, then y's dtype, then the store's layout: the copy between
        # layouts moves half the registers (it runs while the next step's MMA holds its own)
        if W_SCALE == 1:
            acc = acc * gl.load(ws_ptr + e * stride_se).to(gl.float32)
        if HAS_BIAS:
            bcols = n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, acc.type.layout))
            bias = gl.load(b_ptr + e * stride_be + bcols, mask=bcols < H, other=0.0).to(gl.float32)
            acc = acc + gl.expand_dims(bias, 0)
        out = gl.convert_layout(acc.to(y_ptr.dtype.element_ty), out_layout)
        rows = (m * TILE_M + ROW0 + gl.arange(0, BM, layout=gl.SliceLayout(1, out_layout))).to(gl.int64)
        cols = n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
        slot = gl.load(sorted_ptr + rows)
        ptrs = y_ptr + gl.expand_dims(gl.where(slot >= 0, slot, 0).to(gl.int64) * H, 1) + gl.expand_dims(cols, 0)
        mask = gl.expand_dims(slot >= 0, 1) & gl.expand_dims(cols < H, 0)
        gl.store(ptrs, out, mask=mask)

    @gluon.jit
    def _fc2_w8a8_kernel(
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
        NW: gl.constexpr = gl.num_warps()
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BN, 32]
        )
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        # stores of 16 bytes per thread along a row (8 bf16 / fp16): whole rows per warp where BN allows
        TN: gl.constexpr = BN // 8 if BN // 8 < 32 else 32
        out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TN, TN], [NW, 1], [1, 0])

        a_s = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BM, BK], a_desc.layout)
        w_s = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, BN, BK], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(i), count=1)

        if GDC:
            gdc_wait()  # the intermediate, its scales and the tile table are earlier kernels'
            gdc_launch_dependents()
        num_m = gl.load(ntiles_ptr)
        num_n = gl.cdiv(H, BN)
        num_k = gl.cdiv(I, BK)
        items = gl.maximum(num_m * num_n - gl.program_id(0) + gl.num_programs(0) - 1, 0) // gl.num_programs(0)
        total = items * num_k

        # NUM_STAGES steps load ahead; a step's stage is refilled with the step NUM_STAGES later once its MMA is done
        for j in gl.static_range(NUM_STAGES):
            _issue(
                a_desc,
                w_desc,
                a_s,
                w_s,
                ready,
                tile_expert_ptr,
                j,
                total,
                num_k,
                num_m,
                num_n,
                H,
                BM,
                BN,
                BK,
                GROUP,
                NUM_STAGES,
            )

        zero = gl.zeros([BM, BN], gl.float32, layout=mma_layout)
        acc = zero
        # UNROLL steps an iteration, so that no MMA is in flight across the loop's back-edge: ptxas serialises every
        # wgmma of a loop that carries an in-flight accumulator into the next iteration (its warning C7514). Each
        # step's MMA is issued before the previous one's product is waited for and scaled, but the last step of an
        # iteration is waited for alone. Steps past ``total`` (in the last iteration) multiply a stale stage whose
        # product is dropped.
        for g0 in range(0, total, UNROLL):
            st = g0 % NUM_STAGES
            mbarrier.wait(ready.index(st), (g0 // NUM_STAGES) & 1)
            prev = warpgroup_mma(a_s.index(st), w_s.index(st).permute((1, 0)), zero, use_acc=False, is_async=True)
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
                BM,
                BN,
                BK,
                GROUP,
                W_SCALE,
                row_layout,
                BM,
                0,
            )
            for u in gl.static_range(UNROLL):
                g = g0 + u  # the step whose product is finished in this round
                if u + 1 < UNROLL:  # issue step g + 1, then wait for step g's product alone
                    nxt = g + 1
                    sn = nxt % NUM_STAGES
                    mbarrier.wait(ready.index(sn), (nxt // NUM_STAGES) & 1, pred=nxt < total)
                    cur = warpgroup_mma(
                        a_s.index(sn), w_s.index(sn).permute((1, 0)), zero, use_acc=False, is_async=True
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
                        BM,
                        BN,
                        BK,
                        GROUP,
                        W_SCALE,
                        row_layout,
                        BM,
                        0,
                    )
                    done = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))
                else:
                    done = warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
                if g < total:
                    acc = acc + done * gl.expand_dims(s_prev, 1)
                _cta_barrier()  # every warp group's MMA g is done: its stage takes step g + NUM_STAGES
                _issue(
                    a_desc,
                    w_desc,
                    a_s,
                    w_s,
                    ready,
                    tile_expert_ptr,
                    g + NUM_STAGES,
                    total,
                    num_k,
                    num_m,
                    num_n,
                    H,
                    BM,
                    BN,
                    BK,
                    GROUP,
                    NUM_STAGES,
                )
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
                        BM,
                        BN,
                        GROUP,
                        W_SCALE,
                        HAS_BIAS,
                        out_layout,
                        BM,
                        0,
                    )
                    acc = zero
                if u + 1 < UNROLL:
                    prev = cur
                    s_prev = s_cur
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(ready.index(i))

    @gluon.jit
    def _issue_fc1(
        w_desc,
        a_s,
        w_s,
        ready,
        x_ptr,
        sorted_ptr,
        tile_expert_ptr,
        g,
        total,
        num_k,
        num_m,
        num_n,
        H,
        I,
        K_TOP,
        stride_xt,
        BM: gl.constexpr,
        BN: gl.constexpr,
        BK: gl.constexpr,
        GROUP: gl.constexpr,
        NUM_STAGES: gl.constexpr,
        a_layout: gl.constexpr,
    ):
        """Start flat step ``g``'s loads into its stage (none past ``total``, but the copy group is committed
        all the same, so every step owns one): the expert's gate tile and up tile through TMA into the two halves
        of the stage's [2 BN, BK] weight buffer, and the rows' gathered tokens by 16-byte cp.async copies (TMA cannot
        gather rows on sm_90), zeros for padding rows and past H."""
        ok = g < total
        m, n, kk = _item(g, num_k, num_m, num_n, GROUP)
        e = gl.load(tile_expert_ptr + m, mask=ok, other=0)
        s = g % NUM_STAGES
        bar = ready.index(s)
        ws = w_s.index(s)
        mbarrier.expect(bar, 2 * BN * BK, pred=ok)
        _tma_load(w_desc, [e * 2 * I + n * BN, kk * BK], bar, ws.slice(0, BN), pred=ok)
        _tma_load(w_desc, [e * 2 * I + I + n * BN, kk * BK], bar, ws.slice(BN, BN), pred=ok)
        rows = m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, a_layout))
        slot = gl.load(sorted_ptr + rows, mask=ok, other=-1)
        tok = gl.where(slot >= 0, slot // K_TOP, 0).to(gl.int64)
        offs_k = kk * BK + gl.arange(0, BK, layout=gl.SliceLayout(0, a_layout))
        ptrs = x_ptr + gl.expand_dims(tok * stride_xt, 1) + gl.expand_dims(offs_k, 0)
        mask = gl.expand_dims(slot >= 0, 1) & gl.expand_dims(offs_k < H, 0)
        _cp_async(a_s.index(s), ptrs, mask=mask)
        async_copy.commit_group()

    @gluon.jit
    def _scales_fc1(
        xs_ptr,
        ws_ptr,
        sorted_ptr,
        tile_expert_ptr,
        g,
        num_k,
        num_m,
        num_n,
        I,
        K_TOP,
        stride_xst,
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
        mma_layout: gl.constexpr,
    ):
        """Step ``g``'s row scales of its gate and up products ([BM] each): the row's activation scale of the K tile,
        times (128 x 128 block scales) the gate tile's one weight scale, and the up tile's."""
        m, n, kk = _item(g, num_k, num_m, num_n, GROUP)
        rows = m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_layout))
        slot = gl.load(sorted_ptr + rows)
        tok = gl.where(slot >= 0, slot // K_TOP, 0).to(gl.int64)
        sa = gl.load(xs_ptr + tok * stride_xst + kk, mask=slot >= 0, other=0.0)
        if W_SCALE == 2:
            e = gl.load(tile_expert_ptr + m)
            sk = e * stride_se + (kk * BK // SBK) * stride_sk
            sg = sa * gl.load(ws_ptr + sk + (n * BN // SBN) * stride_sn)
            su = sa * gl.load(ws_ptr + sk + ((I + n * BN) // SBN) * stride_sn)
            return sg, su
        return sa, sa

    @gluon.jit
    def _store_fc1(
        acc,
        scratch,
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
        ACT: gl.constexpr,
        BM: gl.constexpr,
        BN: gl.constexpr,
        GROUP: gl.constexpr,
        W_SCALE: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        out_layout: gl.constexpr,
        TILE_M: gl.constexpr,
        ROW0: gl.constexpr,
    ):
        """The finished item of step ``g``: its [BM, 2 BN] sums split into gate and up through shared memory, the
        per-expert weight scale, biases, ``act(gate) * up``, and the intermediate written in e4m3 with one scale
        (amax / 448 over the real columns) per row into ``isc`` [P_MAX, I / BN], as moe_prefill._fc1_kernel does.
        Its BM rows start ROW0 rows into the TILE_M-row M tile; the barriers are the executing warps' (a
        warp-specialized kernel's partition)."""
        m, n, kk = _item(g, num_k, num_m, num_n, GROUP)
        e = gl.load(tile_expert_ptr + m)
        if W_SCALE == 1:  # the per-expert weight scale, on the sums where they are (the same product per element)
            acc = acc * gl.load(ws_ptr + e * stride_se).to(gl.float32)
        _cta_barrier()  # the previous item's reads of the scratch are done
        scratch.store(acc)
        _cta_barrier()
        gate = scratch.slice(0, BN, dim=1).load(out_layout)
        up = scratch.slice(BN, BN, dim=1).load(out_layout)
        rows = (m * TILE_M + ROW0 + gl.arange(0, BM, layout=gl.SliceLayout(1, out_layout))).to(gl.int64)
        cols = n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
        real = gl.expand_dims(cols < I, 0)
        if HAS_BIAS:
            bg = gl.load(b_ptr + e * stride_be + cols, mask=cols < I, other=0.0).to(gl.float32)
            bu = gl.load(b_ptr + e * stride_be + I + cols, mask=cols < I, other=0.0).to(gl.float32)
            gate = gate + gl.expand_dims(bg, 0)
            up = up + gl.expand_dims(bu, 0)
        h = gated(gate, ACT) * up
        hs = gl.maximum(gl.max(gl.abs(gl.where(real, h, 0.0)), axis=1), 1e-12) / 448.0
        gl.store(isc_ptr + rows * stride_ist + n, hs)
        h = h / gl.expand_dims(hs, 1)
        ptrs = inter_ptr + gl.expand_dims(rows * I, 1) + gl.expand_dims(cols, 0)
        gl.store(ptrs, h.to(inter_ptr.dtype.element_ty), mask=real)

    @gluon.jit
    def _fc1_w8a8_kernel(
        w_desc,
        x_ptr,
        xs_ptr,
        ws_ptr,
        b_ptr,
        sorted_ptr,
        tile_expert_ptr,
        ntiles_ptr,
        inter_ptr,
        isc_ptr,
        H,
        I,
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
        """inter[p, n] = act(x[tok] . w13[e, n] + b) * (x[tok] . w13[e, I + n] + b), in e4m3 with one scale per row
        and N tile, for every row p of every tile; the gate and up tiles multiplied as one [BM, 2 BN] product."""
        NW: gl.constexpr = gl.num_warps()
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, 2 * BN, 32]
        )
        # the gathered rows: 16 bytes per thread and copy, BK / 16 threads along a row
        TK: gl.constexpr = BK // 16 if BK // 16 < 32 else 32
        a_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TK, TK], [NW, 1], [1, 0])
        # the epilogue: gate and up [BM, BN] float32, 4 per thread along a row
        TN: gl.constexpr = BN // 4 if BN // 4 < 32 else 32
        out_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TN, TN], [NW, 1], [1, 0])

        a_s = gl.allocate_shared_memory(
            gl.float8e4nv, [NUM_STAGES, BM, BK], gl.NVMMASharedLayout.get_default_for([BM, BK], gl.float8e4nv)
        )
        w_s = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, 2 * BN, BK], w_desc.layout)
        scratch = gl.allocate_shared_memory(
            gl.float32, [BM, 2 * BN], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        )
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(i), count=1)

        if GDC:
            gdc_wait()  # the hidden states (and their scales), the tile table and the sorted slots are earlier writes
            gdc_launch_dependents()
        num_m = gl.load(ntiles_ptr)
        num_n = gl.cdiv(I, BN)
        num_k = gl.cdiv(H, BK)
        items = gl.maximum(num_m * num_n - gl.program_id(0) + gl.num_programs(0) - 1, 0) // gl.num_programs(0)
        total = items * num_k

        # NUM_STAGES steps load ahead (one cp.async commit group each, empty past ``total``); a step's stage is
        # refilled with the step NUM_STAGES later once its MMA is done
        for j in gl.static_range(NUM_STAGES):
            _issue_fc1(
                w_desc,
                a_s,
                w_s,
                ready,
                x_ptr,
                sorted_ptr,
                tile_expert_ptr,
                j,
                total,
                num_k,
                num_m,
                num_n,
                H,
                I,
                K_TOP,
                stride_xt,
                BM,
                BN,
                BK,
                GROUP,
                NUM_STAGES,
                a_layout,
            )

        zero = gl.zeros([BM, 2 * BN], gl.float32, layout=mma_layout)
        acc = zero
        # the product's columns: gate, then up (each half scaled by its own row scales)
        up = gl.expand_dims(gl.arange(0, 2 * BN, layout=gl.SliceLayout(0, mma_layout)) >= BN, 0)
        # UNROLL steps an iteration, no MMA in flight across the back-edge (as in _fc2_w8a8_kernel, which says why).
        # Before a step's MMA: NUM_STAGES + (steps refilled so far) copy groups are committed, so the step's own is
        # done when NUM_STAGES - 1 (an iteration's first step: g0 refilled) or NUM_STAGES - 2 (the others: one fewer
        # refilled than issued) are in flight; then every thread's rows are visible across the CTA and to the MMA's
        # async proxy.
        for g0 in range(0, total, UNROLL):
            st = g0 % NUM_STAGES
            async_copy.wait_group(NUM_STAGES - 1)
            mbarrier.wait(ready.index(st), (g0 // NUM_STAGES) & 1)
            fence_async_shared()
            _cta_barrier()
            prev = warpgroup_mma(a_s.index(st), w_s.index(st).permute((1, 0)), zero, use_acc=False, is_async=True)
            sg, su = _scales_fc1(
                xs_ptr,
                ws_ptr,
                sorted_ptr,
                tile_expert_ptr,
                g0,
                num_k,
                num_m,
                num_n,
                I,
                K_TOP,
                stride_xst,
                stride_se,
                stride_sn,
                stride_sk,
                SBN,
                SBK,
                BM,
                BN,
                BK,
                GROUP,
                W_SCALE,
                mma_layout,
            )
            for u in gl.static_range(UNROLL):
                g = g0 + u  # the step whose product is finished in this round
                if u + 1 < UNROLL:  # issue step g + 1, then wait for step g's product alone
                    nxt = g + 1
                    sn = nxt % NUM_STAGES
                    async_copy.wait_group(NUM_STAGES - 2)
                    mbarrier.wait(ready.index(sn), (nxt // NUM_STAGES) & 1, pred=nxt < total)
                    fence_async_shared()
                    _cta_barrier()
                    cur = warpgroup_mma(
                        a_s.index(sn), w_s.index(sn).permute((1, 0)), zero, use_acc=False, is_async=True
                    )
                    sg_cur, su_cur = _scales_fc1(
                        xs_ptr,
                        ws_ptr,
                        sorted_ptr,
                        tile_expert_ptr,
                        gl.minimum(nxt, total - 1),
                        num_k,
                        num_m,
                        num_n,
                        I,
                        K_TOP,
                        stride_xst,
                        stride_se,
                        stride_sn,
                        stride_sk,
                        SBN,
                        SBK,
                        BM,
                        BN,
                        BK,
                        GROUP,
                        W_SCALE,
                        mma_layout,
                    )
                    done = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))
                else:
                    done = warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
                if g < total:
                    acc = acc + done * gl.where(up, gl.expand_dims(su, 1), gl.expand_dims(sg, 1))
                _cta_barrier()  # every warp group's MMA g is done: its stage takes step g + NUM_STAGES
                _issue_fc1(
                    w_desc,
                    a_s,
                    w_s,
                    ready,
                    x_ptr,
                    sorted_ptr,
                    tile_expert_ptr,
                    g + NUM_STAGES,
                    total,
                    num_k,
                    num_m,
                    num_n,
                    H,
                    I,
                    K_TOP,
                    stride_xt,
                    BM,
                    BN,
                    BK,
                    GROUP,
                    NUM_STAGES,
                    a_layout,
                )
                if (g < total) & (g % num_k == num_k - 1):  # step g ended its item
                    _store_fc1(
                        acc,
                        scratch,
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
                        BM,
                        BN,
                        GROUP,
                        W_SCALE,
                        HAS_BIAS,
                        out_layout,
                        BM,
                        0,
                    )
                    acc = zero
                if u + 1 < UNROLL:
                    prev = cur
                    sg = sg_cur
                    su = su_cur
        async_copy.wait_group(0)  # the empty groups past the last step
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(ready.index(i))


def fc1_descriptor(w13, E: int, H: int, I: int, BN: int, BK: int):
    """Host-side TMA descriptor of ``w13`` seen as [E * 2 I, H] (box [BN, BK]: a gate or an up tile, each loaded
    into its half of a stage's [2 BN, BK] buffer)."""
    layout = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.float8e4nv)
    return TensorDescriptor(w13, [E * 2 * I, H], [H, 1], [BN, BK], layout)


def descriptors(inter, w2, E: int, H: int, I: int, BM: int, BN: int, BK: int):
    """Host-side TMA descriptors of the intermediate [P_MAX, I] (box [BM, BK]) and ``w2`` seen as [E * H, I] (box
    [BN, BK]), with the shared-memory layouts the kernel's buffers take from them."""
    a_layout = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.float8e4nv)
    a = TensorDescriptor(inter, list(inter.shape), [I, 1], [BM, BK], a_layout)
    w = TensorDescriptor(w2, [E * H, I], [I, 1], [BN, BK], w_layout)
    return a, w
