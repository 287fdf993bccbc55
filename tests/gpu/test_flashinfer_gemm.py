"""The rubin.gemm -> FlashInfer adapters that run on sm_90 (the H200), against ``ops.gemm.reference``.

Each test runs ``adapter.run(adapter, args, launch)`` (prepare, call, check, FlashInfer, finish) and compares
with the op's reference by relative Frobenius error ``|out - ref| / |ref|``:

* bf16 GEMMs and W8A8 FP8 with the reference's exact dequantisation: 1e-2 (bf16 rounding of the output, and of
  a bias added after the kernel, accumulation order);
* fp8_blockscale_gemm_sm90 weight-only: the kernel quantises the bf16 activations itself per 1 x 128 group to
  e4m3 (3 mantissa bits, ~2-4 % error per element), where the reference does not: 6e-2.

The W8A8 block test draws its per-group activation scales from [0.25, 4] so that a wrong scale layout (the
kernel reads them M-major, not as the [M, K/128] the docstring shows) fails it by far. JIT compiles take 20-60 s
per kernel on first use, so the shapes are few.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("flashinfer")

from rubin_compile.kernels.flashinfer import adapter as A  # noqa: E402
from rubin_compile.kernels.flashinfer import gemm as G  # noqa: E402
from rubin_compile.ops import gemm as ops_gemm  # noqa: E402
from rubin_compile.ops.gemm import GemmArgs  # noqa: E402
from rubin_compile.ops.registry import Launch  # noqa: E402

CUDA = torch.cuda.is_available()
CC = torch.cuda.get_device_capability() if CUDA else (0, 0)
pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
sm89_plus = pytest.mark.skipif(CC < (8, 9), reason="FP8 tensor cores: sm_89+")
sm90_only = pytest.mark.skipif(CC != (9, 0), reason="fp8_blockscale_gemm_sm90 runs on sm_90 only")

E4M3 = torch.float8_e4m3fn
BF16 = torch.bfloat16
MS = (1, 16, 128)
N, K = 512, 1024


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def to_fp8(x: torch.Tensor):
    """Per-tensor e4m3 quantisation: (x / scale) in e4m3, and the dequantising float32 scale []."""
    scale = (x.abs().amax().float() / 448.0).clamp(min=1e-12)
    return (x.float() / scale).to(E4M3), scale


def run(kernel: str, quant: str, args: GemmArgs) -> torch.Tensor:
    adapter = A.adapter_for("gemm", kernel, quant)
    assert A.quant_of("gemm", args) == quant
    return A.run(adapter, args, Launch())


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@sm89_plus
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("epilogue", ["none", "silu_and_mul"])
def test_bmm_fp8_cublas(M, epilogue):
    a, sa = to_fp8(torch.randn(M, K, device="cuda"))
    w, sb = to_fp8(torch.randn(N, K, device="cuda") / K**0.5)
    bias = torch.randn(N, device="cuda", dtype=BF16)
    args = GemmArgs(a, w.t(), bias=bias, epilogue=epilogue, a_scale=sa, b_scale=sb, out_dtype=BF16)
    assert rel_err(run("flashinfer_cublas", "fp8_tensor", args), ops_gemm.reference(args)) < 1e-2


@pytest.mark.parametrize("M", MS)
def test_mm_bf16_cudnn(M):
    pytest.importorskip("cudnn")
    a = torch.randn(M, K, device="cuda", dtype=BF16)
    w = torch.randn(N, K, device="cuda", dtype=BF16) / K**0.5
    bias = torch.randn(N, device="cuda", dtype=BF16)
    args = GemmArgs(a, w.t(), bias=bias)
    assert rel_err(run("flashinfer_cudnn", "none", args), ops_gemm.reference(args)) < 1e-2


@sm89_plus
@pytest.mark.parametrize("M", MS)
def test_mm_fp8_cudnn(M):
    pytest.importorskip("cudnn")
    a, sa = to_fp8(torch.randn(M, K, device="cuda"))
    w, sb = to_fp8(torch.randn(N, K, device="cuda") / K**0.5)
    residual = torch.randn(M, N, device="cuda", dtype=BF16)
    args = GemmArgs(a, w.t(), epilogue="residual_add", residual=residual, a_scale=sa, b_scale=sb, out_dtype=BF16)
    assert rel_err(run("flashinfer_cudnn", "fp8_tensor", args), ops_gemm.reference(args)) < 1e-2


def block_quantized_weight():
    """W [N, K] in e4m3 with 128 x 128 block scales; rubin's b_scale [K/128, N/128] (the .t() of W's)."""
    w = torch.randn(N, K, device="cuda") / K**0.5
    blocks = w.reshape(N // 128, 128, K // 128, 128)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)  # [N/128, K/128]
    q = (blocks / scale[:, None, :, None]).reshape(N, K).to(E4M3)
    return q, scale.t().contiguous()


@sm90_only
@pytest.mark.parametrize("M", MS)
def test_fp8_blockscale_gemm_sm90_weight_only(M):
    w, b_scale = block_quantized_weight()
    a = torch.randn(M, K, device="cuda", dtype=BF16)
    bias = torch.randn(N, device="cuda", dtype=BF16)
    args = GemmArgs(a, w.t(), bias=bias, b_scale=b_scale)
    assert rel_err(run("flashinfer_deepgemm", "fp8_block", args), ops_gemm.reference(args)) < 6e-2


@sm90_only
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("a_kind", ["group", "tensor"])
def test_fp8_blockscale_gemm_sm90_w8a8(M, a_kind):
    w, b_scale = block_quantized_weight()
    a = torch.randn(M, K, device="cuda").to(E4M3)  # e4m3 values; the scales below are what they stand for
    if a_kind == "group":
        a_scale = torch.empty(M, K // 128, device="cuda").uniform_(0.25, 4.0)
    else:
        a_scale = torch.tensor(0.5, device="cuda")
    args = GemmArgs(a, w.t(), a_scale=a_scale, b_scale=b_scale, out_dtype=BF16)
    assert rel_err(run("flashinfer_deepgemm", "fp8_block", args), ops_gemm.reference(args)) < 2e-2


def test_swizzle_128x4_matches_block_scale_interleave():
    """The torch swizzle of FP4 scale factors that prepare uses equals FlashInfer's GPU kernel (which has an sm_90
    build) on a shape with row and column padding."""
    from flashinfer.quantization.fp4_quantization import block_scale_interleave

    sf = torch.randint(0, 256, (300, 10), device="cuda", dtype=torch.uint8)
    ours = G._swizzle_128x4(sf).reshape(-1)
    theirs = block_scale_interleave(sf).reshape(-1)
    assert ours.shape == theirs.shape and torch.equal(ours, theirs)
