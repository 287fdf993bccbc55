"""Weight-streaming GEMM for decode-sized M (``M <= 64``) in Triton, for ``rubin.gemm``.

Contract: ``run(args, launch)`` computes ``rubin.gemm`` (ops/gemm.py) for ``M <= MAX_M`` rows: bf16 / fp16
activations with bf16 / fp16 weights or FP8 e4m3 / e5m2 weights (weight-only FP8: per-tensor, per-column and
128 x 128 block scales), and W8A8 FP8 (``a`` FP8 with per-tensor, per-row or, with block-scaled weights,
per-128-column-group scales); bias; the epilogues ``silu_and_mul``, ``gelu_tanh_and_mul`` and ``residual_add``.
No host synchronisation (capturable in a CUDA graph); deterministic (split-K partials are summed in split
order by a second kernel, no atomics); bitwise the same with PDL on and off.

Why this shape. At decode a linear layer reads its whole weight to produce a few rows: the floor is
(weight bytes) / (HBM bandwidth), a 2-30 MB projection is 0.5-8 us of bytes, and cuBLAS spends about 5 us on
each such call before it moves a byte (../shared/measurements/2026-11-30: 8-57% of copy bandwidth). So:

- **Every SM streams weights.** Program (m, n, s) owns ``BLOCK_N`` output columns (and their ``BLOCK_N`` up
  columns for the gated epilogues) over the ``s``-th slice of K; when the N tiles are fewer than the SMs, K
  is split (``split_k``) and ``_splitk_reduce`` sums the fp32 partials in split order and runs the epilogue.
  ``BLOCK_M`` covers all rows up to 64 (one M tile: each weight byte is read once); tiles of 16 rows are the
  MMA's minimum, padding is free next to the weight stream.
- **Weights are requested before the wait.** Weights never depend on the previous kernel, so with PDL each
  program asks L2 for the first ``prefetch`` bytes of its weight slice (``cp.async.bulk.prefetch.L2``, the
  copy engine, one instruction per chunk) *before* ``griddepcontrol.wait``: those bytes come in while the
  previous kernel drains. Only then are activations (which the previous kernel writes) read. The programs
  call ``griddepcontrol.launch_dependents`` right after the wait, so the next PDL kernel does the same in our
  tail. Without PDL the prefetch still puts one slice's worth of requests in flight at once.
- **Up to four rows, no tensor cores.** The FMA form (``mma=False``) multiplies and adds over the real rows; its
  reduction (GEMV) variant (``gemv=True``, ``_gemv_step``) defers the sum over K to after the loop, so the loop
  is loads and FMAs only (Inductor's M = 1 form). The H200 table selects it for FP8 block weights at M = 1 and for
  small bf16 shapes (docs/kernels/gemm.md).
- **The math is the reference's.** Products accumulate in fp32 (``tl.dot`` of the activation dtype; FP8
  operands are converted exactly to it first), block scales are applied per K tile, per-tensor / row /
  column scales and the bias once on the fp32 sum, then one rounding to the output dtype, and the epilogue
  runs on the rounded value as eager code does.

Configs come from the tuned table for the GPU (``lookup``; ``tune_gemm.py`` writes it, per (N, K, weight
format, M bucket), with cuBLAS's and Inductor's times beside ours) or, for a shape not in it, ``heuristic``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Optional

import torch
import triton
import triton.language as tl

from rubin_compile.kernels.triton.launch import cdiv, launcher
from rubin_compile.kernels.triton.activations import gelu_tanh, silu
from rubin_compile.kernels.triton.moe import _gemv_offs_k, _gemv_rows, device_file_name
from rubin_compile.kernels.triton.pdl import INTERPRET as _INTERPRET
from rubin_compile.kernels.triton.pdl import PREFETCH_CHUNK, gdc_launch_dependents, gdc_wait, has_gdc, l2_prefetch
from rubin_compile.ops.gemm import GATED, SCALE_BLOCK, GemmArgs, apply_epilogue, aten, reference
from rubin_compile.ops.registry import Launch


FMA_MAX_M = 4  # rows the FMA (GEMV) form takes; more rows run on the tensor cores
MAX_M = 64  # rows one call takes: decode and small batches; larger M is cuBLAS's (the adapter falls back)
CONFIG_DIR = Path(__file__).with_name("gemm_configs")
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # the tuned table's rows: a call's M rounds up to the next bucket
PREFETCH_CHUNKS = 8  # per weight row: at most 32 KB of a row (K = 16384 bf16) is prefetched
PREFETCH_BUDGET = 24 << 20  # at most this many bytes of one call's weights are prefetched (L2 is 50 MB on H200)
_A_SCALE = {None: 0, "tensor": 1, "row": 2, "group": 3}
_B_SCALE = {None: 0, "tensor": 1, "column": 2, "block": 3}
_EPILOGUE = {"none": 0, "silu_and_mul": 1, "gelu_tanh_and_mul": 2, "residual_add": 3}


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration. ``block_n`` output columns and ``block_k`` reduction positions per tile,
    ``split_k`` slices of K (1: no split), Triton's ``num_warps`` / ``num_stages`` (tiles in flight + 1),
    whether programs prefetch their weight slice into L2 before ``gdc_wait`` (``prefetch``), whether they load
    their first weight tile into registers before it (``early``), the tensor-core or FMA form (``mma``), and, of
    the FMA form, the reduction (GEMV) variant (``gemv``: see ``_gemv_step``)."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    prefetch: bool = False
    mma: bool = True  # tensor-core tiles (M padded to 16); False: FMA over the real rows (M <= 4)
    early: bool = False  # load the first weight tile into registers before gdc_wait (its latency overlaps)
    gemv: bool = False  # with mma=False: products summed per element over K, reduced once after the loop

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> "GemmConfig":
        names = {f.name for f in fields(GemmConfig)}
        return GemmConfig(**{k: v for k, v in d.items() if k in names})

    def describe(self) -> str:
        pf = "+pf" if self.prefetch else ""
        early = "+early" if self.early else ""
        fma = "" if self.mma else (" gemv" if self.gemv else " fma")
        return f"n{self.block_n} k{self.block_k} s{self.split_k} w{self.num_warps} st{self.num_stages}{pf}{early}{fma}"


def weight_format(args: GemmArgs) -> str:
    """The table's word for ``args``' weights: ``bf16`` / ``fp16`` / ``fp8_tensor`` / ``fp8_column`` /
    ``fp8_block``, with ``_a8`` appended for W8A8 (FP8 activations)."""
    if not args.fp8:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(args.b.dtype, str(args.b.dtype))
    return f"fp8_{args.b_scale_kind}" + ("_a8" if args.w8a8 else "")


def weight_bytes(N: int, K: int, wfmt: str) -> int:
    return N * K * (1 if wfmt.startswith("fp8") else 2)


def table_key(N: int, K: int, wfmt: str) -> str:
    return f"N={N},K={K},w={wfmt}"


# ------------------------------------------------------------------------------------------------
# choosing a config
# ------------------------------------------------------------------------------------------------


def _block_m(M: int, mma: bool = True) -> int:
    if not mma:
        return 1 << (max(M, 1) - 1).bit_length()
    return max(16, 1 << (max(M, 1) - 1).bit_length()) if M <= MAX_M else 64


def heuristic(M: int, N: int, K: int, wfmt: str, num_sms: int = 132) -> GemmConfig:
    """A config for a shape the table does not have: tensor-core tiles of 16 KB of weights (128 x 64 bf16), N
    tiles narrowed until every SM has one, then K split until there are about two programs per SM (each keeping
    at least four K tiles). No L2 prefetch: measured, it slowed most shapes (docs/kernels/gemm.md)."""
    block_k = 128
    block_n = 64
    while block_n > 16 and cdiv(N, block_n) < num_sms:
        block_n //= 2
    tiles = cdiv(N, block_n)
    k_tiles = cdiv(K, block_k)
    split = 1
    while tiles * split * 2 <= 2 * num_sms and k_tiles // (split * 2) >= 4:
        split *= 2
    return GemmConfig(block_n=block_n, block_k=block_k, split_k=split, num_warps=4, num_stages=4, prefetch=False)


def weight_only_fp8(wfmt: str) -> bool:
    """FP8 weights with bf16 / fp16 activations: the ATen form dequantises the whole weight in float32 per call,
    so our kernel is the one to run at every M."""
    return wfmt.startswith("fp8") and not wfmt.endswith("_a8")


@functools.lru_cache(maxsize=None)
def load_table(device_name: str, directory: Optional[str] = None) -> dict[str, Any]:
    """The tuned table of a GPU ({} when there is none). Read once per process; never tunes."""
    path = (Path(directory) if directory else CONFIG_DIR) / device_file_name(device_name)
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


@dataclass(frozen=True)
class Choice:
    """What runs one (N, K, format, M): ``kernel`` ("triton" or "cublas"), our config, where the decision came
    from (``source``: ``table:<key>@M=<bucket>`` or ``heuristic``), and the tuned times (us) when measured."""

    kernel: str
    config: GemmConfig
    source: str
    ours_us: Optional[float] = None
    cublas_us: Optional[float] = None
    inductor_us: Optional[float] = None

    @property
    def margin(self) -> Optional[float]:
        """cuBLAS time / ours (> 1: ours is faster), from the table."""
        if self.ours_us and self.cublas_us:
            return self.cublas_us / self.ours_us
        return None

    def describe(self) -> str:
        text = f"{self.kernel} ({self.source}"
        if self.ours_us is not None:
            text += f": ours {self.ours_us:.2f} us, cuBLAS {self.cublas_us:.2f} us"
            if self.inductor_us is not None:
                text += f", Inductor {self.inductor_us:.2f} us"
        return text + ")"


def choose(
    M: int,
    N: int,
    K: int,
    wfmt: str,
    device_name: str = "",
    num_sms: int = 132,
    table=None,
    max_autotune: bool = False,
) -> Choice:
    """Ours or cuBLAS for one call, and our config: the tuned table's entry for (N, K, format) at M's bucket
    when there is one -- ours where it measured faster than cuBLAS (and, when the compile runs Inductor's
    max-autotune, than Inductor's own GEMM too, which the lowered node would then get) --, else ours only for
    weight-only FP8 (the alternative dequantises the whole weight in float32 on every call), cuBLAS for the
    rest. ``M > MAX_M``: cuBLAS, except weight-only FP8."""
    if M > MAX_M:
        kernel = "triton" if weight_only_fp8(wfmt) else "cublas"
        return Choice(kernel, heuristic(M, N, K, wfmt, num_sms), f"M={M} > {MAX_M}")
    if table is None:
        table = load_table(device_name) if device_name else {}
    key = table_key(N, K, wfmt)
    rows = table.get("entries", {}).get(key, {})
    if rows:
        tuned = sorted(int(m) for m in rows)
        bucket = next((m for m in tuned if m >= M), tuned[-1])  # the smallest tuned M at least M
        entry = rows[str(bucket)]
        ours, cublas, ind = entry["ours_us"], entry["cublas_us"], entry.get("inductor_us")
        rivals = [cublas] + ([ind] if max_autotune and ind is not None else [])
        kernel = "triton" if ours < min(rivals) else "cublas"
        return Choice(kernel, GemmConfig.from_json(entry["config"]), f"table:{key}@M={bucket}", ours, cublas, ind)
    # Off the table: ours for weight-only FP8 (the alternative is the float32 dequantise-and-multiply), cuBLAS
    # for everything else -- untuned, our bf16 tiles were up to 1.9x slower than cuBLAS on benchmark shapes
    # (benchmarks/results/gemm-h200.md; tests/cpu/kernels/test_triton_gemm.py holds the rule to those numbers).
    cfg = heuristic(M, N, K, wfmt, num_sms)
    kernel = "triton" if weight_only_fp8(wfmt) else "cublas"
    return Choice(kernel, cfg, "heuristic")


# ------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------


@triton.jit
def _prefetch_rows(row_ptrs, nbytes, CHUNK: tl.constexpr, NCHUNK: tl.constexpr):
    """Ask the copy engine to pull ``nbytes`` from each row start in ``row_ptrs`` (16-byte aligned) into L2."""
    offs = tl.arange(0, NCHUNK) * CHUNK
    size = tl.minimum(tl.maximum(nbytes - offs, 0), CHUNK).to(tl.int32)
    size = (size // 16) * 16
    ptrs = row_ptrs.to(tl.pointer_type(tl.int8))[:, None] + offs[None, :]
    l2_prefetch(ptrs, tl.broadcast_to(size[None, :], ptrs.shape))


@triton.jit
def _dot(a, w, acc, COMPUTE: tl.constexpr, MMA: tl.constexpr = True):
    """``acc + a @ w`` with both operands converted (exactly) to ``COMPUTE``: the activation dtype on a GPU;
    fp32 under TRITON_INTERPRET, whose dot does not take bf16. ``MMA=False``: fp32 multiply-adds over the real
    rows (a GEMV for M = 1: no padding of M to the tensor cores' 16)."""
    if not MMA:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
    elif COMPUTE == tl.float32:
        return tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a.to(COMPUTE), w.to(COMPUTE), acc)


@triton.jit
def _finish(
    acc,
    acc_up,
    offs_m,
    offs_n,
    M,
    N_OUT,
    out_ptr,
    stride_om,
    bias_ptr,
    res_ptr,
    stride_rm,
    sa_ptr,
    sb_ptr,
    A_SCALE: tl.constexpr,
    B_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,
):
    """Scales, bias, one rounding to the output dtype, the epilogue, the store. ``acc`` holds columns
    ``offs_n`` (the gate columns of the gated epilogues, whose up columns are ``acc_up``, ``offs_n + N_OUT``)."""
    m_ok = offs_m < M
    n_ok = offs_n < N_OUT
    if A_SCALE == 1:
        sa = tl.load(sa_ptr)
        acc = acc * sa
        acc_up = acc_up * sa
    elif A_SCALE == 2:
        sa = tl.load(sa_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
        acc = acc * sa
        acc_up = acc_up * sa
    if B_SCALE == 1:
        sb = tl.load(sb_ptr)
        acc = acc * sb
        acc_up = acc_up * sb
    elif B_SCALE == 2:
        acc = acc * tl.load(sb_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
        if EPILOGUE == 1 or EPILOGUE == 2:
            acc_up = acc_up * tl.load(sb_ptr + N_OUT + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if EPILOGUE == 1 or EPILOGUE == 2:
            acc_up = acc_up + tl.load(bias_ptr + N_OUT + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ty = out_ptr.dtype.element_ty
    y = acc.to(out_ty).to(tl.float32)  # the product, rounded once as the reference rounds it
    if EPILOGUE == 1 or EPILOGUE == 2:
        up = acc_up.to(out_ty).to(tl.float32)
        if EPILOGUE == 1:
            act = silu(y)
        else:
            act = gelu_tanh(y)
        y = act.to(out_ty).to(tl.float32) * up  # eager: act(gate) rounded, then the product rounded
    elif EPILOGUE == 3:
        r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=m_ok[:, None] & n_ok[None, :])
        y = y + r.to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _step(
    acc,
    acc_up,
    a,
    w,
    w_up,
    k0,
    rows,
    m_ok,
    cols,
    N_OUT,
    sa_ptr,
    sb_ptr,
    stride_sam,
    stride_sbk,
    stride_sbn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    A_SCALE: tl.constexpr,
    B_SCALE: tl.constexpr,
    GATED_EPI: tl.constexpr,
    COMPUTE: tl.constexpr,
    MMA: tl.constexpr,
):
    """Add one K tile's products (``a`` against ``w`` and, gated, ``w_up``) to the accumulators. Block / group
    scales change every 128 positions of K: the tile's product is scaled, then added."""
    if B_SCALE == 3 or A_SCALE == 3:
        s = tl.full((BLOCK_M, BLOCK_N), 1.0, tl.float32)
        if A_SCALE == 3:
            s = s * tl.load(sa_ptr + rows * stride_sam + k0 // 128, mask=m_ok, other=0.0)[:, None]
        s_up = s
        if B_SCALE == 3:
            s = s * tl.load(sb_ptr + (k0 // 128) * stride_sbk + (cols // 128) * stride_sbn)[None, :]
            if GATED_EPI:
                s_up = s_up * tl.load(sb_ptr + (k0 // 128) * stride_sbk + ((cols + N_OUT) // 128) * stride_sbn)[None, :]
        acc += _dot(a, w, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), COMPUTE, MMA) * s
        if GATED_EPI:
            acc_up += _dot(a, w_up, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), COMPUTE, MMA) * s_up
    else:
        acc = _dot(a, w, acc, COMPUTE, MMA)
        if GATED_EPI:
            acc_up = _dot(a, w_up, acc_up, COMPUTE, MMA)
    return acc, acc_up


@triton.jit
def _gemv_step(
    acc2,
    acc2_up,
    a_ptr,
    stride_am,
    stride_ak,
    rows_j,
    m_ok_j,
    offs_k,
    k_ok,
    w,
    w_up,
    k0,
    n0,
    N_OUT,
    sa_ptr,
    sb_ptr,
    stride_sam,
    stride_sbk,
    stride_sbn,
    A_SCALE: tl.constexpr,
    B_SCALE: tl.constexpr,
    GATED_EPI: tl.constexpr,
):
    """The reduction (GEMV) form's K tile: ``acc2[k, j] += a[row_j, k] * w[k, j]`` in fp32, element by element; the
    sum over K is taken once, after the loop. The FMA form instead reduces every tile (``_dot`` with
    ``MMA=False``), and its sm_90 loop then holds shuffles, shared-memory layout conversions and 8 ``bar.sync``
    per K tile (Triton 3.9's PTX, 16 x 512 tiles), work per tile that keeps a program's weight stream slow
    (docs/kernels/gemm.md). Here the tile's columns are flat (output column, row) pairs, ``j = n * BLOCK_M + m``:
    the weight tile ``w`` repeats each weight column for the rows (the same addresses in one warp's load, one memory
    transaction) and the activation tile holds row m's activations in column j (from L1). Both are 2-D tiles with K
    contiguous, which Triton lays out alike in every version, so the loop needs no layout conversion, no shared
    memory and no barrier (tests/cpu/kernels/test_triton_gemm.py reads the PTX; a 3-D [rows, K, N] product had none
    on Triton 3.9 and 8 barriers a tile on 3.6 at 2-4 rows). Block / group scales are one per tile (``launch`` keeps
    a column tile inside one 128-column scale block)."""
    a = tl.load(
        a_ptr + rows_j[None, :] * stride_am + offs_k[:, None] * stride_ak,
        mask=m_ok_j[None, :] & k_ok[:, None],
        other=0.0,
    ).to(tl.float32)
    p = a * w.to(tl.float32)
    p_up = p
    if GATED_EPI:
        p_up = a * w_up.to(tl.float32)
    if A_SCALE == 3:
        sa = tl.load(sa_ptr + rows_j * stride_sam + k0 // 128, mask=m_ok_j, other=0.0)[None, :]
        p = p * sa
        p_up = p_up * sa
    if B_SCALE == 3:
        p = p * tl.load(sb_ptr + (k0 // 128) * stride_sbk + (n0 // 128) * stride_sbn)
        if GATED_EPI:
            p_up = p_up * tl.load(sb_ptr + (k0 // 128) * stride_sbk + ((n0 + N_OUT) // 128) * stride_sbn)
    acc2 += p
    if GATED_EPI:
        acc2_up += p_up
    return acc2, acc2_up


@triton.jit(do_not_specialize=["M", "PF_BYTES"])  # one binary for every M (M == 1 would specialise)
def _gemm_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    ws_ptr,
    bias_ptr,
    res_ptr,
    sa_ptr,
    sb_ptr,
    M,
    K,
    N_OUT,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_om,
    stride_rm,
    stride_sam,
    stride_sbk,
    stride_sbn,
    K_SPLIT,
    PF_BYTES,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    A_SCALE: tl.constexpr,
    B_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,
    PREFETCH: tl.constexpr,
    PF_CHUNK: tl.constexpr,
    PF_NCHUNK: tl.constexpr,
    GDC: tl.constexpr,
    COMPUTE: tl.constexpr,
    ESIZE: tl.constexpr,
    MMA: tl.constexpr,
    EARLY: tl.constexpr,
    GEMV: tl.constexpr,
):
    GATED_EPI: tl.constexpr = EPILOGUE == 1 or EPILOGUE == 2
    pid_m = tl.program_id(0)  # fastest: the M tiles of one weight tile run together and share it in L2
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns; with a gated epilogue the gate ones
    n_ok = offs_n < N_OUT
    cols = tl.where(n_ok, offs_n, 0)  # masked-off columns read column 0 (in bounds), never stored
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    # the weight tile's K offsets: in the GEMV form FP8 weights are loaded 8 to a thread, the activations' layout
    offs_w = _gemv_offs_k(BLOCK_K, ESIZE * 8) if GEMV else tl.arange(0, BLOCK_K)
    n0 = pid_n * BLOCK_N
    if GEMV:  # the tile's flat columns j = n * BLOCK_M + m (see _gemv_step): weight column and row of each
        jj = tl.arange(0, BLOCK_N * BLOCK_M)
        n_j = n0 + jj // BLOCK_M
        wcols = tl.where(n_j < N_OUT, n_j, 0)
        rows_j = pid_m * BLOCK_M + jj % BLOCK_M
        m_ok_j = rows_j < M
        rows_j = tl.where(m_ok_j, rows_j, 0)
    else:
        wcols = cols
    if PREFETCH:
        # Weights never depend on the previous kernel: request this program's first PF_BYTES per row now.
        nbytes = tl.minimum(PF_BYTES, (k_hi - k_lo) * ESIZE)
        _prefetch_rows(b_ptr + cols * stride_bn + k_lo, nbytes, PF_CHUNK, PF_NCHUNK)
        if GATED_EPI:
            _prefetch_rows(b_ptr + (cols + N_OUT) * stride_bn + k_lo, nbytes, PF_CHUNK, PF_NCHUNK)
    if EARLY:
        # ... and load its first weight tile into registers: its DRAM round trip overlaps the previous kernel.
        offs_k0 = k_lo + tl.arange(0, BLOCK_K)
        k_ok0 = offs_k0 < K
        offs_w0 = k_lo + offs_w
        w_ok0 = offs_w0 < K
        w0 = tl.load(b_ptr + offs_w0[:, None] * stride_bk + wcols[None, :] * stride_bn, mask=w_ok0[:, None], other=0.0)
        w0_up = w0
        if GATED_EPI:
            w0_up = tl.load(
                b_ptr + offs_w0[:, None] * stride_bk + (wcols + N_OUT)[None, :] * stride_bn,
                mask=w_ok0[:, None],
                other=0.0,
            )
    if GDC:
        gdc_wait()  # activations, scales of a and the residual are written by earlier kernels
        gdc_launch_dependents()
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    rows = tl.where(m_ok, offs_m, 0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GEMV:
        acc2 = tl.zeros((BLOCK_K, BLOCK_N * BLOCK_M), dtype=tl.float32)
        acc2_up = tl.zeros((BLOCK_K, BLOCK_N * BLOCK_M), dtype=tl.float32)
    if EARLY and GEMV:
        acc2, acc2_up = _gemv_step(
            acc2, acc2_up, a_ptr, stride_am, stride_ak, rows_j, m_ok_j, offs_k0, k_ok0, w0, w0_up, k_lo, n0, N_OUT,
            sa_ptr, sb_ptr, stride_sam, stride_sbk, stride_sbn, A_SCALE, B_SCALE, GATED_EPI,
        )  # fmt: skip
    elif EARLY:  # the first weight tile, loaded above before the wait, meets its activations
        a = tl.load(
            a_ptr + rows[:, None] * stride_am + offs_k0[None, :] * stride_ak,
            mask=m_ok[:, None] & k_ok0[None, :],
            other=0.0,
        )
        acc, acc_up = _step(
            acc, acc_up, a, w0, w0_up, k_lo, rows, m_ok, cols, N_OUT, sa_ptr, sb_ptr, stride_sam, stride_sbk,
            stride_sbn, BLOCK_M, BLOCK_N, A_SCALE, B_SCALE, GATED_EPI, COMPUTE, MMA,
        )  # fmt: skip
    for k0 in range(k_lo + EARLY * BLOCK_K, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        offs_wk = k0 + offs_w
        w_ok = offs_wk < K
        if not GEMV:
            a = tl.load(
                a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                mask=m_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
        w = tl.load(b_ptr + offs_wk[:, None] * stride_bk + wcols[None, :] * stride_bn, mask=w_ok[:, None], other=0.0)
        w_up = w
        if GATED_EPI:
            w_up = tl.load(
                b_ptr + offs_wk[:, None] * stride_bk + (wcols + N_OUT)[None, :] * stride_bn,
                mask=w_ok[:, None],
                other=0.0,
            )
        if GEMV:
            acc2, acc2_up = _gemv_step(
                acc2, acc2_up, a_ptr, stride_am, stride_ak, rows_j, m_ok_j, offs_k, k_ok, w, w_up, k0, n0, N_OUT,
                sa_ptr, sb_ptr, stride_sam, stride_sbk, stride_sbn, A_SCALE, B_SCALE, GATED_EPI,
            )  # fmt: skip
        else:
            acc, acc_up = _step(
                acc, acc_up, a, w, w_up, k0, rows, m_ok, cols, N_OUT, sa_ptr, sb_ptr, stride_sam, stride_sbk,
                stride_sbn, BLOCK_M, BLOCK_N, A_SCALE, B_SCALE, GATED_EPI, COMPUTE, MMA,
            )  # fmt: skip
    if GEMV:  # the reduction over K, once, as the [BLOCK_M, BLOCK_N] tile the epilogues take
        acc = _gemv_rows(acc2, BLOCK_N, BLOCK_M)
        if GATED_EPI:
            acc_up = _gemv_rows(acc2_up, BLOCK_N, BLOCK_M)
    if SPLIT:
        # fp32 partials [SPLIT_K, M, N]; _splitk_reduce sums them in split order and finishes
        N_FULL = N_OUT * 2 if GATED_EPI else N_OUT
        ws = ws_ptr + pid_k * M * N_FULL + offs_m[:, None] * N_FULL + offs_n[None, :]
        tl.store(ws, acc, mask=m_ok[:, None] & n_ok[None, :])
        if GATED_EPI:
            tl.store(ws + N_OUT, acc_up, mask=m_ok[:, None] & n_ok[None, :])
    else:  # block / group scales were applied per tile: _finish applies the others
        _finish(
            acc,
            acc_up,
            offs_m,
            offs_n,
            M,
            N_OUT,
            out_ptr,
            stride_om,
            bias_ptr,
            res_ptr,
            stride_rm,
            sa_ptr,
            sb_ptr,
            A_SCALE if A_SCALE != 3 else 0,
            B_SCALE if B_SCALE != 3 else 0,
            HAS_BIAS,
            EPILOGUE,
        )


@triton.jit(do_not_specialize=["M"])
def _splitk_reduce(
    ws_ptr,
    out_ptr,
    bias_ptr,
    res_ptr,
    sa_ptr,
    sb_ptr,
    M,
    N_OUT,
    stride_om,
    stride_rm,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    A_SCALE: tl.constexpr,
    B_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,
    GDC: tl.constexpr,
):
    """Sum the split-K partials in split order (deterministic), then ``_finish``."""
    GATED_EPI: tl.constexpr = EPILOGUE == 1 or EPILOGUE == 2
    N_FULL = N_OUT * 2 if GATED_EPI else N_OUT
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N_OUT)[None, :]
    if GDC:
        gdc_wait()  # the partials are the previous kernel's
        gdc_launch_dependents()
    ptrs = ws_ptr + offs_m[:, None] * N_FULL + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(ptrs + s * M * N_FULL, mask=mask, other=0.0)
        if GATED_EPI:
            acc_up += tl.load(ptrs + s * M * N_FULL + N_OUT, mask=mask, other=0.0)
    _finish(
        acc,
        acc_up,
        offs_m,
        offs_n,
        M,
        N_OUT,
        out_ptr,
        stride_om,
        bias_ptr,
        res_ptr,
        stride_rm,
        sa_ptr,
        sb_ptr,
        A_SCALE,
        B_SCALE,
        HAS_BIAS,
        EPILOGUE,
    )


# ------------------------------------------------------------------------------------------------
# launch
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _device_facts(index: int) -> tuple[str, int]:
    if not torch.cuda.is_available():
        return "", 132
    props = torch.cuda.get_device_properties(index)
    return props.name, props.multi_processor_count


def _gemv_scales_fit(block_n: int, n_out: int, gated: bool, b_kind: Optional[str]) -> bool:
    """Whether the GEMV form's one block scale per tile is exact: with 128 x 128 block-scaled weights every column
    tile must lie inside one 128-column block (``block_n`` divides 128), the up columns of a gated epilogue
    (``n_out`` further on) too (``n_out`` a multiple of ``block_n``)."""
    if b_kind != "block":
        return True
    return SCALE_BLOCK % block_n == 0 and (not gated or n_out % block_n == 0)


def launch(args: GemmArgs, config: GemmConfig, pdl: bool = False) -> torch.Tensor:
    """Run ``args`` with ``config`` (any ``M``; ``M > MAX_M`` runs several M tiles). ``pdl``: launch with
    Programmatic Dependent Launch (the kernels wait before reading anything an earlier kernel writes)."""
    a, b = args.a, args.b
    M, N, K, n_out = args.M, args.N, args.K, args.n_out
    out = torch.empty((M, n_out), dtype=args.result_dtype, device=a.device)
    if M == 0 or n_out == 0:
        return out
    if K == 0:  # an empty product: the epilogue of zeros (bias, scales) as the reference defines it
        return reference(args)
    a_kind, b_kind = args.a_scale_kind, args.b_scale_kind
    epi = _EPILOGUE[args.epilogue]
    if b_kind == "block" or a_kind == "group":
        bk = min(config.block_k, SCALE_BLOCK)
        while SCALE_BLOCK % bk:
            bk //= 2
        config = GemmConfig(**{**config.to_json(), "block_k": bk})
    if not config.mma and M > FMA_MAX_M:
        config = GemmConfig(**{**config.to_json(), "mma": True})
    if config.gemv and (config.mma or not _gemv_scales_fit(config.block_n, n_out, args.epilogue in GATED, b_kind)):
        config = GemmConfig(**{**config.to_json(), "gemv": False})
    block_m = _block_m(M, config.mma)
    m_tiles = cdiv(M, block_m)
    n_tiles = cdiv(n_out, config.block_n)
    k_tiles = cdiv(K, config.block_k)
    split = max(1, min(config.split_k, k_tiles))
    k_split = cdiv(k_tiles, split) * config.block_k
    split = cdiv(K, k_split)
    gdc = has_gdc()
    esize = b.element_size()
    # L2 prefetch: rows of b contiguous along K (an nn.Linear weight's b = W.t()), 16-byte aligned row starts.
    prefetch = (
        config.prefetch
        and gdc
        and b.stride(0) == 1
        and (b.stride(1) * esize) % 16 == 0
        and b.data_ptr() % 16 == 0
        and (k_split * esize) % 16 == 0
    )
    pf_bytes = 0
    if prefetch:
        cols = n_out * (2 if args.epilogue in GATED else 1)
        pf_bytes = min(k_split * esize, PREFETCH_BUDGET // max(1, cols * split), PREFETCH_CHUNK * PREFETCH_CHUNKS)
        pf_bytes = pf_bytes // 16 * 16
        prefetch = pf_bytes >= 16
    ws = out
    if split > 1:
        ws = torch.empty((split, M, N), dtype=torch.float32, device=a.device)
    dummy = out
    # per-row / per-column scales are read as [M] / [N] vectors: contiguous (a no-op for the usual ones);
    # group / block scales are read through their strides (a checkpoint's block scales enter transposed)
    sa = args.a_scale if args.a_scale is not None else dummy
    sb = args.b_scale if args.b_scale is not None else dummy
    sa = sa.contiguous() if a_kind == "row" else sa
    sb = sb.contiguous() if b_kind == "column" else sb
    res = args.residual if args.residual is not None else dummy
    bias = args.bias if args.bias is not None else dummy
    compute = tl.float16 if a.dtype == torch.float16 else tl.bfloat16  # FP8 converts exactly to either
    if _INTERPRET:
        compute = tl.float32
    stride_sam = sa.stride(0) if a_kind == "group" else 0
    stride_sbk, stride_sbn = (sb.stride(0), sb.stride(1)) if b_kind == "block" else (0, 0)
    extra = {"launch_pdl": True} if (pdl and gdc) else {}
    launcher(_gemm_kernel)[(m_tiles, n_tiles, split)](
        a,
        b,
        out,
        ws,
        bias,
        res,
        sa,
        sb,
        M,
        K,
        n_out,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        res.stride(0) if args.residual is not None else 0,
        stride_sam,
        stride_sbk,
        stride_sbn,
        k_split,
        pf_bytes,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SPLIT=split > 1,
        A_SCALE=_A_SCALE[a_kind],
        B_SCALE=_B_SCALE[b_kind],
        HAS_BIAS=args.bias is not None,
        EPILOGUE=epi,
        PREFETCH=prefetch,
        PF_CHUNK=PREFETCH_CHUNK,
        PF_NCHUNK=PREFETCH_CHUNKS,
        GDC=gdc,
        COMPUTE=compute,
        ESIZE=esize,
        MMA=config.mma,
        EARLY=int(config.early),
        GEMV=config.gemv,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **extra,
    )
    if split > 1:
        rbn = 64
        # Our own second kernel: PDL between the two is always safe (it waits for the partials).
        chain = {"launch_pdl": True} if gdc else {}
        launcher(_splitk_reduce)[(m_tiles, cdiv(n_out, rbn))](
            ws,
            out,
            bias,
            res,
            sa,
            sb,
            M,
            n_out,
            out.stride(0),
            res.stride(0) if args.residual is not None else 0,
            SPLIT_K=split,
            BLOCK_M=block_m,
            BLOCK_N=rbn,
            A_SCALE=_A_SCALE[a_kind] if a_kind != "group" else 0,
            B_SCALE=_B_SCALE[b_kind] if b_kind != "block" else 0,
            HAS_BIAS=args.bias is not None,
            EPILOGUE=epi,
            GDC=gdc,
            num_warps=4,
            num_stages=1,
            **chain,
        )
    return out


def fallback(args: GemmArgs) -> torch.Tensor:
    """cuBLAS for a call our kernel does not take (``M > MAX_M``, or the table says cuBLAS is faster), with the
    epilogue in the same number of kernels Inductor gives the lowered ATen form: a residual is added by
    cuBLAS itself (``addmm``'s beta) or one add, a gated epilogue is one pass (``_splitk_reduce`` over the
    product), so a graph with a symbolic M is no slower at prefill than without rubin."""
    if args.epilogue == "none":
        return aten(args)
    if args.epilogue == "residual_add":
        if not args.fp8 and args.bias is None:
            return torch.addmm(args.residual, args.a, args.b)
        return aten(replace(args, epilogue="none", residual=None)).add_(args.residual)
    y = aten(replace(args, epilogue="none"))
    M, n_out = args.M, args.n_out
    out = torch.empty((M, n_out), dtype=y.dtype, device=y.device)
    if M == 0 or n_out == 0 or _INTERPRET:
        return apply_epilogue(y, args.epilogue, None)
    block_m, block_n = 16, 64
    launcher(_splitk_reduce)[(cdiv(M, block_m), cdiv(n_out, block_n))](
        y,
        out,
        out,
        out,
        out,
        out,
        M,
        n_out,
        out.stride(0),
        0,
        SPLIT_K=1,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        A_SCALE=0,
        B_SCALE=0,
        HAS_BIAS=False,
        EPILOGUE=_EPILOGUE[args.epilogue],
        GDC=False,
        num_warps=4,
        num_stages=1,
    )
    return out


def run(args: GemmArgs, launch_settings: Launch = Launch(), choice: Optional[Choice] = None) -> torch.Tensor:
    """``rubin.gemm`` on this GPU: our kernel where the tuned table (or, off the table, the heuristic) says it
    beats cuBLAS for this (N, K, weight format, M), cuBLAS (``fallback``) elsewhere -- decided per call, so a
    graph with a symbolic M runs each size on the faster kernel."""
    if choice is None:
        name, sms = _device_facts(args.a.device.index or 0) if args.a.is_cuda else ("", 132)
        choice = choose(args.M, args.N, args.K, weight_format(args), name, sms)
    if choice.kernel != "triton":
        return fallback(args)
    return launch(args, choice.config, pdl=launch_settings.pdl)


def flops_and_bytes(M: int, N: int, K: int, wfmt: str, act_bytes: int = 2) -> tuple[float, float]:
    """(FLOPs, bytes moved at the floor: weights + activations in + output) of one call."""
    return 2.0 * M * N * K, weight_bytes(N, K, wfmt) + act_bytes * M * (K + N)
