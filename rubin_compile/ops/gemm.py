"""The canonical matrix-product op, ``torch.ops.rubin.gemm``: a linear layer with its epilogue.

Every linear-layer idiom the matchers recognise (``aten.mm`` / ``aten.addmm`` against a weight, FP8
``aten._scaled_mm``, each with an optional bias, SiLU-and-mul or residual add after it) is rewritten into
this one functional op; kernel selection then binds it to a kernel (``GEMM``, the op's entry in
ops/registry.py). Its reference implementation below *is* the semantics.

Schema::

    rubin::gemm(Tensor a,                 # [M, K]  bf16 / fp16 / fp32 / fp64, or FP8 (e4m3 / e5m2)
                Tensor b,                 # [K, N]  a's dtype (FP8 with FP8 a); any strides: an nn.Linear
                                          #         weight W [N, K] enters as its free view W.t()
                Tensor? bias=None,        # [N]     a's dtype; the output dtype for FP8
                str epilogue="none",      # "none" | "silu_and_mul" | "gelu_tanh_and_mul" | "residual_add"
                Tensor? residual=None,    # [M, N]  output dtype; exactly with epilogue="residual_add"
                Tensor? a_scale=None,     # FP8 only, float32: per tensor ([] / [1] / [1, 1]) or per row [M, 1]
                Tensor? b_scale=None,     # FP8 only, float32: per tensor, or per output column [1, N]
                ScalarType? out_dtype=None,  # FP8: required (bf16 / fp16 / fp32); otherwise None or a's dtype
                str impl="reference")     # which kernel runs it; chosen by select_kernels
      -> Tensor                           # [M, N], or [M, N / 2] for the gated epilogues

Semantics::

    y = a @ b + bias                                                   # unquantised: torch.addmm / torch.mm
    y = ((a.float() * a_scale) @ (b.float() * b_scale) + bias).to(out_dtype)   # FP8: torch._scaled_mm's
    out = y                                        # epilogue "none"
    out = silu(y[:, :N/2]) * y[:, N/2:]            # "silu_and_mul": gate columns first, then up (vLLM's
                                                   #   MergedColumnParallelLinear + SiluAndMul, HF chunk(2))
    out = gelu_tanh(y[:, :N/2]) * y[:, N/2:]       # "gelu_tanh_and_mul" (vLLM GeluAndMul("tanh"), Gemma)
    out = y + residual                             # "residual_add"

Why ``b`` is ``[K, N]`` and not the stored ``[N, K]`` weight: it is what ``aten.mm`` / ``aten._scaled_mm`` take
in the graph (``mm(x, permute(W, [1, 0]))``), so the rewrite passes the very node on and copies nothing, and it
is the convention of the kernels it is bound to (cuBLAS, ``torch._scaled_mm``, FlashInfer's ``mm_bf16`` /
``mm_fp8``: ``b`` ``[k, n]``, column-major); a kernel that wants the weight row-major takes ``b.t()``, again a
view. The matcher's report records whether ``b`` is such a transposed weight (``b_layout``).

Unquantised products run in the input dtype as eager PyTorch does (the bias inside ``addmm``: one rounding;
a graph that added the bias after ``mm`` rounded twice, so bf16 may differ in the last bit); the epilogue
runs on the result in the output dtype, as eager code does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from rubin_compile.errors import RubinError
from rubin_compile.ops.moe import apply_activation
from rubin_compile.ops.nodes import FLOAT_DTYPES, FP8_DTYPES, bound_arguments, tensor_val, val_dtype
from rubin_compile.ops.registry import CanonicalOp, KernelSpec, Launch

EPILOGUES = ("none", "silu_and_mul", "gelu_tanh_and_mul", "residual_add")
GATED = {"silu_and_mul": "silu", "gelu_tanh_and_mul": "gelu_tanh"}  # epilogue -> rubin.moe activation name
FP8_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class GemmArgumentError(RubinError, ValueError):
    """Raised when the arguments of ``rubin.gemm`` do not describe a valid GEMM call."""


def _fail(msg: str) -> None:
    raise GemmArgumentError(f"rubin.gemm: {msg}")


def _known(*sizes) -> bool:
    return all(isinstance(s, int) for s in sizes)


def scale_kind(scale: torch.Tensor, rows: Any, operand: str) -> Optional[str]:
    """``"tensor"`` for a one-element scale, ``"row"`` for ``a_scale`` [M, 1] / ``"column"`` for ``b_scale``
    [1, N]; None for anything else. ``rows`` is M (for a) or N (for b)."""
    if _known(*scale.shape) and scale.numel() == 1:
        return "tensor"
    shape = tuple(scale.shape)
    want = (rows, 1) if operand == "a" else (1, rows)
    if len(shape) == 2 and all(not _known(h, w) or h == w for h, w in zip(shape, want)):
        return "row" if operand == "a" else "column"
    return None


@dataclass(frozen=True)
class GemmArgs:
    """The data arguments of one ``rubin.gemm`` call (the schema's, in its order, without ``impl``), validated
    when built; ``M, N, K``, the output width ``n_out`` and the output dtype are read off them. Errors name the
    argument and the fix (``GemmArgumentError``). Works on fake tensors with symbolic sizes (unknown sizes are
    not checked: a check would add a guard)."""

    a: torch.Tensor
    b: torch.Tensor
    bias: Optional[torch.Tensor] = None
    epilogue: str = "none"
    residual: Optional[torch.Tensor] = None
    a_scale: Optional[torch.Tensor] = None
    b_scale: Optional[torch.Tensor] = None
    out_dtype: Optional[torch.dtype] = None
    M: Any = field(init=False)
    N: Any = field(init=False)
    K: Any = field(init=False)
    n_out: Any = field(init=False)
    result_dtype: torch.dtype = field(init=False)

    def __post_init__(self) -> None:
        for name, value in zip(("M", "N", "K", "n_out", "result_dtype"), _validate(self)):
            object.__setattr__(self, name, value)

    @property
    def fp8(self) -> bool:
        return self.a.dtype in FP8_DTYPES


def _validate(g: GemmArgs) -> tuple:
    """(M, N, K, N_out, output dtype) of valid arguments; ``GemmArgumentError`` otherwise."""
    a, b, bias, residual, epilogue = g.a, g.b, g.bias, g.residual, g.epilogue
    if epilogue not in EPILOGUES:
        _fail(f"epilogue={epilogue!r} is not supported; use one of {EPILOGUES}")
    if a.dim() != 2 or b.dim() != 2:
        _fail(f"a must be [M, K] and b [K, N]; got {tuple(a.shape)} and {tuple(b.shape)} (flatten leading dims)")
    M, K = a.shape
    Kb, N = b.shape
    if _known(K, Kb) and K != Kb:
        _fail(f"a is [M, K={K}] but b is [K={Kb}, N]; an nn.Linear weight [N, K] is passed as weight.t()")
    quantized = a.dtype in FP8_DTYPES
    if quantized:
        if b.dtype not in FP8_DTYPES:
            _fail(f"a is {a.dtype} but b is {b.dtype}; FP8 GEMMs take FP8 a and b")
        if g.a_scale is None or g.b_scale is None:
            _fail("FP8 a and b need a_scale and b_scale")
        for name, s in (("a_scale", g.a_scale), ("b_scale", g.b_scale)):
            if s.dtype != torch.float32:
                _fail(f"{name} must be float32, got {s.dtype}")
        if scale_kind(g.a_scale, M, "a") is None:
            _fail(f"a_scale must be per tensor ([]) or per row ([M={M}, 1]); got {tuple(g.a_scale.shape)}")
        if scale_kind(g.b_scale, N, "b") is None:
            _fail(f"b_scale must be per tensor ([]) or per column ([1, N={N}]); got {tuple(g.b_scale.shape)}")
        if g.out_dtype not in FP8_OUT_DTYPES:
            _fail(f"FP8 GEMMs need out_dtype in {FP8_OUT_DTYPES}, got {g.out_dtype}")
        result_dtype = g.out_dtype
    else:
        if a.dtype not in FLOAT_DTYPES:
            _fail(f"a dtype {a.dtype} is not one of bf16 / fp16 / fp32 / fp64 / FP8")
        if b.dtype != a.dtype:
            _fail(f"a ({a.dtype}) and b ({b.dtype}) must have one dtype; cast before the call")
        if g.a_scale is not None or g.b_scale is not None:
            _fail("a_scale / b_scale are only for FP8 a and b")
        if g.out_dtype not in (None, a.dtype):
            _fail(f"out_dtype {g.out_dtype} differs from a's dtype {a.dtype}; only FP8 GEMMs change dtype")
        result_dtype = a.dtype
    if bias is not None:
        want = result_dtype if quantized else a.dtype
        if bias.dim() != 1 or (_known(bias.shape[0], N) and bias.shape[0] != N):
            _fail(f"bias must be [N={N}], got {tuple(bias.shape)}")
        if bias.dtype != want:
            _fail(f"bias dtype {bias.dtype} must be {want}")
    n_out = N
    if epilogue in GATED:
        if _known(N) and N % 2:
            _fail(f"epilogue {epilogue!r} needs an even N (gate columns, then up columns); N={N}")
        n_out = N // 2
    if (residual is not None) != (epilogue == "residual_add"):
        _fail("residual is given exactly when epilogue='residual_add'")
    if residual is not None:
        if residual.dim() != 2 or not all(not _known(h, w) or h == w for h, w in zip(residual.shape, (M, N))):
            _fail(f"residual must be [M, N] = {(M, N)}, got {tuple(residual.shape)}")
        if residual.dtype != result_dtype:
            _fail(f"residual dtype {residual.dtype} must be the output dtype {result_dtype}")
    return M, N, K, n_out, result_dtype


# ------------------------------------------------------------------------------------------------
# the semantics, and the ATen form
# ------------------------------------------------------------------------------------------------


def apply_epilogue(y: torch.Tensor, epilogue: str, residual: Optional[torch.Tensor]) -> torch.Tensor:
    """The epilogue of ``rubin.gemm`` on the product ``y`` (in the output dtype, as eager code does)."""
    if epilogue in GATED:
        return apply_activation(y, GATED[epilogue]).contiguous()
    if epilogue == "residual_add":
        return y + residual
    return y


def reference(args: GemmArgs, launch: Launch = Launch()) -> torch.Tensor:
    """Plain PyTorch semantics of ``rubin.gemm`` (see the module docstring); any device.

    FP8 is dequantised and multiplied in float32 (what ``torch._scaled_mm`` computes, and it runs on every
    device), then rounded once to ``out_dtype``.
    """
    a, b, bias = args.a, args.b, args.bias
    if args.fp8:
        sa = args.a_scale.reshape(-1, 1) if args.a_scale.numel() != 1 else args.a_scale.reshape(())
        sb = args.b_scale.reshape(1, -1) if args.b_scale.numel() != 1 else args.b_scale.reshape(())
        acc = (a.to(torch.float32) * sa) @ (b.to(torch.float32) * sb)
        if bias is not None:
            acc = acc + bias.to(torch.float32)
        y = acc.to(args.result_dtype)
    else:
        y = torch.addmm(bias, a, b) if bias is not None else torch.mm(a, b)
    return apply_epilogue(y, args.epilogue, args.residual)


def gemm_reference(*args, **kwargs) -> torch.Tensor:
    """``reference`` called like the op (its data arguments, positionally or by name)."""
    return reference(GemmArgs(*args, **kwargs))


def aten(args: GemmArgs, launch: Launch = Launch()) -> torch.Tensor:
    """``rubin.gemm`` as the ATen ops the source graph had: ``mm`` / ``addmm``, FP8 ``_scaled_mm`` (cuBLASLt
    FP8 on a GPU), then the epilogue. The ``torch`` kernel runs this; select_kernels lowers a node bound to
    ``torch`` or ``reference`` back into these ops, so Inductor compiles and fuses them as it would have
    without rubin (the FP8 result is ``_scaled_mm``'s: within FP8 tolerance of the float32 reference)."""
    a, b, bias = args.a, args.b, args.bias
    if args.fp8:
        y = torch._scaled_mm(a, b, scale_a=args.a_scale, scale_b=args.b_scale, bias=bias, out_dtype=args.result_dtype)
    else:
        y = torch.addmm(bias, a, b) if bias is not None else torch.mm(a, b)
    return apply_epilogue(y, args.epilogue, args.residual)


def gemm_aten(*args, **kwargs) -> torch.Tensor:
    """``aten`` called like the op: the op's ATen form, which select_kernels traces into the graph."""
    return aten(GemmArgs(*args, **kwargs))


# ------------------------------------------------------------------------------------------------
# the op
# ------------------------------------------------------------------------------------------------


@torch.library.custom_op("rubin::gemm", mutates_args=())
def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    epilogue: str = "none",
    residual: Optional[torch.Tensor] = None,
    a_scale: Optional[torch.Tensor] = None,
    b_scale: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    impl: str = "reference",
) -> torch.Tensor:
    """Canonical GEMM; see the module docstring. ``impl`` names the kernel (ops/registry.py)."""
    return GEMM.run(impl, GemmArgs(a, b, bias, epilogue, residual, a_scale, b_scale, out_dtype))


@gemm.register_fake
def _gemm_fake(
    a, b, bias=None, epilogue="none", residual=None, a_scale=None, b_scale=None, out_dtype=None, impl="reference"
):
    args = GemmArgs(a, b, bias, epilogue, residual, a_scale, b_scale, out_dtype)
    return a.new_empty((args.M, args.n_out), dtype=args.result_dtype)


# ------------------------------------------------------------------------------------------------
# what kernel selection knows of a rubin.gemm node
# ------------------------------------------------------------------------------------------------


def quantization(node: torch.fx.Node) -> str:
    """``"none"``, ``"fp8_tensor"`` (one scale each for a and b) or ``"fp8_rowwise"`` (per-token a scales
    and / or per-channel b scales) for a ``rubin.gemm`` node."""
    args = bound_arguments(node)
    a, sa, sb = tensor_val(args["a"]), tensor_val(args["a_scale"]), tensor_val(args["b_scale"])
    if a is None or a.dtype not in FP8_DTYPES:
        return "none"
    if sa is not None and sb is not None and sa.numel() == 1 and sb.numel() == 1:
        return "fp8_tensor"
    return "fp8_rowwise"


def gemm_spec(node: torch.fx.Node) -> KernelSpec:
    """The ``KernelSpec`` of a ``rubin.gemm`` node.

    ``quant`` is ``"none"``, ``"fp8_tensor"`` or ``"fp8_rowwise"``; ``act_dtype`` / ``weight_dtype`` are a's and
    b's dtypes; ``shape`` holds ``N`` and ``K`` and, when static, ``M``; ``activation`` carries the epilogue
    (``None`` for ``"none"``), so a kernel that cannot fuse it can say so.
    """
    args = bound_arguments(node)
    a, b = tensor_val(args["a"]), tensor_val(args["b"])
    sizes = {
        "M": a.shape[0] if a is not None else None,
        "N": b.shape[1] if b is not None else None,
        "K": b.shape[0] if b is not None else None,
    }
    epilogue = args.get("epilogue", "none")
    return KernelSpec(
        op="gemm",
        quant=quantization(node),
        act_dtype=val_dtype(args["a"]),
        weight_dtype=val_dtype(args["b"]),
        shape=tuple((k, v) for k, v in sizes.items() if isinstance(v, int)),
        activation=None if epilogue == "none" else epilogue,
        node=node.name,
    )


GEMM = CanonicalOp(
    "gemm",
    gemm_spec,
    reference,
    aten_form=gemm_aten,
    aten_label="mm / addmm / _scaled_mm + epilogue",
    example_shape=(("M", 128), ("N", 4096), ("K", 4096)),
)
