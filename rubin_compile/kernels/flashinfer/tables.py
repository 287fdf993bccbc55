"""Which FlashInfer 0.7.2 entry point runs each (canonical op, quantisation) of each FlashInfer kernel, and where.

Each candidate (``flashinfer_cutlass``, ``flashinfer_trtllm``, ``flashinfer_cutedsl``, ``flashinfer_cudnn``,
``flashinfer_fa2``, ``flashinfer_fa3``; vLLM's ``--moe-backend`` / ``--linear-backend`` spellings) maps
each (canonical op, quantisation) it can run to a FlashInfer entry point, and is gated by FlashInfer's own
capability declarations, read without running anything:

* where FlashInfer declares support as data -- ``@supported_compute_capability([...])`` on a function
  (``_supported_ccs``) or ``@backend_requirement({backend: checker})`` with a decorated checker per backend
  (``fn.is_backend_supported(backend, cc)``) -- we import the function and ask it. ``import flashinfer``
  works on a machine without CUDA (0.7.2.post1, checked on the CPU CI image; it takes several seconds, so
  it happens once, only when a plan for a GPU target is made);
* where FlashInfer decides in code (``cutlass_fused_moe``'s arch dispatch, ``is_trtllm_moe_supported``,
  the attention wrappers' ``backend="auto"`` rules: they call ``torch.cuda`` and cannot be asked about
  another GPU), the rule is copied here as data with the file and function it comes from, and
  tests/cpu/ops/test_registry.py checks that those functions still exist in the installed FlashInfer.

A missing package (flashinfer-python; nvidia-cutlass-dsl for CuTe-DSL kernels; nvidia-cudnn-frontend for
cuDNN ones) rejects the candidate with that reason. The adapters from the canonical ops to these entry points
are in moe.py, gemm.py and attention.py beside this module; __init__.py registers the kernels.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

from rubin_compile.ops.registry import KernelSpec
from rubin_compile.target import Target

# Python module -> pip package, for "package missing" reasons.
PACKAGES = {"flashinfer": "flashinfer-python", "cutlass": "nvidia-cutlass-dsl", "cudnn": "nvidia-cudnn-frontend"}

# Compute capabilities we ask FlashInfer's @backend_requirement tables about (they answer per cc).
KNOWN_CCS = (80, 86, 87, 89, 90, 100, 103, 107, 110, 120, 121)
ANY_CUDA = None  # EntryPoint.ccs for a kernel FlashInfer does not gate by architecture


@dataclass(frozen=True)
class EntryPoint:
    """One FlashInfer function (and ``backend=`` value) that runs a canonical op in one quantisation.

    ``ccs``: the compute capabilities, when FlashInfer decides them in code (copied from ``source``);
    ``"declared"`` to ask the function's own decorator. ``rule(target, spec)`` adds dtype / shape limits.
    """

    functions: tuple[str, ...]
    backend: Optional[str] = None
    ccs: object = "declared"  # frozenset[int] | "declared" | ANY_CUDA
    source: str = ""
    needs: tuple[str, ...] = ("flashinfer",)
    rule: Optional[Callable[[Target, KernelSpec], Optional[str]]] = None

    def describe(self) -> str:
        name = " / ".join(self.functions)
        return f"{name}(backend={self.backend!r})" if self.backend else name


# ------------------------------------------------------------------------------------------------
# reading FlashInfer's declarations
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def resolve(path: str) -> Callable:
    """The FlashInfer object at ``"flashinfer.module.attr"`` (imports FlashInfer; cached)."""
    module, _, attr = path.rpartition(".")
    with warnings.catch_warnings():  # FlashInfer's imports of CuTe-DSL warn about its own deprecations
        warnings.simplefilter("ignore", DeprecationWarning)
        return getattr(importlib.import_module(module), attr)


@functools.lru_cache(maxsize=None)
def declared_ccs(entry: EntryPoint) -> Optional[frozenset[int]]:
    """The compute capabilities ``entry`` runs on, from FlashInfer's declaration (``None``: any CUDA GPU)."""
    if entry.ccs is ANY_CUDA:
        return None
    if entry.ccs != "declared":
        return frozenset(entry.ccs)
    fn = resolve(entry.functions[0])
    if entry.backend is None:  # @supported_compute_capability on the function itself
        return frozenset(fn._supported_ccs)
    # @backend_requirement: is_backend_supported(backend, cc) asks that backend's decorated checker.
    return frozenset(cc for cc in KNOWN_CCS if fn.is_backend_supported(entry.backend, cc))


def _missing(entry: EntryPoint) -> Optional[str]:
    for module in entry.needs:
        if importlib.util.find_spec(module) is None:
            return f"package {PACKAGES.get(module, module)} is not installed"
    return None


def check_target(entry: EntryPoint, target: Target) -> Optional[str]:
    """Why ``entry`` cannot run on ``target`` whatever the shapes (no GPU, package, compute capability)."""
    if not target.is_cuda:
        return f"target {target.name} has no CUDA GPU"
    missing = _missing(entry)
    if missing:
        return missing
    try:
        ccs = declared_ccs(entry)
    except Exception as exc:  # e.g. a FlashInfer that fails to import here
        return f"could not read FlashInfer's declaration of {entry.describe()}: {type(exc).__name__}: {exc}"
    if ccs is not None and target.cc not in ccs:
        return (
            f"FlashInfer runs {entry.describe()} on cc {sorted(ccs)} only, not on {target.name} "
            f"(cc {target.cc}) [{entry.source}]"
        )
    return None


def check_entry(entry: EntryPoint, target: Target, spec: KernelSpec) -> Optional[str]:
    """Why ``entry`` cannot run ``spec`` on ``target``, or ``None``."""
    reason = check_target(entry, target)
    if reason is None and entry.rule is not None:
        reason = entry.rule(target, spec)
    return reason


# ------------------------------------------------------------------------------------------------
# dtype and shape rules (each from the FlashInfer source named beside it)
# ------------------------------------------------------------------------------------------------


def _acts(*dtypes: str) -> Callable[[Target, KernelSpec], Optional[str]]:
    def rule(target: Target, spec: KernelSpec) -> Optional[str]:
        if spec.act_dtype not in dtypes:
            return f"activations in {spec.act_dtype} are not supported ({', '.join(dtypes)})"
        return None

    return rule


def _all(*rules: Callable) -> Callable[[Target, KernelSpec], Optional[str]]:
    def rule(target: Target, spec: KernelSpec) -> Optional[str]:
        for r in rules:
            reason = r(target, spec)
            if reason:
                return reason
        return None

    return rule


def _divisible(**sizes: int) -> Callable[[Target, KernelSpec], Optional[str]]:
    def rule(target: Target, spec: KernelSpec) -> Optional[str]:
        for name, multiple in sizes.items():
            value = spec.dim(name)
            if value is not None and value % multiple:
                return f"shape limit: {name}={value} must be a multiple of {multiple}"
        return None

    return rule


def _block(shape: tuple[int, int]) -> Callable[[Target, KernelSpec], Optional[str]]:
    def rule(target: Target, spec: KernelSpec) -> Optional[str]:
        if spec.block_shape is not None and tuple(spec.block_shape) != shape:
            return f"shape limit: FP8 block scales must be {shape[0]}x{shape[1]}, got {list(spec.block_shape)}"
        return None

    return rule


def _feature(name: str, what: str) -> Callable[[Target, KernelSpec], Optional[str]]:
    def rule(target: Target, spec: KernelSpec) -> Optional[str]:
        return None if getattr(target, name) else f"{target.name} has no {what}"

    return rule


def _silu_only(target: Target, spec: KernelSpec) -> Optional[str]:
    # FlashInfer has a GegluTanh activation type (tllm_enums.py), but which MoE kernels instantiate it is
    # not declared anywhere we can read; until a GPU test shows it, only SwiGLU goes to FlashInfer.
    if spec.activation not in (None, "silu"):
        return f"activation {spec.activation} is not verified for this FlashInfer kernel (silu only)"
    return None


def _fa3_fp8(target: Target, spec: KernelSpec) -> Optional[str]:
    if spec.quant != "none" and not spec.act_dtype.startswith("float8"):
        return (
            "FA3 with an FP8 KV cache needs an FP8 query (flashinfer/utils.py:is_fa3_backend_supported); "
            f"the query is {spec.act_dtype}"
        )
    return None


# ------------------------------------------------------------------------------------------------
# MoE: flashinfer/fused_moe/
# ------------------------------------------------------------------------------------------------

# flashinfer/fused_moe/core.py:get_cutlass_fused_moe_module dispatches on the device arch: 89, 90,
# 100/107/110 (sm100 module), 103, 120/121; anything else raises "Invalid backend".
CUTLASS_MOE_CCS = frozenset({89, 90, 100, 103, 107, 110, 120, 121})
_CUTLASS_MOE_SRC = "flashinfer/fused_moe/core.py:get_cutlass_fused_moe_module"
_BINDING = "data/csrc/fused_moe/cutlass_backend/flashinfer_cutlass_fused_moe_binding.cu"
# TMA needs 128-bit aligned rows: hidden and inter sizes divisible by 128 / (bits of the narrower
# operand) elements; MXFP4 weights need 128 (the same binding, FusedMoeRunner::runMoe).
# FP8 block: 128 (prepare.py:prepare_cutlass_fp8_block_weights: "hidden_size and intermediate_size must be
# divisible by 128"; the adapter swaps GEMM1's halves by whole 128-row scale blocks).
_cutlass_align = {"none": 8, "fp8_tensor": 16, "fp8_block": 128, "nvfp4": 32, "mxfp4": 128}

# flashinfer/fused_moe/core.py:is_trtllm_moe_supported returns False for cc major < 10; the trtllm-gen
# module (jit/fused_moe.py:gen_trtllm_gen_fused_moe_sm100_module) ships Blackwell and Rubin cubins
# (sm_107 gets -DTLLM_RUBIN_FEATURES). Of our targets: sm_100, sm_103, sm_107.
TRTLLM_MOE_CCS = frozenset({100, 103, 107})
_TRTLLM_MOE_SRC = "flashinfer/fused_moe/core.py:is_trtllm_moe_supported"


# trtllm_fused_moe_kernel_launcher.cu: "intermediate_size must be a multiple of 128"; the routing
# kernel "expects that num_experts must be divisible by 4", "num_experts must be greater than top_k" and,
# without expert groups (the routed adapters pass RoutingMethodType.Renormalize), "only supports top_k<=32".
def _trtllm_routing(target: Target, spec: KernelSpec) -> Optional[str]:
    E, k = spec.dim("E"), spec.dim("k")
    if k is not None and not 0 < k <= 32:
        return f"shape limit: k={k}: the trtllm-gen routing kernel (no groups) supports top_k <= 32"
    if E is not None and k is not None and E <= k:
        return f"shape limit: E={E} must be greater than k={k}"
    return None


_trtllm_shape = _all(_divisible(I=128, E=4), _trtllm_routing)


def _cutlass_moe(quant: str, ccs: frozenset[int], source: str, *extra: Callable) -> EntryPoint:
    size = _cutlass_align[quant]
    return EntryPoint(
        ("flashinfer.fused_moe.cutlass_fused_moe",),
        None,
        ccs,
        source,
        rule=_all(_silu_only, _divisible(H=size, I=size), *extra),
    )


def _silu_or_swigluoai(target: Target, spec: KernelSpec) -> Optional[str]:
    # The MXFP4 adapters (GPT-OSS) map swigluoai[_uninterleave][:<alpha>:<limit>] to FlashInfer's SwiGLU with
    # alpha / beta = 1 / limit (fused_moe/api.py:SwiGLU), silu to the plain Swiglu (kernels/flashinfer/moe.py).
    if spec.activation not in (None, "silu") and spec.activation.split(":")[0] not in (
        "swigluoai",
        "swigluoai_uninterleave",
    ):
        return f"activation {spec.activation} is not mapped for this FlashInfer kernel (silu, swigluoai)"
    return None


MOE: dict[str, dict[str, EntryPoint]] = {
    "flashinfer_cutlass": {
        # Binding: CutlassMoeFCRunner<half, half> / <bf16, bf16>; FP32 has no runner.
        "none": _cutlass_moe(
            "none", CUTLASS_MOE_CCS, f"{_CUTLASS_MOE_SRC}; {_BINDING} (fp16/bf16 runners)", _acts("bfloat16", "float16")
        ),
        "fp8_tensor": _cutlass_moe(
            "fp8_tensor", CUTLASS_MOE_CCS, f"{_CUTLASS_MOE_SRC}; {_BINDING} (isFp8Quant)", _acts("bfloat16", "float16")
        ),
        # cutlass_fused_moe: use_deepseek_fp8_block_scale raises "FP8 block scaling not yet implemented
        # for Blackwell" unless the device arch is "90".
        "fp8_block": _cutlass_moe(
            "fp8_block",
            frozenset({90}),
            "flashinfer/fused_moe/core.py:cutlass_fused_moe (use_deepseek_fp8_block_scale: sm_90 only)",
            _acts("bfloat16", "float16"),
            _block((128, 128)),
        ),
        # isNvfp4Quant: FP4 x FP4 grouped GEMM, which needs FP4 tensor cores (not on sm_90).
        "nvfp4": _cutlass_moe(
            "nvfp4",
            CUTLASS_MOE_CCS,
            f"{_CUTLASS_MOE_SRC}; {_BINDING} (isNvfp4Quant)",
            _feature("nvfp4", "NVFP4 tensor cores"),
            _acts("bfloat16", "float16"),
            # prepare.py:prepare_cutlass_nvfp4_weights: the expand kernel reads the linear input_sf with rows
            # padded to 64 ("hidden_size divisible by 64").
            _divisible(H=64),
        ),
        # sm_90: isWFP4A16Quant ("SM90 MXFP4 W4A16 supports BF16 activations only"); sm_100+: MXFP4 x MXFP8
        # (isWMxfp4AMxfp8Quant, "sm >= 100").
        # H and I need 128 (FusedMoeRunner::runMoe, prepare_cutlass_w4a16_weights): the adapter zero-pads them
        # (GPT-OSS: 2880), so the rule asks for the format's 32 only.
        "mxfp4": EntryPoint(
            ("flashinfer.fused_moe.cutlass_fused_moe",),
            None,
            CUTLASS_MOE_CCS,
            f"{_CUTLASS_MOE_SRC}; {_BINDING} (isWFP4A16Quant on sm_90, isWMxfp4AMxfp8Quant on sm >= 100)",
            rule=_all(_silu_or_swigluoai, _divisible(H=32, I=32), _acts("bfloat16")),
        ),
    },
    "flashinfer_trtllm": {
        # is_trtllm_moe_supported: Bfloat16 weights need Bfloat16 activations.
        "none": EntryPoint(
            ("flashinfer.fused_moe.trtllm_bf16_routed_moe",),
            None,
            TRTLLM_MOE_CCS,
            _TRTLLM_MOE_SRC,
            rule=_all(_silu_only, _acts("bfloat16"), _trtllm_shape),
        ),
        "fp8_tensor": EntryPoint(
            ("flashinfer.fused_moe.trtllm_fp8_per_tensor_scale_routed_moe",),
            None,
            TRTLLM_MOE_CCS,
            _TRTLLM_MOE_SRC,
            rule=_all(_silu_only, _acts("bfloat16", "float16"), _trtllm_shape),
        ),
        # DeepSeek FP8: activations in 1x128 groups, the scales [H / 128, T] (the launcher's checks).
        "fp8_block": EntryPoint(
            ("flashinfer.fused_moe.trtllm_fp8_block_scale_routed_moe",),
            None,
            TRTLLM_MOE_CCS,
            _TRTLLM_MOE_SRC,
            rule=_all(_silu_only, _acts("bfloat16", "float16"), _trtllm_shape, _divisible(H=128), _block((128, 128))),
        ),
        # E2m1 weights take E2m1 activations (quantised by the adapter); the block scales' 128x4 swizzle is
        # unpadded for H % 128 == 0 (fused_moe/prepare.py:prepare_trtllm_fp4_weights reshapes it back).
        "nvfp4": EntryPoint(
            ("flashinfer.fused_moe.trtllm_fp4_block_scale_routed_moe",),
            None,
            TRTLLM_MOE_CCS,
            _TRTLLM_MOE_SRC,
            rule=_all(_silu_only, _acts("bfloat16", "float16"), _trtllm_shape, _divisible(H=128)),
        ),
        # MxE2m1 weights take MxE2m1, MxE4m3 or Bfloat16 activations. The adapter zero-pads H and I to 128
        # (prepare_trtllm_fp4_weights' MXFP4 alignment; GPT-OSS's 2880 is not), so I % 128 is not asked.
        "mxfp4": EntryPoint(
            ("flashinfer.fused_moe.trtllm_fp4_block_scale_routed_moe",),
            None,
            TRTLLM_MOE_CCS,
            _TRTLLM_MOE_SRC,
            rule=_all(_silu_or_swigluoai, _acts("bfloat16"), _divisible(E=4), _trtllm_routing),
        ),
    },
    "flashinfer_cutedsl": {
        # @supported_compute_capability([90]) (fused_moe/cute_dsl/sm90_fused_moe.py)
        "none": EntryPoint(
            ("flashinfer.fused_moe.cute_dsl_fused_moe_bf16",),
            None,
            "declared",
            "flashinfer/fused_moe/cute_dsl/sm90_fused_moe.py:cute_dsl_fused_moe_bf16",
            ("flashinfer", "cutlass"),
            # its docstring: "hidden % 8 == 0; I % 32 == 0 for gated activations (32-column up/gate interleave)"
            _all(_silu_only, _acts("bfloat16", "float16"), _divisible(H=8, I=32)),
        ),
        # @supported_compute_capability([100, 103, 107]), quant_mode="w4a4"
        "nvfp4": EntryPoint(
            ("flashinfer.fused_moe.cute_dsl_fused_moe",),
            None,
            "declared",
            "flashinfer/fused_moe/cute_dsl/fused_moe.py:cute_dsl_fused_moe",
            ("flashinfer", "cutlass"),
            # GEMM1's up / gate rows interleave in groups of 64 (prepare.py:_interleave_linear_and_gate), so
            # 2I % 128; the 128x4-swizzled scales are unpadded for H % 128 (cute_dsl/utils.py:
            # convert_sf_to_mma_layout: "M and K dimensions must be multiples of 128 and 64").
            _all(_silu_only, _acts("bfloat16", "float16"), _divisible(I=64, H=128)),
        ),
        # @supported_compute_capability([100, 103])
        "mxfp4": EntryPoint(
            ("flashinfer.fused_moe.cute_dsl_fused_moe_mxfp8_mxfp4",),
            None,
            "declared",
            "flashinfer/fused_moe/cute_dsl/fused_moe.py:cute_dsl_fused_moe_mxfp8_mxfp4",
            ("flashinfer", "cutlass"),
            # prepare.py:prepare_cute_dsl_weights: "CuTe-DSL MXFP4 requires hidden and intermediate sizes
            # divisible by 128"; BF16 in (quantised to MXFP8 by the adapter).
            _all(_silu_or_swigluoai, _acts("bfloat16"), _divisible(H=128, I=128)),
        ),
    },
}

# ------------------------------------------------------------------------------------------------
# GEMM: flashinfer/gemm/gemm_base.py, every entry point a @backend_requirement table
# ------------------------------------------------------------------------------------------------

_GEMM_SRC = "flashinfer/gemm/gemm_base.py"


def _gemm(function: str, backend: str, checker: str, *rules: Callable, needs=("flashinfer",)) -> EntryPoint:
    return EntryPoint(
        (f"flashinfer.gemm.{function}",),
        backend,
        "declared",
        f"{_GEMM_SRC}:{checker}",
        needs,
        _all(*rules) if rules else None,
    )


GEMM: dict[str, dict[str, EntryPoint]] = {
    "flashinfer_cutlass": {
        "none": _gemm("mm_bf16", "cutlass", "_cutlass_mm_bf16_requirement"),
        "fp8_tensor": _gemm("mm_fp8", "cutlass", "_cutlass_mm_fp8_requirement"),
        "fp8_block": _gemm(
            "gemm_fp8_nt_groupwise", "cutlass", "_cutlass_gemm_fp8_nt_groupwise_requirement", _block((128, 128))
        ),
        # MXFP4 is absent on purpose: _cutlass_gemm_fp4_requirement raises "Only cudnn and auto FP4 GEMM
        # supports mxfp4 quantization".
        "nvfp4": _gemm("mm_fp4", "cutlass", "_cutlass_gemm_fp4_requirement"),
    },
    "flashinfer_cudnn": {
        "none": _gemm("mm_bf16", "cudnn", "_cudnn_mm_bf16_requirement", needs=("flashinfer", "cudnn")),
        "fp8_tensor": _gemm("mm_fp8", "cudnn", "_cudnn_mm_fp8_requirement", needs=("flashinfer", "cudnn")),
        "nvfp4": _gemm("mm_fp4", "cudnn", "_cudnn_gemm_fp4_requirement", needs=("flashinfer", "cudnn")),
        "mxfp4": _gemm("mm_fp4", "cudnn", "_cudnn_gemm_fp4_requirement", needs=("flashinfer", "cudnn")),
    },
    "flashinfer_trtllm": {
        "fp8_tensor": _gemm("mm_fp8", "trtllm_low_latency", "_trtllm_low_latency_gemm_fp8_requirement"),
        "fp8_block": _gemm(
            "gemm_fp8_nt_groupwise", "trtllm", "_trtllm_gemm_fp8_nt_groupwise_requirement", _block((128, 128))
        ),
        # MXFP4 absent: _trtllm_gemm_fp4_requirement raises for use_nvfp4=False.
        "nvfp4": _gemm("mm_fp4", "trtllm", "_trtllm_gemm_fp4_requirement"),
    },
    "flashinfer_cutedsl": {
        "none": _gemm("mm_bf16", "cute-dsl", "_cute_dsl_mm_bf16_requirement", needs=("flashinfer", "cutlass")),
        # The Rubin FP8 BMM (the vLLM-on-Rubin announcement); _cute_dsl_bmm_fp8_requirement wants M, N, K
        # multiples of 16: the adapter pads M (gemm.py:CuteDslBmmFp8), N and K are this rule.
        "fp8_tensor": _gemm(
            "bmm_fp8",
            "cute-dsl",
            "_cute_dsl_bmm_fp8_requirement",
            _divisible(N=16, K=16),
            needs=("flashinfer", "cutlass"),
        ),
        # _cute_dsl_gemm_fp4_requirement: "CuTe-DSL FP4 GEMM requires N % 8 == 0".
        "nvfp4": _gemm(
            "mm_fp4", "cute-dsl", "_cute_dsl_gemm_fp4_requirement", _divisible(N=8), needs=("flashinfer", "cutlass")
        ),
        "mxfp4": _gemm(
            "mm_fp4", "cute-dsl", "_cute_dsl_gemm_fp4_requirement", _divisible(N=8), needs=("flashinfer", "cutlass")
        ),
    },
    # cuBLASLt FP8 (sm_89+): the per-tensor W8A8 GEMM that runs on Hopper.
    "flashinfer_cublas": {
        "fp8_tensor": _gemm("bmm_fp8", "cublas", "_cublas_bmm_fp8_requirement"),
    },
    # TensorRT-LLM's DeepGEMM block-scaled FP8 GEMM; it decides its arch in code (fp8_blockscale_gemm_sm90:
    # _match_sm_version(input.device, ["90", "90a"])), and checks K % 128 == 0, N % 64 == 0.
    "flashinfer_deepgemm": {
        "fp8_block": EntryPoint(
            ("flashinfer.gemm.fp8_blockscale_gemm_sm90",),
            None,
            frozenset({90}),
            f"{_GEMM_SRC}:fp8_blockscale_gemm_sm90 (_match_sm_version: sm_90 only)",
            rule=_all(_block((128, 128)), _divisible(K=128, N=64)),
        ),
    },
}

# ------------------------------------------------------------------------------------------------
# attention: flashinfer/decode.py, flashinfer/prefill.py (backend rules in code)
# ------------------------------------------------------------------------------------------------

# FA2 / FA3: one plan-free call per node, prefill and decode alike, the batch folded into the heads
# (attention.py says why this and not the batch wrappers, whose plan() runs host code per shape).
_SINGLE_PREFILL = ("flashinfer.prefill.single_prefill_with_kv_cache",)
# trtllm-gen: the adapter (attention.py:TrtllmGenAttention) calls the decode kernel for S = 1 (or up to 16
# causal rows) and the context kernel otherwise, both with backend="trtllm-gen"; its supports() adds the
# limits (no explicit mask, Dv == D, head dims 64 / 128 / 256, FP8 decode with a bf16 query and e4m3 KV).
_TRTLLM_ATTN = (
    "flashinfer.decode.trtllm_batch_decode_with_kv_cache",
    "flashinfer.prefill.trtllm_batch_context_with_kv_cache",
)
# flashinfer/utils.py:determine_attention_backend picks fa3 on sm_90a (is_sm90a_supported: major == 9)
# when is_fa3_backend_supported, fa2 everywhere else; trtllm_batch_decode_with_kv_cache(backend="auto")
# picks trtllm-gen when the cc major is 10, xqa elsewhere (decode.py).
_FA_SRC = "flashinfer/utils.py:determine_attention_backend"
_TRTLLM_ATTN_SRC = (
    "flashinfer/decode.py:trtllm_batch_decode_with_kv_cache (backend='auto': trtllm-gen iff cc major == 10)"
)


def _fa3_head_dims(target: Target, spec: KernelSpec) -> Optional[str]:
    # flashinfer/utils.py:is_fa3_prefill_head_dim_supported: the Hopper kernels instantiated (backend="auto"
    # falls back to fa2 for the rest; an explicit backend="fa3" would fail to build).
    d, dv = spec.dim("D"), spec.dim("Dv")
    dv = d if dv is None else dv
    if d is not None and not ((d == dv and d in (64, 128, 256)) or (d, dv) == (192, 128)):
        return f"shape limit: FA3 has head dims (64|128|256 equal, or 192/128), not D={d} Dv={dv}"
    return None


ATTENTION: dict[str, dict[str, EntryPoint]] = {
    "flashinfer_trtllm": {
        q: EntryPoint(_TRTLLM_ATTN, "trtllm-gen", TRTLLM_MOE_CCS, _TRTLLM_ATTN_SRC, rule=_acts("bfloat16", "float16"))
        for q in ("none", "fp8_tensor")
    },
    "flashinfer_fa3": {
        q: EntryPoint(
            _SINGLE_PREFILL,
            "fa3",
            frozenset({90}),
            f"{_FA_SRC}; flashinfer/utils.py:is_sm90a_supported",
            rule=_all(_acts("bfloat16", "float16"), _fa3_fp8, _fa3_head_dims),
        )
        for q in ("none", "fp8_tensor")
    },
    "flashinfer_fa2": {
        q: EntryPoint(_SINGLE_PREFILL, "fa2", ANY_CUDA, _FA_SRC, rule=_acts("bfloat16", "float16"))
        for q in ("none", "fp8_tensor")
    },
}

TABLES: dict[str, dict[str, dict[str, EntryPoint]]] = {"moe": MOE, "gemm": GEMM, "attention": ATTENTION}

# Priorities (higher wins), per target and quantisation; why each is what it is: docs/kernels/selection.md.
PRIORITIES: dict[tuple[str, str], dict[str, int]] = {
    # MoE: vLLM's order on Blackwell is flashinfer_trtllm, flashinfer_cutedsl (NVFP4), flashinfer_cutlass,
    # then triton; on sm_107 NVFP4 goes to CuTe-DSL (the vLLM-on-Rubin kernel list). On sm_90 Triton (10 /
    # 30 in kernels/triton/__init__.py) outranks FlashInfer CUTLASS, whose sm_90 JIT build did not finish in
    # 8 minutes.
    ("moe", "flashinfer_trtllm"): {"*": 40},
    ("moe", "flashinfer_cutedsl"): {"*": 30, "sm90": 5, "sm107:nvfp4": 50},
    ("moe", "flashinfer_cutlass"): {"*": 20},
    # GEMM: FlashInfer's own auto heuristics (_heuristic_func_bmm_fp8: cutlass before cublas / cudnn /
    # cute-dsl; _heuristic_func_mm_fp4: cutlass or cudnn first, cute-dsl last), cuBLAS (torch, 30) for
    # BF16; on sm_107 the CuTe-DSL FP8 BMM and NVFP4 GEMM (the vLLM-on-Rubin kernel list).
    ("gemm", "flashinfer_cutlass"): {"*": 40, "*:none": 25},
    ("gemm", "flashinfer_trtllm"): {"*": 35},
    ("gemm", "flashinfer_cudnn"): {"*": 20},
    ("gemm", "flashinfer_cutedsl"): {"*": 10, "sm107:fp8_tensor": 60, "sm107:nvfp4": 60},
    # The sm_90 FP8 GEMMs below torch (30) until the lead measures them on the H200.
    ("gemm", "flashinfer_cublas"): {"*": 15},
    # above our Triton GEMM (35) on sm_90 where its adapter's measured rule (gemm.py: _deepgemm_measured) lets it
    ("gemm", "flashinfer_deepgemm"): {"*": 40},
    # Attention: trtllm-gen on Blackwell (FlashInfer's auto choice, and the Rubin FP8 attention kernel),
    # FA3 on Hopper, SDPA (torch, 30), FA2 anywhere.
    ("attention", "flashinfer_trtllm"): {"*": 40},
    # FA3 above SDPA (30) and our decode kernel (32): at prefill (it declines decode) it measured 1.2-2.6x faster than
    # the op's ATen form (repeat_kv + SDPA) and 1.03-1.19x faster than SDPA with enable_gqa on the H200
    # (benchmarks/results/flashinfer-h200-attention.md)
    ("attention", "flashinfer_fa3"): {"*": 35},
    ("attention", "flashinfer_fa2"): {"*": 20},
}


def entry_point(op: str, kernel: str, quant: str) -> Optional[EntryPoint]:
    return TABLES[op].get(kernel, {}).get(quant)
