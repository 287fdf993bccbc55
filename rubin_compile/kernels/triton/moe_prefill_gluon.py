"""FC2 of the persistent MoE path in FP8 (W8A8) as a Gluon kernel: each K step's e4m3 product stays in flight while
the previous step's product is scaled (``GemmConfig.gluon``).

Why Gluon. A W8A8 K step with 128 x 128 block scales computes ``acc += (a . w^T) * s`` with ``s`` the rows' scales
of that K tile times its weight block's scale: the product must be finished before it is scaled, and Triton's own
pipeliner keeps a wgmma asynchronous only while its result feeds nothing but later wgmmas (WGMMAPipeline.cpp;
``benchmarks/sm90_wgmma_waits.py`` shows the ``wgmma.wait_group 0`` it emits), so every Triton K step waits for its
MMA and the tensor cores idle while it scales. Gluon (``triton.experimental.gluon``, Triton >= 3.5) exposes the
asynchronous wgmma and its wait: here step k + 1's MMA is issued into a second register tile before the wait for
step k (``warpgroup_mma_wait(num_outstanding=1)``), so the scaling of one step, the loads' issue and an item's
epilogue run while the next step's MMA does. That costs a third register tile (accumulator + two products), which
caps the tile at 64 x BN per warpgroup with BN <= 128.

The kernel walks the same (M tile, N tile) items as ``moe_prefill._fc2_kernel`` (``_tile_of``'s order), as one flat
loop over its (item, K step) pairs: the TMA loads run ``NUM_STAGES`` steps ahead across item boundaries, each stage
with its own mbarrier. Operands come through host-side TMA descriptors (the intermediate [P_MAX, I] in e4m3 and
``w2`` seen as [E * H, I]); the row scales ``isc`` [P_MAX, I / BK] and the weight scales are loaded one step ahead.
The output rows are scattered to their slots of ``y`` [T k, H] as ``_fc2_kernel`` does, rounded to y's dtype. Same
float32 operations per element as ``_fc2_kernel``'s ``SCALAR_SW`` step (the tile's weight scale folded into the row
scales), in the same order per element, so the two agree to the MMA's own summation order.

Scope (``problem``): e4m3 intermediate and weights with 128 x 128 block scales whose blocks hold whole tiles (BN
divides the block, BK divides it along K), or per-tensor / per-expert scales; BM = 16 x num_warps (one warp row of
16 per warp); BN <= 128. Other calls run ``_fc2_kernel``. Gluon has no interpreter: the CPU tests compile it for
sm_90 (tests/cpu/kernels/test_triton_moe_prefill_gluon.py); the GPU tests check its values.
"""

from __future__ import annotations

from typing import Optional

try:  # Gluon is Triton's explicit-layout dialect (Triton >= 3.5); without it the Triton FC2 runs
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    # TMA's global -> shared copy: ``async_load`` from Triton 3.7 (3.9 refuses the old name), the old name before
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

GLUON = gluon is not None


def problem(BM: int, BN: int, BK: int, num_warps: int, w_scale: int, scalar_sw: bool, a_fp8: bool) -> Optional[str]:
    """Why the Gluon FC2 cannot run these tiles (None: it can)."""
    if not GLUON:
        return "this Triton has no Gluon (triton.experimental.gluon, Triton >= 3.5)"
    if not a_fp8:
        return "the Gluon FC2 is the W8A8 one (e4m3 intermediate and weights)"
    if w_scale == 2 and not scalar_sw:
        return "128 x 128 block scales must hold whole tiles (BN and BK dividing the blocks)"
    if w_scale == 0:
        return "e4m3 weights without scales"
    if num_warps not in (4, 8) or BM != 16 * num_warps:
        return f"BM={BM} with {num_warps} warps: the Gluon FC2 takes BM = 16 x num_warps (4 or 8 warps)"
    if BN not in (32, 64, 128):
        return f"BN={BN}: the Gluon FC2 keeps three BM x BN float32 tiles in registers; BN in 32, 64, 128"
    if BK not in (32, 64, 128):
        return f"BK={BK}: e4m3 K tiles of 32, 64 or 128"
    return None


if GLUON:

    @gluon.jit
    def _item(g, num_k, num_m, num_n, GROUP: gl.constexpr):
        """(M tile, N tile, K step) of this program's flat step ``g`` (``moe_prefill._tile_of``'s walk)."""
        tile = gl.program_id(0) + (g // num_k) * gl.num_programs(0)
        per_group = GROUP * num_n
        first_m = (tile // per_group) * GROUP
        rows = gl.minimum(num_m - first_m, GROUP)
        m = first_m + (tile % per_group) % rows
        n = (tile % per_group) // rows
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
    ):
        """The float32 scale of each row of step ``g``'s product: the rows' activation scales of its K tile, times
        (128 x 128 block scales) the tile's one weight scale."""
        m, n, kk = _item(g, num_k, num_m, num_n, GROUP)
        rows = (m * BM + gl.arange(0, BM, layout=row_layout)).to(gl.int64)
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
    ):
        """The finished item of step ``g``: per-expert weight scale, bias, rounded to y's dtype and scattered to the
        rows' slots (padding rows, slot -1, are not stored)."""
        m, n, kk = _item(g, num_k, num_m, num_n, GROUP)
        e = gl.load(tile_expert_ptr + m)
        out = gl.convert_layout(acc, out_layout)
        rows = (m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, out_layout))).to(gl.int64)
        cols = n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
        if W_SCALE == 1:
            out = out * gl.load(ws_ptr + e * stride_se).to(gl.float32)
        if HAS_BIAS:
            bias = gl.load(b_ptr + e * stride_be + cols, mask=cols < H, other=0.0).to(gl.float32)
            out = out + gl.expand_dims(bias, 0)
        slot = gl.load(sorted_ptr + rows)
        ptrs = y_ptr + gl.expand_dims(gl.where(slot >= 0, slot, 0).to(gl.int64) * H, 1) + gl.expand_dims(cols, 0)
        mask = gl.expand_dims(slot >= 0, 1) & gl.expand_dims(cols < H, 0)
        gl.store(ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)

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
        if total > 0:
            mbarrier.wait(ready.index(0), 0)
            p = warpgroup_mma(a_s.index(0), w_s.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
            s = _scales(
                isc_ptr,
                ws_ptr,
                tile_expert_ptr,
                0,
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
            )
            acc = zero
            for g in range(1, total):
                st = g % NUM_STAGES
                mbarrier.wait(ready.index(st), (g // NUM_STAGES) & 1)
                q = warpgroup_mma(a_s.index(st), w_s.index(st).permute((1, 0)), zero, use_acc=False, is_async=True)
                s_next = _scales(
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
                    BM,
                    BN,
                    BK,
                    GROUP,
                    W_SCALE,
                    row_layout,
                )
                p = warpgroup_mma_wait(num_outstanding=1, deps=(p,))  # step g - 1's product is done
                acc = acc + p * gl.expand_dims(s, 1)
                # step g - 1's stage is free: step g - 1 + NUM_STAGES loads into it
                _issue(
                    a_desc,
                    w_desc,
                    a_s,
                    w_s,
                    ready,
                    tile_expert_ptr,
                    g - 1 + NUM_STAGES,
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
                if (g - 1) % num_k == num_k - 1:  # step g - 1 ended its item
                    _store(
                        acc,
                        y_ptr,
                        ws_ptr,
                        b_ptr,
                        sorted_ptr,
                        tile_expert_ptr,
                        g - 1,
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
                    )
                    acc = zero
                p = q
                s = s_next
            p = warpgroup_mma_wait(num_outstanding=0, deps=(p,))
            acc = acc + p * gl.expand_dims(s, 1)
            _store(
                acc,
                y_ptr,
                ws_ptr,
                b_ptr,
                sorted_ptr,
                tile_expert_ptr,
                total - 1,
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
            )
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(ready.index(i))


def descriptors(inter, w2, E: int, H: int, I: int, BM: int, BN: int, BK: int):
    """Host-side TMA descriptors of the intermediate [P_MAX, I] (box [BM, BK]) and ``w2`` seen as [E * H, I] (box
    [BN, BK]), with the shared-memory layouts the kernel's buffers take from them."""
    a_layout = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.float8e4nv)
    a = TensorDescriptor(inter, list(inter.shape), [I, 1], [BM, BK], a_layout)
    w = TensorDescriptor(w2, [E * H, I], [I, 1], [BN, BK], w_layout)
    return a, w
