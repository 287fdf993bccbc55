"""The ``torch`` kernel: PyTorch's own CUDA kernels where they are the best available.

* GEMM, BF16 / FP16: ``torch.mm`` (cuBLAS / cuBLASLt) on every CUDA target.
* GEMM, FP8 per-tensor: ``torch._scaled_mm`` (cuBLASLt FP8) where the target has FP8 tensor cores.
  Its block-scaled and FP4 modes are not declared here: which of them torch 2.11-2.14 accepts on which
  architecture is decided in ATen's CUDA sources, which we have not checked (so they are not claimed).
* Attention, BF16 / FP16: ``torch.nn.functional.scaled_dot_product_attention`` (flash / efficient /
  cuDNN backends); SDPA has no FP8 KV cache.

The adapters are the ops' ATen forms (``ops/gemm.py:aten``: ``torch.mm`` / ``torch.addmm`` /
``torch._scaled_mm`` and the epilogue) and, for attention, the op's reference (SDPA in the op's layout); on a
GPU they run the kernels named above. select_kernels lowers nodes bound to ``torch`` back into the ATen ops
(so Inductor fuses the epilogue and picks its own GEMM templates and SDPA backend, as it would without rubin).
"""

from __future__ import annotations

from typing import Optional

from rubin_compile.ops import attention, gemm
from rubin_compile.ops.registry import QUANT_LABELS, KernelSpec
from rubin_compile.target import Target

_HALF = ("bfloat16", "float16")
_FP8_ACTS = ("float8_e4m3fn", "float8_e5m2")  # W8A8: torch._scaled_mm
_GEMM_ENTRY = {"none": "torch.mm (cuBLAS)", "fp8_tensor": "torch._scaled_mm (cuBLASLt FP8)"}


def _runnable(target: Target) -> Optional[str]:
    return None if target.is_cuda else f"target {target.name} has no CUDA GPU"


def _gemm_supports(target: Target, spec: KernelSpec) -> Optional[str]:
    if not target.is_cuda:
        return f"target {target.name} has no CUDA GPU"
    if spec.act_dtype not in _HALF + _FP8_ACTS:
        return f"activations in {spec.act_dtype} are not supported ({', '.join(_HALF + _FP8_ACTS)})"
    if spec.quant == "none":
        return None if spec.act_dtype in _HALF else f"FP8 activations with {spec.weight_dtype} weights"
    if spec.quant in ("fp8_tensor", "fp8_rowwise") and not spec.act_dtype.startswith("float8"):
        return (
            f"weight-only FP8 ({spec.act_dtype} activations): torch has no such GEMM (torch._scaled_mm takes FP8 "
            "activations; the op's ATen form dequantises the weight in float32 on every call)"
        )
    if spec.quant == "fp8_tensor":
        return None if target.fp8 else f"{target.name} has no FP8 tensor cores (torch._scaled_mm)"
    return f"torch has no {QUANT_LABELS[spec.quant]} GEMM declared here (torch.mm / _scaled_mm per-tensor only)"


def _attention_supports(target: Target, spec: KernelSpec) -> Optional[str]:
    if not target.is_cuda:
        return f"target {target.name} has no CUDA GPU"
    if spec.quant != "none":
        return f"SDPA has no {QUANT_LABELS[spec.quant]} KV cache"
    if spec.act_dtype not in _HALF:
        return f"activations in {spec.act_dtype} are not supported ({', '.join(_HALF)})"
    return None


gemm.GEMM.register_kernel(
    "torch",
    supports=_gemm_supports,
    priority={"*": 30},
    runnable=_runnable,
    entry=lambda spec: _GEMM_ENTRY.get(spec.quant, ""),
    module=__name__,
)(gemm.aten)
attention.ATTENTION.register_kernel(
    "torch",
    supports=_attention_supports,
    priority={"*": 30},
    runnable=_runnable,
    entry=lambda spec: (
        "torch.nn.functional.scaled_dot_product_attention"
        + (
            " (with sinks: matmul -> softmax -> matmul, as the model writes it)"
            if attention.SINKS in spec.features
            else ""
        )
    ),
    module=__name__,
    features=(attention.SINKS,),
)(attention.reference)
