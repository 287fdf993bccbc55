"""FP8 helpers the MoE kernels share (moe.py's decode path, moe_prefill.py's persistent one): activations quantised
to e4m3 once per call with one scale per (row, K group), and weight scales as the kernels take them."""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl

from rubin_compile.kernels.triton.launch import cdiv, launcher
from rubin_compile.kernels.triton.pdl import gdc_launch_dependents, gdc_wait


@triton.jit(do_not_specialize=["n_tick"])
def quant_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    tick_ptr,
    n_tick,
    H,
    stride_xt,
    stride_xh,
    stride_qt,
    stride_st,
    G: tl.constexpr,
    NG: tl.constexpr,
    GDC: tl.constexpr,
):
    """Activations to e4m3 once per call, for FC1: q[t, j] = e4m3(x[t, j] / s[t, j // G]) with s = max(amax of
    the G-wide group, 1e-12) / 448, G = FC1's K tile, the same numbers FC1 used to compute in every program
    and K step. Program (t, b) does groups [b * NG, (b + 1) * NG) of token t. Program (0, 0) also zeroes the
    ``n_tick`` arrival tickets of a K-split FC1 (after its wait: the memory may be a buffer an earlier kernel
    still used)."""
    t = tl.program_id(0).to(tl.int64)
    gi = tl.program_id(1) * NG + tl.arange(0, NG)
    offs = gi[:, None] * G + tl.arange(0, G)[None, :]
    mask = offs < H
    if GDC:
        gdc_wait()  # the hidden states are the previous kernel's output
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        for c0 in range(0, n_tick, 1024):
            zo = c0 + tl.arange(0, 1024)
            tl.store(tick_ptr + zo, tl.zeros([1024], tl.int32), mask=zo < n_tick)
    x = tl.load(x_ptr + t * stride_xt + offs * stride_xh, mask=mask, other=0.0).to(tl.float32)
    if GDC:
        gdc_launch_dependents()
    s = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
    tl.store(q_ptr + t * stride_qt + offs, (x / s[:, None]).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + t * stride_st + gi, s, mask=gi * G < H)


def _e4m3_rows(rows: int, H: int, G: int, device) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int], int]:
    """The quantisation kernels' outputs and launch: e4m3 rows [rows, H], their scales [rows, cdiv(H, G)], the grid
    (a program per row and 2048 columns) and the groups a program does."""
    ng = max(1, 2048 // G)
    q = torch.empty((rows, H), dtype=torch.float8_e4m3fn, device=device)
    xs = torch.empty((rows, cdiv(H, G)), dtype=torch.float32, device=device)
    return q, xs, (rows, cdiv(cdiv(H, G), ng)), ng


def quantise_rows(
    x: torch.Tensor, G: int, gdc: bool, launch_kwargs: dict[str, Any], tick: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x`` [T, H] in e4m3, its scales [T, cdiv(H, G)]): one scale (amax / 448) per row and G-wide group, by one
    small kernel (which also zeroes ``tick``, a K-split FC1's arrival tickets, when given). ``launch_kwargs``:
    ``launch_pdl`` when PDL-launched."""
    q, xs, grid, ng = _e4m3_rows(x.shape[0], x.shape[1], G, x.device)
    launcher(quant_rows_kernel)[grid](
        x,
        q,
        xs,
        tick if tick is not None else xs,
        tick.numel() if tick is not None else 0,
        x.shape[1],
        x.stride(0),
        x.stride(1),
        q.stride(0),
        xs.stride(0),
        G=G,
        NG=ng,
        GDC=gdc,
        num_warps=4,
        **launch_kwargs,
    )
    return q, xs


@triton.jit
def gather_quant_rows_kernel(
    x_ptr,
    sorted_ptr,
    q_ptr,
    s_ptr,
    H,
    K_TOP,
    stride_xt,
    stride_qp,
    stride_sp,
    G: tl.constexpr,
    NG: tl.constexpr,
    GDC: tl.constexpr,
):
    """The persistent path's sorted rows in e4m3, in tile order: q[p, j] = e4m3(x[tok, j] / s[p, j // G]) with
    tok = sorted[p] // K_TOP and s = max(amax of the G-wide group, 1e-12) / 448 -- the numbers quant_rows_kernel
    gives token tok. Program (p, b) does groups [b * NG, (b + 1) * NG) of row p. Rows without a slot (sorted[p] = -1:
    an expert run's padding, and every row past the tiles in use) are not written: an MMA's output row depends on
    its own input row only, and no padding row's output is stored (their bytes would be a third of the writes at
    DeepSeek-V3's 128-row tiles)."""
    p = tl.program_id(0).to(tl.int64)
    gi = tl.program_id(1) * NG + tl.arange(0, NG)
    offs = gi[:, None] * G + tl.arange(0, G)[None, :]
    if GDC:
        gdc_wait()  # the hidden states and the sorted slots are earlier kernels' outputs
    slot = tl.load(sorted_ptr + p)
    tok = tl.where(slot >= 0, slot // K_TOP, 0).to(tl.int64)
    # the columns to read and write: a real row's H, none for a row without a slot (a bound, not a scalar mask:
    # Triton's interpreter refuses a scalar boolean joined to a tensor mask)
    h = tl.where(slot >= 0, H, 0)
    x = tl.load(x_ptr + tok * stride_xt + offs, mask=offs < h, other=0.0).to(tl.float32)
    if GDC:
        gdc_launch_dependents()
    s = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
    tl.store(q_ptr + p * stride_qp + offs, (x / s[:, None]).to(q_ptr.dtype.element_ty), mask=offs < h)
    tl.store(s_ptr + p * stride_sp + gi, s, mask=gi * G < h)


def gather_quantise_rows(
    x: torch.Tensor, sorted_slots: torch.Tensor, k: int, G: int, gdc: bool, launch_kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sorted rows in e4m3 [P_MAX, H], their scales [P_MAX, cdiv(H, G)]): row p is token
    ``sorted_slots[p] // k`` quantised as ``quantise_rows`` quantises it (one scale per G-wide group); rows without
    a slot (-1) are left unwritten. One kernel over P_MAX rows (``sorted_slots``' length), so that a CUDA graph
    replays it at any routing."""
    q, xs, grid, ng = _e4m3_rows(sorted_slots.numel(), x.shape[1], G, x.device)
    launcher(gather_quant_rows_kernel)[grid](
        x,
        sorted_slots,
        q,
        xs,
        x.shape[1],
        k,
        x.stride(0),
        q.stride(0),
        xs.stride(0),
        G=G,
        NG=ng,
        GDC=gdc,
        num_warps=4,
        **launch_kwargs,
    )
    return q, xs


def scale_args(scale: Optional[torch.Tensor], block_scaled: bool):
    """(tensor, stride_e, stride_n, stride_k) of a weight scale for the kernels."""
    if scale is None:
        return None, 0, 0, 0
    s = scale if scale.dtype == torch.float32 else scale.to(torch.float32)
    if block_scaled:
        return s, s.stride(0), s.stride(1), s.stride(2)
    s = s.reshape(-1)
    return s, (0 if s.numel() == 1 else s.stride(0)), 0, 0
