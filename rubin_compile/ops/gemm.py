"""The canonical matrix-product op, ``torch.ops.rubin.gemm``: a linear layer with its epilogue.

Every linear-layer idiom the matchers recognise (``aten.mm`` / ``aten.addmm`` against a weight, FP8
``aten._scaled_mm``, each with an optional bias, SiLU-and-mul or residual add after it) is rewritten into
this one functional op; kernel selection then binds it to a kernel (``GEMM``, the op's entry in
ops/registry.py). Its reference implementation below *is* the semantics.

FP8 comes in two forms: **W8A8** (``a`` and ``b`` FP8, as ``torch._scaled_mm`` and vLLM's FP8 linears take
them) and **weight-only FP8** (``a`` bf16 / fp16, ``b`` FP8 with ``b_scale``; the weights are dequantised
inside the kernel, which is what a decode GEMM wants: it reads half the bytes and quantises nothing).
``b_scale`` is one scale, one per output column, or one per 128 x 128 block of ``b`` (``[ceil(K / 128),
ceil(N / 128)]``: the ``weight_scale_inv`` of a block-quantised checkpoint, transposed like the weight);
with block scales a W8A8 ``a_scale`` may be per token and 128-column group (``[M, ceil(K / 128)]``, vLLM's
per-token-group quantisation).

Schema::

    rubin::gemm(Tensor a,                 # [M, K]  bf16 / fp16 / fp32 / fp64, or FP8 (e4m3 / e5m2)
                Tensor b,                 # [K, N]  a's dtype (FP8 with FP8 a); any strides: an nn.Linear
                                          #         weight W [N, K] enters as its free view W.t()
                Tensor? bias=None,        # [N]     a's dtype; the output dtype for FP8
                str epilogue="none",      # "none" | "silu_and_mul" | "gelu_tanh_and_mul" | "residual_add"
                Tensor? residual=None,    # [M, N]  output dtype; exactly with epilogue="residual_add"
                Tensor? a_scale=None,     # FP8 a only, float32: per tensor ([] / [1] / [1, 1]), per row [M, 1],
                                          #   or per row and 128-column group [M, ceil(K/128)] (block b only)
                Tensor? b_scale=None,     # FP8 b only, float32: per tensor, per output column [1, N], or per
                                          #   128 x 128 block [ceil(K/128), ceil(N/128)]
                ScalarType? out_dtype=None,  # W8A8: required (bf16 / fp16 / fp32); otherwise None or a's dtype
                bool pdl=False,           # launch with Programmatic Dependent Launch; set by chain_pdl
                str impl="reference",     # which kernel runs it; chosen by select_kernels
                Tensor? b_scale_2=None)   # NVFP4 b only: its global scale, float32 [] (ModelOpt's weight_scale_2)
      -> Tensor                           # [M, N], or [M, N / 2] for the gated epilogues

Semantics::

    y = a @ b + bias                                                   # unquantised: torch.addmm / torch.mm
    y = ((a.float() * a_scale) @ (b.float() * b_scale) + bias).to(out_dtype)   # FP8: torch._scaled_mm's
                                                   #   (scales broadcast over their rows / columns / blocks;
                                                   #   weight-only FP8: a_scale = 1, out_dtype = a's dtype)
    out = y                                        # epilogue "none"
    out = silu(y[:, :N/2]) * y[:, N/2:]            # "silu_and_mul": gate columns first, then up (vLLM's
                                                   #   MergedColumnParallelLinear + SiluAndMul, HF chunk(2))
    out = gelu_tanh(y[:, :N/2]) * y[:, N/2:]       # "gelu_tanh_and_mul" (vLLM GeluAndMul("tanh"), Gemma)
    out = y + residual                             # "residual_add"

FP4 weights (NVFP4 / MXFP4, packed two e2m1 values per byte along K: ops/fp4.py) take bf16 / fp16 (or fp32) ``a``: ``b`` is
``torch.uint8`` ``[K / 2, N]`` (the stored ``[N, K / 2]`` weight's ``.t()``), ``b_scale`` its block scales as stored
``[N, K / block]`` seen as ``[K / block, N]`` (NVFP4: ``float8_e4m3fn`` per 16, with ``b_scale_2``; MXFP4: uint8 E8M0
per 32). The semantics is weight-only: ``y = (a.float() @ dequantize(b).float() + bias).to(a.dtype)``. ``a_scale``
(float32 ``[]``) may carry the static input scale a checkpoint calibrated (ModelOpt's ``input_scale``) for W4A4
kernels that quantise ``a``; the reference ignores it.

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
from rubin_compile.ops import fp4
from rubin_compile.ops.moe import apply_activation
from rubin_compile.ops.nodes import FLOAT_DTYPES, FP8_DTYPES, bound_arguments, known_sizes, tensor_val, val_dtype
from rubin_compile.ops.registry import CanonicalOp, KernelSpec, Launch
from rubin_compile.ops.library import op

EPILOGUES = ("none", "silu_and_mul", "gelu_tanh_and_mul", "residual_add")
SCALE_BLOCK = 128  # block-scaled FP8: 128 x 128 blocks of b, 1 x 128 groups of a (DeepSeek-V3 / vLLM)
GATED = {"silu_and_mul": "silu", "gelu_tanh_and_mul": "gelu_tanh"}  # epilogue -> rubin.moe activation name
FP8_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class GemmArgumentError(RubinError, ValueError):
    """Raised when the arguments of ``rubin.gemm`` do not describe a valid GEMM call."""


def _fail(msg: str) -> None:
    raise GemmArgumentError(f"rubin.gemm: {msg}")


def _blocks(n: Any) -> Any:
    return -(-n // SCALE_BLOCK) if isinstance(n, int) else None


def scale_kind(scale: torch.Tensor, rows: Any, operand: str, K: Any = None) -> Optional[str]:
    """``"tensor"`` for a one-element scale; for ``a_scale`` ``"row"`` ([M, 1]) or ``"group"`` ([M, ceil(K/128)],
    when ``K`` is given and > 128); for ``b_scale`` ``"column"`` ([1, N]) or ``"block"`` ([ceil(K/128),
    ceil(N/128)], when ``K`` is given); None for anything else. ``rows`` is M (for a) or N (for b)."""
    if known_sizes(*scale.shape) and scale.numel() == 1:
        return "tensor"
    shape = tuple(scale.shape)

    def fits(want) -> bool:
        return len(shape) == 2 and all(not known_sizes(h, w) or h == w for h, w in zip(shape, want))

    if fits((rows, 1) if operand == "a" else (1, rows)):
        return "row" if operand == "a" else "column"
    if K is not None and known_sizes(K):
        if operand == "a" and K > SCALE_BLOCK and fits((rows, _blocks(K))):
            return "group"
        if operand == "b" and known_sizes(rows) and fits((_blocks(K), _blocks(rows))):
            return "block"
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
    b_scale_2: Optional[torch.Tensor] = None
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
        """Any FP8 operand (W8A8, or weight-only FP8 with ``b`` FP8 and ``a`` bf16 / fp16)."""
        return self.b.dtype in FP8_DTYPES

    @property
    def fp4(self) -> Optional[str]:
        """``"nvfp4"`` / ``"mxfp4"`` for FP4 b, else ``None``."""
        return fp4.kind_of(self.b_scale) if self.b.dtype == torch.uint8 else None

    @property
    def w8a8(self) -> bool:
        return self.a.dtype in FP8_DTYPES

    @property
    def b_scale_kind(self) -> Optional[str]:
        """``"tensor"`` / ``"column"`` / ``"block"`` for FP8 b, None otherwise."""
        return scale_kind(self.b_scale, self.N, "b", self.K) if self.b_scale is not None else None

    @property
    def a_scale_kind(self) -> Optional[str]:
        """``"tensor"`` / ``"row"`` / ``"group"`` for FP8 a, None otherwise."""
        return scale_kind(self.a_scale, self.M, "a", self.K) if self.a_scale is not None else None


def _validate(g: GemmArgs) -> tuple:
    """(M, N, K, N_out, output dtype) of valid arguments; ``GemmArgumentError`` otherwise."""
    a, b, bias, residual, epilogue = g.a, g.b, g.bias, g.residual, g.epilogue
    if epilogue not in EPILOGUES:
        _fail(f"epilogue={epilogue!r} is not supported; use one of {EPILOGUES}")
    if a.dim() != 2 or b.dim() != 2:
        _fail(f"a must be [M, K] and b [K, N]; got {tuple(a.shape)} and {tuple(b.shape)} (flatten leading dims)")
    M, K = a.shape
    Kb, N = b.shape
    if b.dtype == torch.uint8:
        return _validate_fp4(g, M, K, N)
    if g.b_scale_2 is not None:
        _fail("b_scale_2 is the global scale of NVFP4 weights; b is not FP4")
    if known_sizes(K, Kb) and K != Kb:
        _fail(f"a is [M, K={K}] but b is [K={Kb}, N]; an nn.Linear weight [N, K] is passed as weight.t()")
    quantized = a.dtype in FP8_DTYPES
    weight_only = not quantized and b.dtype in FP8_DTYPES
    if quantized:
        if b.dtype not in FP8_DTYPES:
            _fail(f"a is {a.dtype} but b is {b.dtype}; FP8 GEMMs take FP8 a and b (or bf16 / fp16 a and FP8 b)")
        if g.a_scale is None or g.b_scale is None:
            _fail("FP8 a and b need a_scale and b_scale")
    elif weight_only:
        if a.dtype not in (torch.bfloat16, torch.float16):
            _fail(f"weight-only FP8 (b {b.dtype}) takes bf16 / fp16 a, got {a.dtype}")
        if g.b_scale is None:
            _fail("FP8 b needs b_scale")
        if g.a_scale is not None:
            _fail(f"a_scale is for FP8 a; a is {a.dtype} (weight-only FP8 takes b_scale alone)")
        if g.out_dtype not in (None, a.dtype):
            _fail(f"weight-only FP8 returns a's dtype {a.dtype}, not out_dtype={g.out_dtype}")
    if quantized or weight_only:
        for name, s in (("a_scale", g.a_scale), ("b_scale", g.b_scale)):
            if s is not None and s.dtype != torch.float32:
                _fail(f"{name} must be float32, got {s.dtype}")
        b_kind = scale_kind(g.b_scale, N, "b", K)
        if b_kind is None:
            _fail(
                f"b_scale must be per tensor ([]), per column ([1, N={N}]) or per 128 x 128 block "
                f"([ceil(K/128)={_blocks(K)}, ceil(N/128)={_blocks(N)}]); got {tuple(g.b_scale.shape)}"
            )
        if quantized:
            a_kind = scale_kind(g.a_scale, M, "a", K)
            if a_kind is None or (a_kind == "group" and b_kind != "block"):
                _fail(
                    f"a_scale must be per tensor ([]) or per row ([M={M}, 1]), or per 128-column group "
                    f"([M, ceil(K/128)={_blocks(K)}]) with block-scaled b; got {tuple(g.a_scale.shape)}"
                )
            if g.out_dtype not in FP8_OUT_DTYPES:
                _fail(f"FP8 GEMMs need out_dtype in {FP8_OUT_DTYPES}, got {g.out_dtype}")
            result_dtype = g.out_dtype
        else:
            result_dtype = a.dtype
    else:
        if a.dtype not in FLOAT_DTYPES:
            _fail(f"a dtype {a.dtype} is not one of bf16 / fp16 / fp32 / fp64 / FP8")
        if b.dtype != a.dtype:
            _fail(f"a ({a.dtype}) and b ({b.dtype}) must have one dtype; cast before the call")
        if g.a_scale is not None or g.b_scale is not None:
            _fail("a_scale / b_scale are only for FP8 operands")
        if g.out_dtype not in (None, a.dtype):
            _fail(f"out_dtype {g.out_dtype} differs from a's dtype {a.dtype}; only FP8 GEMMs change dtype")
        result_dtype = a.dtype
    if bias is not None:
        want = result_dtype
        if bias.dim() != 1 or (known_sizes(bias.shape[0], N) and bias.shape[0] != N):
            _fail(f"bias must be [N={N}], got {tuple(bias.shape)}")
        if bias.dtype != want:
            _fail(f"bias dtype {bias.dtype} must be {want}")
    n_out = N
    if epilogue in GATED:
        if known_sizes(N) and N % 2:
            _fail(f"epilogue {epilogue!r} needs an even N (gate columns, then up columns); N={N}")
        n_out = N // 2
    if (residual is not None) != (epilogue == "residual_add"):
        _fail("residual is given exactly when epilogue='residual_add'")
    if residual is not None:
        if residual.dim() != 2 or not all(not known_sizes(h, w) or h == w for h, w in zip(residual.shape, (M, N))):
            _fail(f"residual must be [M, N] = {(M, N)}, got {tuple(residual.shape)}")
        if residual.dtype != result_dtype:
            _fail(f"residual dtype {residual.dtype} must be the output dtype {result_dtype}")
    return M, N, K, n_out, result_dtype


def _validate_fp4(g: GemmArgs, M: Any, K: Any, N: Any) -> tuple:
    a, b = g.a, g.b
    if known_sizes(K, b.shape[0]) and K != 2 * b.shape[0]:
        _fail(
            f"FP4 b packs two values per byte along K: a is [M, K={K}], so b must be [K/2={K // 2}, N]; got {tuple(b.shape)}"
        )
    if a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        _fail(f"FP4 weights take bf16 / fp16 / fp32 a, got {a.dtype}")
    kind = fp4.kind_of(g.b_scale)
    if kind is None:
        _fail(
            "FP4 (uint8) b needs b_scale: float8_e4m3fn per 16 elements of K (NVFP4) or uint8 E8M0 per 32 (MXFP4); "
            f"got {None if g.b_scale is None else g.b_scale.dtype}"
        )
    block = fp4.block_size(kind)
    if known_sizes(K) and K % block:
        _fail(f"{kind.upper()} needs K ({K}) to be a multiple of {block}")
    want = (K // block if known_sizes(K) else None, N)
    if g.b_scale.dim() != 2 or not all(
        not known_sizes(h, w) or w is None or h == w for h, w in zip(g.b_scale.shape, want)
    ):
        _fail(
            f"b_scale must be [K/{block}, N] = {want} (the stored [N, K/{block}] scales' .t()), got {tuple(g.b_scale.shape)}"
        )
    if kind == "nvfp4" and (g.b_scale_2 is None or g.b_scale_2.dtype != torch.float32 or g.b_scale_2.numel() != 1):
        _fail("NVFP4 b needs b_scale_2, one float32 element (ModelOpt's weight_scale_2)")
    if kind == "mxfp4" and g.b_scale_2 is not None:
        _fail("b_scale_2 is for NVFP4; MXFP4 has no global scale")
    if g.a_scale is not None and (g.a_scale.dtype != torch.float32 or g.a_scale.numel() != 1):
        _fail("with FP4 b, a_scale is the static input scale: one float32 element")
    if g.out_dtype not in (None, a.dtype):
        _fail(f"FP4 GEMMs return a's dtype {a.dtype}, not out_dtype={g.out_dtype}")
    if g.bias is not None and (g.bias.dim() != 1 or g.bias.dtype != a.dtype):
        _fail(f"bias must be [N={N}] in {a.dtype}, got {g.bias.dtype} {tuple(g.bias.shape)}")
    n_out = N
    if g.epilogue in GATED:
        n_out = N // 2
    if (g.residual is not None) != (g.epilogue == "residual_add"):
        _fail("residual is given exactly when epilogue='residual_add'")
    return M, N, K, n_out, a.dtype


def dequantized_fp4(args: GemmArgs) -> torch.Tensor:
    """FP4 ``b`` as float32 ``[K, N]``."""
    return fp4.dequantize(args.b.t(), args.b_scale.t(), args.b_scale_2, torch.float32).t()


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


def expand_scale(scale: Optional[torch.Tensor], kind: Optional[str], rows: int, cols: int) -> torch.Tensor | float:
    """A scale of ``kind`` (``scale_kind``'s words) as a float32 tensor that broadcasts over ``[rows, cols]``:
    ``[]``, ``[rows, 1]``, ``[1, cols]`` or, for block / group scales, one value per element (1.0: none)."""
    if scale is None:
        return 1.0
    if kind == "tensor":
        return scale.reshape(()).float()
    if kind in ("row", "column"):
        return scale.float()
    s = scale.float()
    if kind == "block":  # [ceil(K/128), ceil(N/128)] over b [K, N]
        s = s.repeat_interleave(SCALE_BLOCK, 0)[:rows]
    return s.repeat_interleave(SCALE_BLOCK, 1)[:, :cols]  # "group": [M, ceil(K/128)] over a [M, K]


def dequantized(args: GemmArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` of an FP8 call as float32, their scales applied."""
    sa = expand_scale(args.a_scale, args.a_scale_kind, args.M, args.K)
    sb = expand_scale(args.b_scale, args.b_scale_kind, args.K, args.N)
    return args.a.to(torch.float32) * sa, args.b.to(torch.float32) * sb


def reference(args: GemmArgs, launch: Launch = Launch()) -> torch.Tensor:
    """Plain PyTorch semantics of ``rubin.gemm`` (see the module docstring); any device.

    FP8 (W8A8 or weight-only) is dequantised and multiplied in float32 (what ``torch._scaled_mm`` computes,
    and it runs on every device), then rounded once to the output dtype.
    """
    a, b, bias = args.a, args.b, args.bias
    if args.fp4:
        acc = a.to(torch.float32) @ dequantized_fp4(args)
        if bias is not None:
            acc = acc + bias.to(torch.float32)
        return apply_epilogue(acc.to(args.result_dtype), args.epilogue, args.residual)
    if args.fp8:
        fa, fb = dequantized(args)
        acc = fa @ fb
        if bias is not None:
            acc = acc + bias.to(torch.float32)
        y = acc.to(args.result_dtype)
    else:
        y = torch.addmm(bias, a, b) if bias is not None else torch.mm(a, b)
    return apply_epilogue(y, args.epilogue, args.residual)


def gemm_reference(*args, pdl: bool = False, **kwargs) -> torch.Tensor:
    """``reference`` called like the op (its data arguments, positionally or by name)."""
    return reference(GemmArgs(*args, **kwargs))


def aten(args: GemmArgs, launch: Launch = Launch()) -> torch.Tensor:
    """``rubin.gemm`` as the ATen ops the source graph had: ``mm`` / ``addmm``, W8A8 FP8 with per-tensor / row /
    column scales ``_scaled_mm`` (cuBLASLt FP8 on a GPU), then the epilogue. The ``torch`` kernel runs this;
    select_kernels lowers a node bound to ``torch`` or ``reference`` back into these ops, so Inductor compiles
    and fuses them as it would have without rubin (the FP8 result is ``_scaled_mm``'s: within FP8 tolerance
    of the float32 reference). Block scales and weight-only FP8 have no ATen GEMM: they run the reference's
    float32 dequantise-and-multiply, which Inductor fuses as it can."""
    a, b, bias = args.a, args.b, args.bias
    if args.fp4 or (args.fp8 and (not args.w8a8 or "block" == args.b_scale_kind)):
        return reference(args)
    if args.fp8:
        y = torch._scaled_mm(a, b, scale_a=args.a_scale, scale_b=args.b_scale, bias=bias, out_dtype=args.result_dtype)
    else:
        y = torch.addmm(bias, a, b) if bias is not None else torch.mm(a, b)
    return apply_epilogue(y, args.epilogue, args.residual)


def gemm_aten(*args, pdl: bool = False, **kwargs) -> torch.Tensor:
    """``aten`` called like the op: the op's ATen form, which select_kernels traces into the graph."""
    return aten(GemmArgs(*args, **kwargs))


# ------------------------------------------------------------------------------------------------
# the op
# ------------------------------------------------------------------------------------------------


@op("gemm")
def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    epilogue: str = "none",
    residual: Optional[torch.Tensor] = None,
    a_scale: Optional[torch.Tensor] = None,
    b_scale: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    pdl: bool = False,
    impl: str = "reference",
    b_scale_2: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Canonical GEMM; see the module docstring. ``impl`` names the kernel (ops/registry.py); ``pdl`` says how
    it is launched, never what it computes."""
    args = GemmArgs(a, b, bias, epilogue, residual, a_scale, b_scale, out_dtype, b_scale_2)
    return GEMM.run(impl, args, Launch(pdl=pdl))


@gemm.register_fake
def _gemm_fake(
    a,
    b,
    bias=None,
    epilogue="none",
    residual=None,
    a_scale=None,
    b_scale=None,
    out_dtype=None,
    pdl=False,
    impl="reference",
    b_scale_2=None,
):
    args = GemmArgs(a, b, bias, epilogue, residual, a_scale, b_scale, out_dtype, b_scale_2)
    return a.new_empty((args.M, args.n_out), dtype=args.result_dtype)


# ------------------------------------------------------------------------------------------------
# what kernel selection knows of a rubin.gemm node
# ------------------------------------------------------------------------------------------------


def quantization(node: torch.fx.Node) -> str:
    """``"none"``; ``"fp8_tensor"`` (one scale for b, and for FP8 a one for a); ``"fp8_rowwise"`` (per-token a
    scales and / or per-column b scales); ``"fp8_block"`` (128 x 128 block scales of b) for a ``rubin.gemm``
    node, W8A8 or weight-only alike (``act_dtype`` tells them apart)."""
    args = bound_arguments(node)
    a, b, sa, sb = (tensor_val(args[n]) for n in ("a", "b", "a_scale", "b_scale"))
    if b is not None and b.dtype == torch.uint8:
        return fp4.kind_of(sb) or "nvfp4"
    if b is None or b.dtype not in FP8_DTYPES or sb is None:
        return "none"
    b_kind = scale_kind(sb, b.shape[1], "b", b.shape[0])
    if b_kind == "block":
        return "fp8_block"
    if b_kind == "tensor" and (sa is None or sa.numel() == 1):
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
    quant = quantization(node)
    fp4_b = quant in ("nvfp4", "mxfp4")
    if fp4_b and isinstance(sizes["K"], int):
        sizes["K"] *= 2  # b is packed two values per byte along K
    return KernelSpec(
        op="gemm",
        quant=quant,
        block_shape=(SCALE_BLOCK, SCALE_BLOCK) if quant == "fp8_block" else None,
        act_dtype=val_dtype(args["a"]),
        weight_dtype="float4_e2m1fn_x2" if fp4_b else val_dtype(args["b"]),
        shape=tuple((k, v) for k, v in sizes.items() if isinstance(v, int)),
        activation=None if epilogue == "none" else epilogue,
        node=node.name,
        static_input_scales=fp4_b and args.get("a_scale") is not None,
    )


GEMM = CanonicalOp(
    "gemm",
    gemm_spec,
    reference,
    aten_form=gemm_aten,
    aten_label="mm / addmm / _scaled_mm + epilogue",
    example_shape=(("M", 128), ("N", 4096), ("K", 4096)),
)
