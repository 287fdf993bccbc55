"""Adapters from ``rubin.gemm`` to FlashInfer 0.7.2's GEMMs (flashinfer/gemm/gemm_base.py).

``rubin.gemm`` takes ``a`` [M, K] and ``b`` [K, N] (an ``nn.Linear`` weight W [N, K] as its free view ``W.t()``,
i.e. column-major), bias, an epilogue and FP8 / FP4 scales (ops/gemm.py). What each FlashInfer entry point wants:

* ``mm_bf16`` / ``bmm_fp8`` / ``mm_fp4``: ``b`` [K, N] column-major, which is ``W.t()`` itself; ``mm_fp8``,
  ``gemm_fp8_nt_groupwise`` and ``fp8_blockscale_gemm_sm90`` take the weight row-major [N, K], i.e. ``b.t()``.
  Where ``b`` is not such a view of a contiguous weight, ``prepare`` makes the contiguous copy once.
* Scales: per-tensor FP8 kernels take one fp32 scale per operand (or their product ``alpha``, made per call on
  the GPU: no host sync); block-scaled kernels take the 128 x 128 scales of ``b`` and 1 x 128 group scales of
  ``a`` in the layout each names (below); FP4 kernels take 128x4-swizzled block scales
  (``_swizzle_128x4``), built from rubin's linear scales in ``prepare``.
* Epilogues: FlashInfer's GEMMs have none of rubin's (SiLU-and-mul, GELU-tanh-and-mul, residual add), and most
  no bias; every adapter runs what the kernel does not in torch on the kernel's output, in the output dtype,
  as ops/gemm.py's reference does (``apply_epilogue``). A fused bias is passed where the kernel takes one
  (``mm_bf16`` cuDNN / CuTe-DSL). A bias added after the kernel rounds twice where the reference (``addmm``,
  or its float32 accumulator for FP8) rounds once: within bf16 tolerance, and what eager code that adds the
  bias after ``mm`` does.
* FP4 (W4A4): the kernels multiply FP4 x FP4, so the activation is quantised per call with FlashInfer's
  ``fp4_quantize`` custom op (``torch.ops.flashinfer.fp4_quantize``: it has a fake kernel, so the call builds
  on meta tensors too). NVFP4 needs a global activation scale: the static ``a_scale`` (ModelOpt
  ``input_scale``, dequantising, so ``fp4_quantize`` gets its reciprocal) when given, otherwise one computed
  on the GPU from ``a.abs().amax()`` (dynamic per-tensor, at least as accurate as a calibrated one, and
  capturable: no host sync). rubin's semantics is weight-only (the reference does not quantise ``a``): these
  kernels are accepted at FP4 tolerance.
* Weight-only FP8 (bf16 / fp16 ``a``, FP8 ``b``; what ``rubin.dequantize`` folds into): FlashInfer's FP8 GEMMs
  multiply FP8 x FP8 (except DeepGEMM's, which quantises a bf16 ``a`` itself), so the adapter quantises ``a``
  per call on the GPU, dynamically: one e4m3 scale per tensor (``amax / 448``) for the per-tensor kernels, one
  per 1 x 128 group for the groupwise ones (what vLLM's dynamic FP8 does); no host sync, capturable. Accepted at
  FP8 tolerance (rubin's semantics keeps ``a`` unquantised; the GPU tests state the bound).
* Output dtype: FlashInfer's FP8 / FP4 GEMMs write bf16 (some fp16); a W8A8 call asking for float32 fails
  ``check`` (the spec has no output dtype to reject it earlier).

Entries without an adapter here stay plans only; the reasons are at the end of this module.
"""

from __future__ import annotations

from typing import Optional

import torch

from rubin_compile.kernels.flashinfer.adapter import FP8, Adapter, Call, register, require
from rubin_compile.kernels.flashinfer.tables import resolve
from rubin_compile.ops.gemm import SCALE_BLOCK, GemmArgs, apply_epilogue
from rubin_compile.ops.registry import KernelSpec, Launch
from rubin_compile.target import Target

_FP8_NAMES = ("float8_e4m3fn", "float8_e5m2")
FP4_AMAX = 448.0 * 6.0  # e4m3 max x e2m1 max: the NVFP4 global-scale recipe (ModelOpt, fp4_quantize's docstring)
SF_ROWS, SF_COLS = 128, 4  # FlashInfer's 128x4 scale-factor layout (SfLayout.layout_128x4)


def _ceil(n: int, m: int) -> int:
    return -(-n // m) * m


# ------------------------------------------------------------------------------------------------
# shared pieces
# ------------------------------------------------------------------------------------------------


def _finish(args: GemmArgs, bias_fused: bool = False, rows: Optional[int] = None):
    """The canonical result from a kernel's ``out``: the batch dimension dropped, padded rows sliced off, then
    the bias (unless the kernel added it) and the epilogue in the output dtype."""

    def finish(out: torch.Tensor) -> torch.Tensor:
        y = out.reshape(out.shape[-2], out.shape[-1])
        if rows is not None:
            y = y[:rows]
        if args.bias is not None and not bias_fused:
            y = y + args.bias
        return apply_epilogue(y, args.epilogue, args.residual)

    return finish


def _column_major(b: torch.Tensor) -> torch.Tensor:
    """``b`` [K, N] as the column-major view of a contiguous [N, K] weight (``b`` itself when it already is)."""
    return b if b.t().is_contiguous() else b.t().contiguous().t()


def _needs_copy(b: torch.Tensor) -> bool:
    return not b.t().is_contiguous()


def _w8a8(spec: KernelSpec, what: str) -> Optional[str]:
    """W8A8 takes FP8 ``a``; weight-only FP8 takes bf16 / fp16 ``a``, quantised per call (``_fp8_activation``)."""
    if spec.act_dtype not in _FP8_NAMES + ("bfloat16", "float16"):
        return f"{what} multiplies FP8 x FP8: activations in {spec.act_dtype} are not supported (FP8, bf16, fp16)"
    return None


E4M3_MAX = 448.0


def _fp8_activation(args: GemmArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` in e4m3 with its per-tensor fp32 scale [1]: as given (W8A8), or quantised here from a bf16 / fp16
    ``a`` with ``scale = amax / 448`` (dynamic, on the GPU)."""
    if args.w8a8:
        return args.a.contiguous(), _scalar(args.a_scale)
    a = args.a.to(torch.float32)
    scale = (a.abs().amax() / E4M3_MAX).clamp(min=1e-12).reshape(1)
    return (a / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).contiguous(), scale


def _fp8_activation_groups(args: GemmArgs, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` in e4m3 with zero rows up to a multiple of ``multiple``, and its 1 x 128 group scales
    ``[ceil(K/128), rows]`` M-major (padding 1.0): rubin's W8A8 ``a_scale`` expanded, or, for a bf16 / fp16 ``a``,
    quantised here per group (dynamic)."""
    M, K = args.a.shape
    rows = _ceil(M, multiple)
    if args.w8a8:
        return _pad_rows(args.a.contiguous(), multiple), _group_scales(args, rows)
    kb = -(-K // SCALE_BLOCK)
    a = torch.nn.functional.pad(args.a.to(torch.float32), (0, kb * SCALE_BLOCK - K, 0, rows - M))
    groups = a.reshape(rows, kb, SCALE_BLOCK)
    scale = (groups.abs().amax(dim=-1) / E4M3_MAX).clamp(min=1e-12)  # [rows, kb]
    q = (groups / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).reshape(rows, kb * SCALE_BLOCK)[:, :K]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.t().contiguous()


def _acts(spec: KernelSpec, *dtypes: str) -> Optional[str]:
    if spec.act_dtype not in dtypes:
        return f"activations in {spec.act_dtype} are not supported ({', '.join(dtypes)})"
    return None


def _shape(spec: KernelSpec, **multiples: int) -> Optional[str]:
    for name, multiple in multiples.items():
        value = spec.dim(name)
        if value is not None and value % multiple:
            return f"shape limit: {name}={value} must be a multiple of {multiple}"
    return None


def _scalar(scale: torch.Tensor) -> torch.Tensor:
    """A one-element fp32 scale as a [1] tensor (a view; no copy, no host sync)."""
    return scale.reshape(1)


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """``x`` with zero rows appended up to a multiple of ``multiple`` (``x`` itself when it is one)."""
    rows = x.shape[0]
    if rows % multiple == 0:
        return x
    return torch.nn.functional.pad(x, (0, 0, 0, _ceil(rows, multiple) - rows))


def _group_scales(args: GemmArgs, rows: int) -> torch.Tensor:
    """rubin's ``a_scale`` (per tensor, per row or per 128-column group) as group scales ``[ceil(K/128), rows]``,
    one per 1 x 128 group of ``a``, M-major (``rows`` >= M; the padding is 1.0). Per call, on the GPU."""
    kb = -(-args.K // SCALE_BLOCK)
    kind = args.a_scale_kind
    src = args.a_scale.reshape(1, 1) if kind == "tensor" else args.a_scale.t()  # [1, 1], [1, M] or [kb, M]
    out = args.a_scale.new_ones((kb, rows))
    out[:, : args.M] = src.expand(kb, args.M)
    return out


# ------------------------------------------------------------------------------------------------
# BF16: mm_bf16 (cuDNN on sm_80+, CUTLASS and CuTe-DSL on sm_100+)
# ------------------------------------------------------------------------------------------------


class _ColumnMajorB(Adapter):
    """An entry point that takes ``b`` [K, N] column-major: ``W.t()`` itself; any other ``b`` is copied once."""

    def sources(self, args: GemmArgs):
        return (args.b,) if _needs_copy(args.b) else ()

    def prepare(self, args: GemmArgs) -> dict[str, torch.Tensor]:
        return {"b": _column_major(args.b)}

    def prepared_bytes(self, args: GemmArgs) -> int:
        return args.b.numel() * args.b.element_size() if _needs_copy(args.b) else 0


class _MmBf16(_ColumnMajorB):
    """``mm_bf16(a, b, bias, pdl, out_dtype=bf16, backend=...)``: ``a`` [M, K] bf16, ``b`` [K, N] bf16
    (its docstring: column-major). _check_mm_bf16_problem_size takes bf16 only (fp16 / fp32 go elsewhere)."""

    function = "flashinfer.gemm.mm_bf16"
    backend = ""
    fused_bias = False  # the backend takes bias
    takes_pdl = False  # the backend honours pdl (TGV / TinyGEMM / CuTe-DSL per mm_bf16's docstring)

    def supports(self, target: Target, spec: KernelSpec) -> Optional[str]:
        return _acts(spec, "bfloat16")

    def call(self, args: GemmArgs, prepared: dict[str, torch.Tensor], launch: Launch) -> Call:
        b = prepared.get("b", args.b)
        bias = args.bias if self.fused_bias else None
        return Call(
            self.function,
            (args.a.contiguous(), b),
            dict(bias=bias, pdl=bool(launch.pdl) and self.takes_pdl, out_dtype=torch.bfloat16, backend=self.backend),
            _finish(args, bias_fused=bias is not None),
        )

    def check(self, call: Call) -> None:
        a, b = call.args
        bias = call.kwargs["bias"]
        require(
            a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16, self, f"a, b must be bf16 ({a.dtype}, {b.dtype})"
        )
        require(
            a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0], self, f"a {tuple(a.shape)} @ b {tuple(b.shape)}"
        )
        require(a.is_contiguous(), self, "a must be row-major")
        require(b.t().is_contiguous(), self, "b must be column-major (W.t() of a contiguous W)")
        if bias is not None:
            require(
                bias.dtype == torch.bfloat16 and tuple(bias.shape) == (b.shape[1],) and bias.is_contiguous(),
                self,
                f"bias must be contiguous bf16 [{b.shape[1]}], got {bias.dtype} {tuple(bias.shape)}",
            )


@register("gemm", "flashinfer_cudnn", "none")
class CudnnMmBf16(_MmBf16):
    """cuDNN BF16 GEMM (sm_80+; needs nvidia-cudnn-frontend). The bias is fused: _cudnn_gemm_bf16 builds the
    cuDNN graph with it (bias_is_not_none); ``pdl`` is not honoured by cuDNN (mm_bf16's docstring)."""

    name = "mm_bf16[cudnn]"
    tested_on = ("H200",)  # tests/gpu/test_flashinfer_*.py passed there (benchmarks/results/flashinfer-h200.log)
    backend = "cudnn"
    fused_bias = True


@register("gemm", "flashinfer_cutlass", "none")
class CutlassMmBf16(_MmBf16):
    """CUTLASS BF16 GEMM (sm_100 / 103 / 107): _cutlass_mm_bf16_requirement refuses a bias and PDL, so the bias
    is added after the kernel."""

    name = "mm_bf16[cutlass]"
    backend = "cutlass"

    def check(self, call: Call) -> None:
        super().check(call)
        require(call.kwargs["bias"] is None and not call.kwargs["pdl"], self, "CUTLASS takes no bias / pdl")


@register("gemm", "flashinfer_cutedsl", "none")
class CuteDslMmBf16(_MmBf16):
    """CuTe-DSL low-M BF16 GEMM (sm_100 / 103 / 107; cuBLASLt above M = 32): bias fused, PDL honoured
    (_cute_dsl_mm_bf16_requirement: row-major a, column-major b, contiguous [N] bias, bf16 out)."""

    name = "mm_bf16[cute-dsl]"
    backend = "cute-dsl"
    fused_bias = True
    takes_pdl = True


# ------------------------------------------------------------------------------------------------
# FP8 per tensor (W8A8): bmm_fp8 (cuBLAS sm_89+, CuTe-DSL sm_107), mm_fp8 (cuDNN, CUTLASS, trtllm low latency)
# ------------------------------------------------------------------------------------------------


class _BmmFp8(_ColumnMajorB):
    """``bmm_fp8(A [1, M, K], B [1, K, N] column-major, A_scale, B_scale, dtype, backend=...)``: per-tensor
    W8A8 (one fp32 scale per operand, read by pointer: flashinfer/data/csrc/bmm_fp8.cu), bf16 / fp16 out
    (_check_bmm_fp8_problem_size). The batch of one is a view."""

    function = "flashinfer.gemm.bmm_fp8"
    backend = ""
    m_multiple = 1  # rows of A padded to this (zero rows, sliced off in finish)

    def supports(self, target: Target, spec: KernelSpec) -> Optional[str]:
        return _w8a8(spec, f"bmm_fp8(backend={self.backend!r})")

    def call(self, args: GemmArgs, prepared: dict[str, torch.Tensor], launch: Launch) -> Call:
        b = prepared.get("b", args.b)
        a, a_scale = _fp8_activation(args)
        a = _pad_rows(a, self.m_multiple)
        return Call(
            self.function,
            (a.unsqueeze(0), b.unsqueeze(0), a_scale, _scalar(args.b_scale), args.result_dtype),
            dict(backend=self.backend),
            _finish(args, rows=args.M if a.shape[0] != args.M else None),
        )

    def check(self, call: Call) -> None:
        A, B, sa, sb, dtype = call.args
        require(A.dtype in FP8 and B.dtype in FP8, self, f"A and B must be FP8, got {A.dtype} and {B.dtype}")
        require(
            A.dim() == 3 and B.dim() == 3 and A.shape[2] == B.shape[1], self, f"A {tuple(A.shape)} @ B {tuple(B.shape)}"
        )
        require(A.is_contiguous(), self, "A must be row-major [1, M, K]")
        require(B.transpose(-2, -1).is_contiguous(), self, "B must be column-major [1, K, N]")
        for name, s in (("A_scale", sa), ("B_scale", sb)):
            require(
                s.dtype == torch.float32 and s.numel() == 1,
                self,
                f"{name} must be one fp32 value, got {s.dtype} {tuple(s.shape)}",
            )
        require(dtype in (torch.bfloat16, torch.float16), self, f"output dtype must be bf16 / fp16, not {dtype}")
        if self.m_multiple > 1:
            require(A.shape[1] % self.m_multiple == 0, self, f"M={A.shape[1]} must be a multiple of {self.m_multiple}")


@register("gemm", "flashinfer_cublas", "fp8_tensor")
class CublasBmmFp8(_BmmFp8):
    """cuBLASLt FP8 GEMM (sm_89+): the W8A8 per-tensor GEMM that runs on the H200."""

    name = "bmm_fp8[cublas]"
    tested_on = ("H200",)  # tests/gpu/test_flashinfer_*.py passed there (benchmarks/results/flashinfer-h200.log)
    backend = "cublas"


@register("gemm", "flashinfer_cutedsl", "fp8_tensor")
class CuteDslBmmFp8(_BmmFp8):
    """The Rubin FP8 BMM (CuTe-DSL, sm_107 only: _cute_dsl_bmm_fp8_requirement). It wants M, N, K multiples of
    16 and A, B of one dtype; a decode M is padded to 16 rows per call (a copy of ``a``: <= 15 zero rows) so
    any M runs, N and K are the table's rule."""

    name = "bmm_fp8[cute-dsl]"
    backend = "cute-dsl"
    m_multiple = 16

    def check(self, call: Call) -> None:
        super().check(call)
        A, B = call.args[:2]
        require(A.dtype == B.dtype, self, f"A and B must share one FP8 dtype ({A.dtype}, {B.dtype})")
        require(
            B.shape[2] % 16 == 0 and A.shape[2] % 16 == 0,
            self,
            f"N={B.shape[2]}, K={A.shape[2]} must be multiples of 16",
        )


class _MmFp8(Adapter):
    """``mm_fp8(a [M, K], b, alpha, out_dtype=bf16, backend=...)``: per-tensor W8A8 with one output scale
    ``alpha = a_scale * b_scale`` (made per call on the GPU); bf16 out only (mm_fp8's supported_out_dtypes).
    cuDNN / CUTLASS take the unprocessed weight [N, K] row-major (_check_mm_fp8_unprocessed_weight), which is
    ``b.t()``."""

    function = "flashinfer.gemm.mm_fp8"
    backend = ""

    def supports(self, target: Target, spec: KernelSpec) -> Optional[str]:
        return _w8a8(spec, f"mm_fp8(backend={self.backend!r})")

    def sources(self, args: GemmArgs):
        return (args.b,) if _needs_copy(args.b) else ()

    def prepare(self, args: GemmArgs) -> dict[str, torch.Tensor]:
        return {"w": _column_major(args.b).t()}

    def prepared_bytes(self, args: GemmArgs) -> int:
        return args.b.numel() * args.b.element_size() if _needs_copy(args.b) else 0

    def weight(self, args: GemmArgs, prepared: dict[str, torch.Tensor]) -> torch.Tensor:
        return prepared["w"] if "w" in prepared else args.b.t()

    def call(self, args: GemmArgs, prepared: dict[str, torch.Tensor], launch: Launch) -> Call:
        a, a_scale = _fp8_activation(args)
        return Call(
            self.function,
            (a, self.weight(args, prepared), (a_scale * args.b_scale.reshape(1)).to(torch.float32)),
            dict(out_dtype=args.result_dtype, backend=self.backend),
            _finish(args),
        )

    def check(self, call: Call) -> None:
        a, w, alpha = call.args
        require(a.dtype in FP8 and w.dtype in FP8, self, f"a and the weight must be FP8, got {a.dtype} and {w.dtype}")
        require(alpha.dtype == torch.float32 and alpha.numel() == 1, self, "alpha must be one fp32 value")
        require(
            call.kwargs["out_dtype"] == torch.bfloat16, self, f"mm_fp8 writes bf16 only, not {call.kwargs['out_dtype']}"
        )
        require(a.dim() == 2 and a.is_contiguous(), self, "a must be a contiguous [M, K]")
        self.check_weight(a, w)

    def check_weight(self, a: torch.Tensor, w: torch.Tensor) -> None:
        require(
            w.dim() == 2 and w.shape[1] == a.shape[1] and w.is_contiguous(),
            self,
            f"the weight must be a contiguous [N, K={a.shape[1]}], got {tuple(w.shape)}",
        )


@register("gemm", "flashinfer_cudnn", "fp8_tensor")
class CudnnMmFp8(_MmFp8):
    """cuDNN FP8 GEMM (sm_89+; needs nvidia-cudnn-frontend)."""

    name = "mm_fp8[cudnn]"
    tested_on = ("H200",)  # tests/gpu/test_flashinfer_*.py passed there (benchmarks/results/flashinfer-h200.log)
    backend = "cudnn"


@register("gemm", "flashinfer_cutlass", "fp8_tensor")
class CutlassMmFp8(_MmFp8):
    """CUTLASS FP8 GEMM (sm_100+): e4m3 only (_cutlass_mm_fp8_requirement)."""

    name = "mm_fp8[cutlass]"
    backend = "cutlass"

    def supports(self, target: Target, spec: KernelSpec) -> Optional[str]:
        reason = super().supports(target, spec)
        if reason is None and "float8_e5m2" in (spec.act_dtype, spec.weight_dtype):
            reason = "e5m2 is not supported for mm_fp8 with the cutlass backend"
        return reason

    def check(self, call: Call) -> None:
        super().check(call)
        a, w = call.args[:2]
        require(a.dtype == w.dtype == torch.float8_e4m3fn, self, "CUTLASS mm_fp8 takes e4m3 only")


@register("gemm", "flashinfer_trtllm", "fp8_tensor")
class TrtllmMmFp8(_MmFp8):
    """trtllm-gen low-latency FP8 GEMM (sm_100 / 103 / 107): the weight shuffled and in block layout
    [K/128, N, 128] by FlashInfer's ``prepare_low_latency_gemm_weights`` (pure torch indexing: it runs on meta
    tensors too). e4m3 only; K a multiple of 128 (the block layout) and N of 32 (the row shuffle's blocks,
    get_shuffle_matrix_a_row_indices with epilogue_tile_m = 128)."""

    name = "mm_fp8[trtllm_low_latency]"
    backend = "trtllm_low_latency"

    def __init__(self) -> None:
        self._permutations: dict = {}  # prepare_low_latency_gemm_weights' permutation-index cache

    def supports(self, target: Target, spec: KernelSpec) -> Optional[str]:
        return (
            super().supports(target, spec)
            or (None if spec.weight_dtype == "float8_e4m3fn" else "trtllm low-latency FP8 takes e4m3 weights only")
            or _shape(spec, K=128, N=32)
        )

    def sources(self, args: GemmArgs):
        return (args.b,)

    def prepare(self, args: GemmArgs) -> dict[str, torch.Tensor]:
        prep = resolve("flashinfer.trtllm_low_latency_gemm.prepare_low_latency_gemm_weights")
        return {"w": prep(args.b.t().contiguous(), self._permutations)}

    def prepared_bytes(self, args: GemmArgs) -> int:
        return args.b.numel() * args.b.element_size()

    def check_weight(self, a: torch.Tensor, w: torch.Tensor) -> None:
        require(a.dtype == w.dtype == torch.float8_e4m3fn, self, "trtllm low-latency FP8 takes e4m3 only")
        require(
            w.dim() == 3 and w.shape[2] == 128 and w.shape[0] * 128 == a.shape[1] and w.is_contiguous(),
            self,
            f"the weight must be prepare_low_latency_gemm_weights' [K/128, N, 128], got {tuple(w.shape)}",
        )


# ------------------------------------------------------------------------------------------------
# FP8 128 x 128 blocks: fp8_blockscale_gemm_sm90 (DeepGEMM, Hopper), gemm_fp8_nt_groupwise (Blackwell)
# ------------------------------------------------------------------------------------------------


# Where DeepGEMM is chosen over our Triton GEMM (kernels/triton/gemm.py) for weight-only FP8 block weights, from
# benchmarks/results/flashinfer-h200.md (H200, both through rubin.gemm, CUDA-graph replays): at M >= 128 DeepGEMM
# took 8.5-52 us where ours took 28-301 us (3.3-6.6x); at M = 1 and 16 it was faster on the two weights of >= 12M
# elements (N=6144 K=4096: 11.7 vs 14.1 us; N=7168 K=2048: 8.8 vs 11.3) and slower on the two of 8.4M (N=4096
# K=2048: 7.84 vs 7.63; N=2048 K=4096: 10.1 vs 8.0). A symbolic M (prefill and decode in one graph) takes DeepGEMM:
# at most 1.26x slower at decode, 3-6x faster at prefill. W8A8 block was not measured against ours: not chosen.
DEEPGEMM_MIN_SMALL_M_WEIGHT = 12_000_000  # N * K elements from which DeepGEMM beats ours at M <= 64


def _deepgemm_measured(spec: KernelSpec) -> Optional[str]:
    if spec.act_dtype != "bfloat16":
        return (
            "W8A8 block FP8 on DeepGEMM is not measured against our Triton W8A8 GEMM on the H200, so selection does "
            "not choose it (force it with options={'kernels': {'gemm': 'flashinfer_deepgemm'}})"
        )
    M, N, K = spec.dim("M"), spec.dim("N"), spec.dim("K")
    if M is not None and M <= 64 and N is not None and K is not None and N * K < DEEPGEMM_MIN_SMALL_M_WEIGHT:
        return (
            f"M={M} with a weight of {N * K / 1e6:.1f}M elements: our Triton GEMM measured faster here on the H200 "
            "(benchmarks/results/flashinfer-h200.md)"
        )
    return None


@register("gemm", "flashinfer_deepgemm", "fp8_block")
class DeepGemmFp8Block(Adapter):
    """``fp8_blockscale_gemm_sm90(input [M, K], weight [N, K], input_scale, weight_scale, out_dtype=bf16)``:
    TensorRT-LLM's DeepGEMM-based block-scaled FP8 GEMM, sm_90 only (it checks ``_match_sm_version(["90"])``).

    * Weight-only (bf16 ``a``): the kernel quantises ``a`` itself per 1 x 128 group (scale_1x128_kernel), so the
      result is W8A8-accurate, not the reference's bf16 activations: FP8 tolerance.
    * W8A8 (FP8 e4m3 ``a``): ``input_scale`` is read by pointer in the layout the kernel's own quantiser writes
      (fp8_blockscale_gemm_kernel.cuh:scale_1x128_kernel, ``scales[k_block * ceil4(M) + m]``): M-major
      [ceil(K/128), ceil4(M)], not the [M, K/128] its docstring shows. rubin's ``a_scale`` (per tensor, row or
      group) is laid out so per call (``_group_scales``).
    * ``weight_scale``: 128 x 128 block scales [ceil(N/128), K/128] (the binding's is_per_block shape), i.e.
      rubin's block ``b_scale`` [ceil(K/128), ceil(N/128)] transposed: made contiguous in ``prepare``.
      The weight [N, K] row-major is ``b.t()`` (copied in ``prepare`` only where it is not contiguous).
    * Limits (its checks): K % 128 == 0, N % 64 == 0, e4m3 only, bf16 output (the binding writes bf16 whatever
      ``out`` is), bf16 activations for weight-only.
    """

    name = "fp8_blockscale_gemm_sm90"
    function = "flashinfer.gemm.fp8_blockscale_gemm_sm90"
    tested_on = ("H200",)

    def supports(self, target: Target, spec: KernelSpec) -> Optional[str]:
        if spec.act_dtype not in ("bfloat16", "float8_e4m3fn"):
            return f"fp8_blockscale_gemm_sm90 takes bf16 or e4m3 activations, not {spec.act_dtype}"
        if spec.weight_dtype != "float8_e4m3fn":
            return f"fp8_blockscale_gemm_sm90 takes e4m3 weights, not {spec.weight_dtype}"
        reason = _shape(spec, K=SCALE_BLOCK, N=64)
        if reason:
            return reason
        return _deepgemm_measured(spec)

    def sources(self, args: GemmArgs):
        return (args.b, args.b_scale)

    def prepare(self, args: GemmArgs) -> dict[str, torch.Tensor]:
        return {"w": args.b.t().contiguous(), "w_scale": args.b_scale.t().contiguous()}

    def prepared_bytes(self, args: GemmArgs) -> int:
        copy = args.b.numel() * args.b.element_size() if _needs_copy(args.b) else 0
        return copy + args.b_scale.numel() * args.b_scale.element_size()

    def call(self, args: GemmArgs, prepared: dict[str, torch.Tensor], launch: Launch) -> Call:
        a_scale = _group_scales(args, _ceil(args.M, 4)) if args.w8a8 else None
        return Call(
            self.function,
            (args.a.contiguous(), prepared["w"], a_scale, prepared["w_scale"]),
            dict(out_dtype=torch.bfloat16),
            _finish(args),
        )

    def check(self, call: Call) -> None:
        a, w, sa, sw = call.args
        M, K = a.shape
        N = w.shape[0]
        require(call.kwargs["out_dtype"] == torch.bfloat16, self, "the kernel writes bf16 only")
        require(a.is_contiguous() and w.is_contiguous(), self, "input [M, K] and weight [N, K] must be row-major")
        require(w.dim() == 2 and w.shape[1] == K, self, f"weight must be [N, K={K}], got {tuple(w.shape)}")
        require(K % SCALE_BLOCK == 0 and N % 64 == 0, self, f"K={K} must be a multiple of 128 and N={N} of 64")
        require(w.dtype == torch.float8_e4m3fn, self, f"weight must be e4m3, got {w.dtype}")
        require(
            sw.dtype == torch.float32 and tuple(sw.shape) == (-(-N // SCALE_BLOCK), K // SCALE_BLOCK),
            self,
            f"weight_scale must be fp32 [ceil(N/128), K/128], got {sw.dtype} {tuple(sw.shape)}",
        )
        if a.dtype == torch.bfloat16:
            require(sa is None, self, "bf16 input takes no input_scale")
        else:
            require(a.dtype == torch.float8_e4m3fn, self, f"input must be bf16 or e4m3, got {a.dtype}")
            require(
                sa is not None and sa.dtype == torch.float32 and tuple(sa.shape) == (K // SCALE_BLOCK, _ceil(M, 4)),
                self,
                f"input_scale must be fp32 [K/128, ceil4(M)] (M-major), got {None if sa is None else tuple(sa.shape)}",
            )
            require(sa.is_contiguous(), self, "input_scale must be contiguous")


class _GroupwiseFp8(Adapter):
    """``gemm_fp8_nt_groupwise(a [M, K], b [N, K], a_scale, b_scale, scale_major_mode, ...,
    scale_granularity_mnk=(1, 128, 128), out_dtype, backend)``: W8A8 with 1 x 128 groups of ``a`` and
    128 x 128 blocks of ``b`` (Blackwell). rubin's ``a_scale`` of any kind is expanded to groups per call; the
    kernel wants M padded to a multiple of 4 (its docstring's Notes), so ``a`` is padded per call (zero rows,
    sliced off). Weight-only FP8 (bf16 ``a``) is not what it takes. Output bf16 / fp16 (common check)."""

    function = "flashinfer.gemm.gemm_fp8_nt_groupwise"
    backend = ""

    def supports(self, target: Target, spec: KernelSpec) -> Optional[str]:
        return _w8a8(spec, f"gemm_fp8_nt_groupwise(backend={self.backend!r})") or _shape(spec, K=128, N=128)

    def sources(self, args: GemmArgs):
        return (args.b, args.b_scale)

    def prepared_bytes(self, args: GemmArgs) -> int:
        copy = args.b.numel() * args.b.element_size() if _needs_copy(args.b) else 0
        return copy + args.b_scale.numel() * args.b_scale.element_size()

    def call(self, args: GemmArgs, prepared: dict[str, torch.Tensor], launch: Launch) -> Call:
        a, groups = _fp8_activation_groups(args, 4)
        return Call(
            self.function,
            (a, prepared["w"], self.a_scale(groups), prepared["w_scale"]),
            dict(
                scale_major_mode=self.scale_major_mode,
                scale_granularity_mnk=(1, SCALE_BLOCK, SCALE_BLOCK),
                out_dtype=args.result_dtype,
                backend=self.backend,
            ),
            _finish(args, rows=args.M if a.shape[0] != args.M else None),
        )

    def check(self, call: Call) -> None:
        a, w, sa, sw = call.args
        M, K = a.shape
        N = w.shape[0]
        require(a.dtype in FP8 and w.dtype in FP8, self, f"a and b must be FP8, got {a.dtype} and {w.dtype}")
        require(a.is_contiguous() and w.is_contiguous() and w.shape[1] == K, self, "a [M, K] and b [N, K] row-major")
        require(M % 4 == 0, self, f"M={M} must be padded to a multiple of 4")
        require(K % 128 == 0 and N % 128 == 0, self, f"K={K} and N={N} must be multiples of 128")
        require(call.kwargs["out_dtype"] in (torch.bfloat16, torch.float16), self, "output must be bf16 / fp16")
        require(sa.dtype == torch.float32 and sw.dtype == torch.float32, self, "scales must be fp32")
        self.check_scales(M, N, K, sa, sw)


@register("gemm", "flashinfer_cutlass", "fp8_block")
class CutlassGroupwiseFp8(_GroupwiseFp8):
    """CUTLASS (sm_100 / 103 / 107 / 120): scale_major_mode="MN": a_scale [K/128, M] and b_scale
    [K/128, N/128] row-major (gemm_fp8_nt_groupwise's docstring), which is rubin's block ``b_scale`` as is."""

    name = "gemm_fp8_nt_groupwise[cutlass]"
    backend = "cutlass"
    scale_major_mode = "MN"

    def prepare(self, args: GemmArgs) -> dict[str, torch.Tensor]:
        return {"w": args.b.t().contiguous(), "w_scale": args.b_scale.contiguous()}

    def a_scale(self, groups: torch.Tensor) -> torch.Tensor:
        return groups  # [K/128, M] row-major

    def check_scales(self, M, N, K, sa, sw) -> None:
        require(
            tuple(sa.shape) == (K // 128, M) and sa.is_contiguous(),
            self,
            f"a_scale must be [K/128, M], got {tuple(sa.shape)}",
        )
        require(
            tuple(sw.shape) == (K // 128, N // 128) and sw.is_contiguous(),
            self,
            f"b_scale must be [K/128, N/128] row-major, got {tuple(sw.shape)}",
        )


@register("gemm", "flashinfer_trtllm", "fp8_block")
class TrtllmGroupwiseFp8(_GroupwiseFp8):
    """trtllm-gen (sm_100 / 103 / 107): scale_major_mode=None; a_scale (M, K/128) and b_scale (K/128, N/128)
    "contiguous on the first dimension" (gemm_fp8_nt_groupwise's docstring), i.e. column-major views; K >= 256
    (_trtllm_gemm_fp8_nt_groupwise_requirement)."""

    name = "gemm_fp8_nt_groupwise[trtllm]"
    backend = "trtllm"
    scale_major_mode = None

    def supports(self, target: Target, spec: KernelSpec) -> Optional[str]:
        reason = super().supports(target, spec)
        k = spec.dim("K")
        return reason or (f"shape limit: K={k} must be >= 256 (trtllm)" if k is not None and k < 256 else None)

    def prepare(self, args: GemmArgs) -> dict[str, torch.Tensor]:
        return {"w": args.b.t().contiguous(), "w_scale": args.b_scale.t().contiguous().t()}

    def a_scale(self, groups: torch.Tensor) -> torch.Tensor:
        return groups.t()  # (M, K/128), contiguous along M

    def check_scales(self, M, N, K, sa, sw) -> None:
        require(K >= 256, self, f"K={K} must be >= 256")
        require(
            tuple(sa.shape) == (M, K // 128) and sa.t().is_contiguous(),
            self,
            f"a_scale must be (M, K/128) contiguous along M, got {tuple(sa.shape)} strides {sa.stride()}",
        )
        require(
            tuple(sw.shape) == (K // 128, N // 128) and sw.t().is_contiguous(),
            self,
            f"b_scale must be (K/128, N/128) contiguous along K, got {tuple(sw.shape)} strides {sw.stride()}",
        )


# ------------------------------------------------------------------------------------------------
# FP4 (W4A4): mm_fp4 (CUTLASS, cuDNN, trtllm-gen, CuTe-DSL)
# ------------------------------------------------------------------------------------------------


def _swizzle_128x4(sf: torch.Tensor) -> torch.Tensor:
    """Linear block scales [R, C] (one byte each) in FlashInfer's 128x4 layout, [ceil128(R), ceil4(C)] (the
    shape ``fp4_quantize`` returns its swizzled scales in; padding zero). Within each 128-row x 4-column tile,
    byte ``(r % 32) * 16 + (r % 128 // 32) * 4 + c % 4``; tiles row-block major, then column block. This is
    ``block_scale_interleave``'s layout (flashinfer/quantization/fp4_quantization.py), which is a GPU kernel
    and cannot run on meta tensors or in ``prepare`` on the CPU: the same permutation in torch ops; the GPU
    test compares the two."""
    rows, cols = sf.shape
    rp, cp = _ceil(rows, SF_ROWS), _ceil(cols, SF_COLS)
    padded = sf.new_zeros((rp, cp))
    padded[:rows, :cols] = sf
    tiles = padded.reshape(
        rp // SF_ROWS, 4, 32, cp // SF_COLS, SF_COLS
    )  # (row block, r/32 % 4, r % 32, col block, c % 4)
    return tiles.permute(0, 3, 2, 1, 4).reshape(rp, cp).contiguous()


class _MmFp4(Adapter):
    """``mm_fp4(a [M, K/2], b [K/2, N] column-major, a_descale, b_descale, alpha, out_dtype, block_size,
    use_8x4_sf_layout=False, backend, use_nvfp4, enable_pdl)``: FP4 x FP4 with 128x4-swizzled block scales
    (mm_fp4's Notes: both operands quantised with the 128x4 layout, ``do_shuffle=False`` except trtllm's b).

    ``prepare``: the weight W = ``b.t()`` [N, K/2] contiguous, its linear scales (rubin's ``b_scale.t()``,
    [N, K/bs]) swizzled (``_swizzle_128x4``) and passed transposed, [ceil4(K/bs), ceil128(N)].
    ``call``: ``a`` quantised with ``fp4_quantize`` (swizzled scales); NVFP4 ``alpha = a_scale * b_scale_2``
    (the two dequantising global scales; the docstring's ``1 / (a_global_sf * b_global_sf)``), MXFP4 none."""

    function = "flashinfer.gemm.mm_fp4"
    backend = ""
    shuffle = False  # trtllm: weight rows and scale rows shuffled (nvfp4_quantize(do_shuffle=True)'s layout)
    out_dtypes = (torch.bfloat16, torch.float16)

    def supports(self, target: Target, spec: KernelSpec) -> Optional[str]:
        names = tuple(str(d).replace("torch.", "") for d in self.out_dtypes)
        return _acts(spec, *names) or _shape(spec, K=32)

    def sources(self, args: GemmArgs):
        return (args.b, args.b_scale)

    def prepare(self, args: GemmArgs) -> dict[str, torch.Tensor]:
        w = args.b.t().contiguous()  # [N, K/2] uint8
        sf = args.b_scale.t().contiguous().view(torch.uint8)  # [N, K/bs] linear
        if self.shuffle:
            # nvfp4_quantize(do_shuffle=True): shuffle_matrix_a on the weight (pure torch indexing) and
            # shuffle_matrix_sf_a on the linear scales = the same row shuffle, then block_scale_interleave.
            w = resolve("flashinfer.quantization.fp4_quantization.shuffle_matrix_a")(w, 128)
            rows = resolve("flashinfer.utils.get_shuffle_matrix_sf_a_row_indices")(sf, 128)
            sf = sf[rows.to(sf.device)]
        return {"w": w, "w_sf": _swizzle_128x4(sf)}

    def prepared_bytes(self, args: GemmArgs) -> int:
        N, kb = args.b_scale.shape[1], args.b_scale.shape[0]
        return args.b.numel() + _ceil(N, SF_ROWS) * _ceil(kb, SF_COLS)

    def call(self, args: GemmArgs, prepared: dict[str, torch.Tensor], launch: Launch) -> Call:
        nvfp4 = args.b_scale.dtype == torch.float8_e4m3fn
        a = args.a.contiguous()
        quantize = torch.ops.flashinfer.fp4_quantize
        if nvfp4:
            if args.a_scale is not None:  # static (ModelOpt input_scale): dequantising
                a_deq = args.a_scale.reshape(1).to(torch.float32)
            else:  # dynamic per-tensor, on the GPU
                a_deq = (
                    (a.abs().amax().to(torch.float32) / FP4_AMAX).clamp(min=torch.finfo(torch.float32).tiny).reshape(1)
                )
            a_fp4, a_sf = quantize(a, 1.0 / a_deq, 16, False, True, False, bool(launch.pdl))
            b_scale_2 = getattr(args, "b_scale_2", None)
            alpha = a_deq * b_scale_2.reshape(1).to(torch.float32) if b_scale_2 is not None else a_deq
        else:
            a_fp4, a_sf = quantize(a, None, 32, True, True, False, bool(launch.pdl))
            alpha = None
        return Call(
            self.function,
            (a_fp4, prepared["w"].t(), a_sf, prepared["w_sf"].t(), alpha, args.result_dtype),
            dict(
                block_size=16 if nvfp4 else 32,
                use_8x4_sf_layout=False,
                backend=self.backend,
                use_nvfp4=nvfp4,
                enable_pdl=bool(launch.pdl),
            ),
            _finish(args),
        )

    def check(self, call: Call) -> None:
        a, b, a_sf, b_sf, alpha, out_dtype = call.args
        nvfp4 = call.kwargs["use_nvfp4"]
        bs = call.kwargs["block_size"]
        M, K2 = a.shape
        N = b.shape[1]
        require(
            a.dtype == torch.uint8 and b.dtype == torch.uint8,
            self,
            f"a, b must be packed FP4 uint8 ({a.dtype}, {b.dtype})",
        )
        require(b.shape[0] == K2, self, f"a [M, K/2={K2}] and b [K/2={b.shape[0]}, N] disagree")
        require(b.t().is_contiguous(), self, "b must be column-major (W.t() of a contiguous [N, K/2])")
        require(bs == (16 if nvfp4 else 32), self, f"block_size {bs} for use_nvfp4={nvfp4}")
        require(out_dtype in self.out_dtypes, self, f"output dtype must be one of {self.out_dtypes}, not {out_dtype}")
        kb = _ceil(2 * K2 // bs, SF_COLS)
        require(
            tuple(a_sf.shape) == (_ceil(M, SF_ROWS), kb) and a_sf.dtype in (torch.uint8, torch.float8_e4m3fn),
            self,
            f"a_descale must be 128x4-swizzled [{_ceil(M, SF_ROWS)}, {kb}], got {a_sf.dtype} {tuple(a_sf.shape)}",
        )
        require(
            tuple(b_sf.shape) == (kb, _ceil(N, SF_ROWS)) and b_sf.dtype in (torch.uint8, torch.float8_e4m3fn),
            self,
            f"b_descale must be the 128x4-swizzled [{kb}, {_ceil(N, SF_ROWS)}] (transposed), got {tuple(b_sf.shape)}",
        )
        if nvfp4:
            require(
                alpha is not None and alpha.dtype == torch.float32 and alpha.numel() == 1, self, "NVFP4 alpha: one fp32"
            )
        else:
            require(alpha is None, self, "MXFP4 takes no alpha")


@register("gemm", "flashinfer_cutlass", "nvfp4")
class CutlassMmFp4(_MmFp4):
    """CUTLASS NVFP4 GEMM (sm_100+; MXFP4 refused by _cutlass_gemm_fp4_requirement)."""

    name = "mm_fp4[cutlass]"
    backend = "cutlass"


@register("gemm", "flashinfer_cudnn", "nvfp4", "mxfp4")
class CudnnMmFp4(_MmFp4):
    """cuDNN FP4 GEMM, NVFP4 and MXFP4 (sm_100+; cuDNN frontend >= 1.13, backend >= 9.10.2)."""

    name = "mm_fp4[cudnn]"
    backend = "cudnn"


@register("gemm", "flashinfer_trtllm", "nvfp4")
class TrtllmMmFp4(_MmFp4):
    """trtllm-gen NVFP4 GEMM (sm_100 / 103 / 107): bf16 out only; b's rows and scale rows shuffled for
    epilogue_tile_m = 128, which needs N % 128 == 0 (get_shuffle_matrix_sf_a_row_indices asserts it)."""

    name = "mm_fp4[trtllm]"
    backend = "trtllm"
    shuffle = True
    out_dtypes = (torch.bfloat16,)

    def supports(self, target: Target, spec: KernelSpec) -> Optional[str]:
        return super().supports(target, spec) or _shape(spec, N=128)

    def check(self, call: Call) -> None:
        super().check(call)
        require(call.args[1].shape[1] % 128 == 0, self, f"N={call.args[1].shape[1]} must be a multiple of 128")


@register("gemm", "flashinfer_cutedsl", "nvfp4", "mxfp4")
class CuteDslMmFp4(_MmFp4):
    """CuTe-DSL FP4 GEMM, NVFP4 and MXFP4 (sm_100 / 103 / 107; the Rubin NVFP4 GEMM): 128x4 scales, N % 8 == 0
    (_cute_dsl_gemm_fp4_requirement; the table's rule), PDL honoured."""

    name = "mm_fp4[cute-dsl]"
    backend = "cute-dsl"

    def check(self, call: Call) -> None:
        super().check(call)
        require(call.args[1].shape[1] % 8 == 0, self, f"N={call.args[1].shape[1]} must be a multiple of 8")


# Plan only (tables.GEMM entries without an adapter): none at present. Every entry of tables.GEMM has one.
