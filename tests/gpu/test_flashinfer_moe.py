"""The FlashInfer MoE adapters (rubin_compile/kernels/flashinfer/moe.py) against rubin.moe's reference (GPU only).

Each case draws random inputs and routing, runs ``adapter.run`` (prepare, call, check, the FlashInfer kernel,
finish) and compares with ``ops.moe.reference`` by ||out - ref|| / ||ref||. Tolerances:

* BF16 weights and activations: 2e-2 (bf16 intermediates; the kernels' fused finalize accumulates in bf16);
* FP8 weights, FP8 activations (block 1x128 or static per tensor): 8e-2 (e4m3's 3-bit mantissa, twice);
* NVFP4 weights and activations: 0.2 (the reference keeps activations unquantised; e2m1 has one mantissa bit).
* MXFP4 weights, BF16 activations: 3e-2 (the reference dequantises the same weights; bf16 intermediates);
  MXFP4 weights, MXFP8 activations: 8e-2 (e4m3 activations with power-of-two block scales).

MXFP4 (GPT-OSS) cases run silu and swigluoai with biases at H = I = 2880 (padded to 2944 by the adapters).

Which run where: sm_90 (H200): CuTe-DSL BF16 (needs nvidia-cutlass-dsl) and CUTLASS BF16 / FP8 (its sm_90 JIT
build takes more than 8 minutes: only with ``RUBIN_FLASHINFER_SLOW=1``); the 128x4 scale swizzle against
FlashInfer's ``block_scale_interleave`` (a CUDA kernel, JIT-built for the GPU). sm_100 / 103 / 107: trtllm-gen
and CuTe-DSL NVFP4 too.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("flashinfer")

from rubin_compile.kernels.flashinfer import adapter as fa  # noqa: E402
from rubin_compile.kernels.flashinfer import moe as fmoe  # noqa: E402
from rubin_compile.ops import fp4  # noqa: E402
from rubin_compile.ops.moe import MoEArgs, reference  # noqa: E402
from rubin_compile.ops.registry import Launch  # noqa: E402

import rubin_compile.kernels.flashinfer  # noqa: E402, F401  (registers the adapters)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
FP8 = torch.float8_e4m3fn
TOL = {"bf16": 2e-2, "fp8": 8e-2, "nvfp4": 0.2, "mxfp4": 3e-2, "mxfp4_mxfp8": 8e-2}
SLOW = pytest.mark.skipif(
    os.environ.get("RUBIN_FLASHINFER_SLOW") != "1", reason="CUTLASS fused MoE JIT build: set RUBIN_FLASHINFER_SLOW=1"
)


def _cc() -> int:
    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor


def _needs(*ccs):
    return pytest.mark.skipif(not torch.cuda.is_available() or _cc() not in ccs, reason=f"needs cc in {ccs}")


def _routing(T, E, k, gen):
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).cuda()
    w = torch.rand(T, k, generator=gen).cuda()
    return w / w.sum(1, keepdim=True), ids


def _fp8_block(w):  # [E, N, K] -> e4m3 and float32 [E, N/128, K/128] dequantisation scales
    E, N, K = w.shape
    b = w.float().reshape(E, N // 128, 128, K // 128, 128)
    s = (b.abs().amax(dim=(2, 4)) / 448.0).clamp(min=1e-8)
    q = (b / s[:, :, None, :, None]).reshape(E, N, K).to(FP8)
    return q, s


def _args(quant, T=33, H=256, I=256, E=8, k=2, seed=0):  # noqa: E741
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=gen) * 0.5).to(torch.bfloat16).cuda()
    w13 = (torch.randn(E, 2 * I, H, generator=gen) * 0.05).cuda()
    w2 = (torch.randn(E, H, I, generator=gen) * 0.05).cuda()
    tw, ids = _routing(T, E, k, gen)
    if quant == "none":
        return MoEArgs(x, w13.to(torch.bfloat16), w2.to(torch.bfloat16), tw, ids)
    if quant == "fp8_tensor":
        s13, s2 = w13.abs().amax() / 448.0, w2.abs().amax() / 448.0
        a13 = x.float().abs().amax() / 448.0
        a2 = torch.tensor(0.05, device="cuda")  # a static scale of FC2's input, as calibrated
        return MoEArgs(
            x, (w13 / s13).to(FP8), (w2 / s2).to(FP8), tw, ids, w13_scale=s13, w2_scale=s2, a13_scale=a13, a2_scale=a2
        )
    if quant == "fp8_block":
        (q13, s13), (q2, s2) = _fp8_block(w13), _fp8_block(w2)
        return MoEArgs(x, q13, q2, tw, ids, w13_scale=s13, w2_scale=s2, block_shape=[128, 128])
    if quant == "nvfp4":
        p13, b13, g13 = fp4.quantize(w13, "nvfp4", per_leading_dim=True)
        p2, b2, g2 = fp4.quantize(w2, "nvfp4", per_leading_dim=True)
        a13 = x.float().abs().amax() / (448.0 * 6.0)
        a2 = torch.tensor(0.5 / (448.0 * 6.0), device="cuda")
        return MoEArgs(
            x, p13, p2, tw, ids, w13_scale=b13, w2_scale=b2, w13_scale_2=g13, w2_scale_2=g2, a13_scale=a13, a2_scale=a2
        )
    raise AssertionError(quant)


def _rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _run(kernel, quant, tol, **shape):
    args = _args(quant, **shape)
    out = fa.run(fa.ADAPTERS[("moe", kernel, quant)], args, Launch())
    ref = reference(args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    err = _rel(out, ref)
    assert err < tol, f"{kernel} {quant}: relative error {err:.3g} >= {tol}"
    return err


def test_swizzle_matches_block_scale_interleave():
    from flashinfer.quantization.fp4_quantization import block_scale_interleave

    sf = torch.randint(0, 256, (256, 16), dtype=torch.uint8, device="cuda")
    assert torch.equal(fmoe._swizzle_128x4(sf).reshape(-1), block_scale_interleave(sf).reshape(-1))


@_needs(90)
def test_cutedsl_bf16_sm90():
    pytest.importorskip("cutlass")
    _run("flashinfer_cutedsl", "none", TOL["bf16"])
    _run("flashinfer_cutedsl", "none", TOL["bf16"], T=1, H=2048, I=768, E=16, k=8)


@SLOW
@pytest.mark.parametrize("quant, tol", [("none", TOL["bf16"]), ("fp8_tensor", TOL["fp8"]), ("fp8_block", 3e-2)])
def test_cutlass_sm90(quant, tol):
    if _cc() != 90 and quant == "fp8_block":
        pytest.skip("cutlass_fused_moe's FP8 block scaling is sm_90 only")
    _run("flashinfer_cutlass", quant, tol)


@_needs(100, 103, 107)
@pytest.mark.parametrize(
    "quant, tol",
    [("none", TOL["bf16"]), ("fp8_block", TOL["fp8"]), ("fp8_tensor", TOL["fp8"]), ("nvfp4", TOL["nvfp4"])],
)
def test_trtllm_blackwell(quant, tol):
    _run("flashinfer_trtllm", quant, tol)


@_needs(100, 103, 107)
def test_cutedsl_nvfp4_blackwell():
    pytest.importorskip("cutlass")
    _run("flashinfer_cutedsl", "nvfp4", TOL["nvfp4"])


@_needs(100, 103, 107, 110)
@pytest.mark.parametrize("quant", ["nvfp4"])
def test_cutlass_nvfp4_blackwell(quant):
    _run("flashinfer_cutlass", quant, TOL["nvfp4"])


# ------------------------------------------------------------------------------------------------
# MXFP4 (GPT-OSS)
# ------------------------------------------------------------------------------------------------


def _mxfp4_args(T=33, H=256, I=256, E=8, k=2, activation="silu", bias=False, seed=0):  # noqa: E741
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=gen) * 0.5).to(torch.bfloat16).cuda()
    w13 = (torch.randn(E, 2 * I, H, generator=gen) * 0.05).cuda()
    w2 = (torch.randn(E, H, I, generator=gen) * 0.05).cuda()
    tw, ids = _routing(T, E, k, gen)
    p13, s13, _ = fp4.quantize(w13, "mxfp4")
    p2, s2, _ = fp4.quantize(w2, "mxfp4")
    biases = {}
    if bias:
        biases = dict(
            w13_bias=(torch.randn(E, 2 * I, generator=gen) * 0.1).to(torch.bfloat16).cuda(),
            w2_bias=(torch.randn(E, H, generator=gen) * 0.1).to(torch.bfloat16).cuda(),
        )
    return MoEArgs(x, p13, p2, tw, ids, activation=activation, w13_scale=s13, w2_scale=s2, **biases)


MXFP4_CASES = [
    dict(activation="silu"),
    dict(activation="swigluoai", bias=True, H=2880, I=2880, E=4, k=2),  # GPT-OSS's activation and padding
]


def _run_mxfp4(kernel, tol, **case):
    args = _mxfp4_args(**case)
    out = fa.run(fa.ADAPTERS[("moe", kernel, "mxfp4")], args, Launch())
    ref = reference(args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    err = _rel(out, ref)
    assert err < tol, f"{kernel} mxfp4 {case}: relative error {err:.3g} >= {tol}"


@SLOW
@_needs(90)
def test_sm90_fp4_interleave_matches_flashinfers_kernel():
    from flashinfer.fused_moe.prepare import interleave_moe_weights_for_sm90_mixed_gemm

    w = torch.randint(0, 256, (3, 256, 192), dtype=torch.uint8, device="cuda")
    assert torch.equal(fmoe._interleave_fp4_sm90(w), interleave_moe_weights_for_sm90_mixed_gemm(w, "fp4"))


@SLOW
@_needs(90)
@pytest.mark.parametrize("case", MXFP4_CASES, ids=lambda c: c["activation"])
def test_cutlass_mxfp4_w4a16_sm90(case):
    _run_mxfp4("flashinfer_cutlass", TOL["mxfp4"], **case)


@_needs(100, 107)
@pytest.mark.parametrize("case", MXFP4_CASES, ids=lambda c: c["activation"])
def test_trtllm_mxfp4_bf16_blackwell(case):
    _run_mxfp4("flashinfer_trtllm", TOL["mxfp4"], **case)


@_needs(100, 103)
def test_cutedsl_mxfp8_mxfp4_blackwell():
    pytest.importorskip("cutlass")
    _run_mxfp4("flashinfer_cutedsl", TOL["mxfp4_mxfp8"], activation="swigluoai")
