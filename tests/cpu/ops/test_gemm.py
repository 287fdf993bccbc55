"""The canonical rubin.gemm op: semantics against float64 and torch._scaled_mm, epilogues, errors, fake impl."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rubin_compile.ops.gemm import GemmArgumentError, gemm_reference
from tests.conftest import ROWWISE_SKIP

E4M3 = torch.float8_e4m3fn


def dense_gemm(a, b, bias=None, epilogue="none", residual=None, a_scale=None, b_scale=None):
    """Float64 restatement of the documented semantics (independent of the op's code)."""
    a, b = a.double(), b.double()
    if a_scale is not None:
        a = a * a_scale.double().reshape(-1, 1) if a_scale.numel() > 1 else a * a_scale.double().reshape(())
        b = b * b_scale.double().reshape(1, -1) if b_scale.numel() > 1 else b * b_scale.double().reshape(())
    y = a @ b + (0 if bias is None else bias.double())
    half = y.shape[1] // 2
    if epilogue == "silu_and_mul":
        return F.silu(y[:, :half]) * y[:, half:]
    if epilogue == "gelu_tanh_and_mul":
        return F.gelu(y[:, :half], approximate="tanh") * y[:, half:]
    if epilogue == "residual_add":
        return y + residual.double()
    return y


def make(M=6, K=24, N=10, dtype=torch.float32):
    a = torch.randn(M, K, dtype=dtype)
    w = torch.randn(N, K, dtype=dtype) * 0.3  # an nn.Linear weight [N, K]; b is its free view w.t()
    return a, w.t(), torch.randn(N, dtype=dtype), torch.randn(M, N, dtype=dtype)


@pytest.mark.parametrize("epilogue", ["none", "silu_and_mul", "gelu_tanh_and_mul", "residual_add"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_reference_matches_documented_semantics(epilogue, with_bias):
    a, b, bias, res = make()
    bias = bias if with_bias else None
    res = res if epilogue == "residual_add" else None
    got = torch.ops.rubin.gemm(a, b, bias, epilogue, res)
    assert got.shape == (6, 5 if epilogue.endswith("_and_mul") else 10) and got.dtype == a.dtype
    torch.testing.assert_close(got.double(), dense_gemm(a, b, bias, epilogue, res), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
def test_half_precision_close_to_float64(dtype, tol):
    a, b, bias, _ = make(dtype=dtype)
    got = torch.ops.rubin.gemm(a, b, bias, "silu_and_mul")
    want = dense_gemm(a, b, bias, "silu_and_mul")
    assert got.dtype == dtype and (got.double() - want).norm() / want.norm() < tol


def test_unquantised_is_eager_addmm_exactly():
    """Bias inside addmm, epilogue on the result: bit-identical to the eager code a linear layer runs."""
    a, b, bias, _ = make(dtype=torch.bfloat16)
    y = torch.addmm(bias, a, b)
    assert torch.equal(torch.ops.rubin.gemm(a, b, bias, "silu_and_mul"), F.silu(y[:, :5]) * y[:, 5:])


@pytest.mark.parametrize("scales", ["tensor", pytest.param("rowwise", marks=ROWWISE_SKIP)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fp8_is_scaled_mm(scales, out_dtype):
    """FP8 a / b with per-tensor or per-row / per-column scales: torch._scaled_mm's semantics (which runs on the
    CPU in torch 2.13), and float64 dequantised math."""
    M, K, N = 16, 32, 24
    a = torch.randn(M, K).to(E4M3)
    b = torch.randn(N, K).to(E4M3).t()  # column-major [K, N], as _scaled_mm wants it
    sa, sb = (
        (torch.tensor(0.5), torch.tensor(2.0))
        if scales == "tensor"
        else (torch.rand(M, 1) + 0.5, torch.rand(1, N) + 0.5)
    )
    bias = torch.randn(N, dtype=out_dtype)
    got = torch.ops.rubin.gemm(a, b, bias, a_scale=sa, b_scale=sb, out_dtype=out_dtype)
    want = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, bias=bias, out_dtype=out_dtype)
    assert got.dtype == out_dtype
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(
        got.double(), dense_gemm(a.float(), b.float(), bias, a_scale=sa, b_scale=sb), rtol=tol, atol=tol
    )


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: a.update(epilogue="relu"), "epilogue='relu' is not supported"),
        (lambda a: a.update(a=a["a"][:, :-1]), "a is \\[M, K=23\\]"),
        (lambda a: a.update(b=a["b"].double()), "must have one dtype"),
        (lambda a: a.update(bias=a["bias"][:-1]), "bias must be"),
        (lambda a: a.update(epilogue="residual_add"), "residual is given exactly"),
        (lambda a: a.update(residual=a["a"][:, :10].contiguous()), "residual is given exactly"),
        (lambda a: a.update(b=a["b"][:, :9], bias=None), "even N"),
        (lambda a: a.update(out_dtype=torch.bfloat16), "only FP8 GEMMs change dtype"),
        (lambda a: a.update(a=a["a"].to(E4M3), b=a["b"].to(E4M3)), "need a_scale and b_scale"),
        (
            lambda a: a.update(
                a=a["a"].to(E4M3),
                b=a["b"].to(E4M3),
                a_scale=torch.ones(3),
                b_scale=torch.ones(()),
                out_dtype=torch.float32,
                bias=None,
            ),
            "a_scale must be per tensor",
        ),
        (
            lambda a: a.update(
                a=a["a"].to(E4M3), b=a["b"].to(E4M3), a_scale=torch.ones(()), b_scale=torch.ones(()), bias=None
            ),
            "need out_dtype",
        ),
    ],
)
def test_bad_arguments_are_clear_errors(mutate, message):
    a, b, bias, _ = make()
    args = dict(a=a, b=b, bias=bias, epilogue="silu_and_mul")
    mutate(args)
    with pytest.raises(GemmArgumentError, match=message):
        torch.ops.rubin.gemm(**args)
    with pytest.raises(GemmArgumentError, match=message):
        gemm_reference(**args)


def test_fake_impl_and_opcheck():
    a, b, bias, res = make()
    torch.library.opcheck(torch.ops.rubin.gemm.default, (a, b), {"bias": bias, "epilogue": "silu_and_mul"})
    torch.library.opcheck(torch.ops.rubin.gemm.default, (a, b), {"epilogue": "residual_add", "residual": res})
    with torch._subclasses.FakeTensorMode() as mode:
        out = torch.ops.rubin.gemm(mode.from_tensor(a), mode.from_tensor(b), epilogue="silu_and_mul")
    assert out.shape == (6, 5) and out.dtype == a.dtype


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_kernel_spec_for_selection(fp8):
    """What select_kernels reads from a rubin.gemm node; the registry accepts it for every target."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from rubin_compile.ops.gemm import GEMM, gemm_spec
    from rubin_compile.target import resolve

    a, b, _, _ = make(M=16, K=32, N=64, dtype=torch.bfloat16)
    sa, sb = torch.tensor(1.0), torch.tensor(1.0)
    if fp8:
        a, b = a.to(E4M3), b.to(E4M3)

    def fn(a, b, sa, sb):
        if fp8:
            return torch.ops.rubin.gemm(a, b, epilogue="silu_and_mul", a_scale=sa, b_scale=sb, out_dtype=torch.bfloat16)
        return torch.ops.rubin.gemm(a, b, epilogue="silu_and_mul")

    gm = make_fx(fn, tracing_mode="fake")(a, b, sa, sb)
    (node,) = [n for n in gm.graph.nodes if n.target is torch.ops.rubin.gemm.default]
    spec = gemm_spec(node)
    assert spec.op == "gemm" and spec.quant == ("fp8_tensor" if fp8 else "none")
    assert spec.act_dtype == ("float8_e4m3fn" if fp8 else "bfloat16") and spec.activation == "silu_and_mul"
    assert (spec.dim("M"), spec.dim("N"), spec.dim("K")) == (16, 64, 32)
    for name in ("cpu", "sm90", "sm107"):
        assert GEMM.select(spec, resolve(name)).chosen.name
    assert GEMM.select(spec, resolve("cpu")).chosen.name == "reference"
