"""The rubin.gemm -> FlashInfer adapters (rubin_compile/kernels/flashinfer/gemm.py), built on meta tensors.

Every adapter builds its call for representative shapes (a small one; Qwen3-30B-A3B's q_proj, K = 2048,
N = 4096, at decode M = 1; DeepSeek-V3 TP8's o_proj, K = 2048, N = 7168, at M = 128), binds it to the installed
FlashInfer function's signature, passes its own ``check`` and then FlashInfer's requirement checkers for that
function and backend (the ``@backend_requirement`` checker and the common check in gemm_base.py, called with the
bound arguments). Those checkers read the device for a few facts (``is_sm100a_supported``, the CuTe-DSL arch
probe, cuDNN's library versions); on meta tensors these are patched to the target's answers, named at each test.
``fp8_blockscale_gemm_sm90`` has no checker: its body's checks run with its JIT runner replaced by a recorder.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

pytest.importorskip("flashinfer")

from rubin_compile.kernels.flashinfer import adapter as A  # noqa: E402
from rubin_compile.kernels.flashinfer import gemm as G  # noqa: E402
from rubin_compile.kernels.flashinfer import tables  # noqa: E402
from rubin_compile.ops.gemm import GemmArgs  # noqa: E402
from rubin_compile.ops.registry import KernelSpec, Launch  # noqa: E402
from rubin_compile.target import TARGETS  # noqa: E402

gb = pytest.importorskip("flashinfer.gemm.gemm_base")

BF16, E4M3, U8 = torch.bfloat16, torch.float8_e4m3fn, torch.uint8
# (M, N, K): small; Qwen3-30B-A3B q_proj at decode; DeepSeek-V3 TP8 o_proj at prefill
SHAPES = [(16, 256, 512), (1, 4096, 2048), (128, 7168, 2048)]


def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


def weight(n, k, dtype):
    """An nn.Linear weight [N, K] as rubin.gemm's b: its view .t()."""
    return meta(n, k, dtype=dtype).t()


def bf16_args(M, N, K, bias=False, epilogue="none"):
    return GemmArgs(
        meta(M, K, dtype=BF16),
        weight(N, K, BF16),
        bias=meta(N, dtype=BF16) if bias else None,
        epilogue=epilogue,
    )


def fp8_tensor_args(M, N, K):
    return GemmArgs(meta(M, K, dtype=E4M3), weight(N, K, E4M3), a_scale=meta(), b_scale=meta(), out_dtype=BF16)


def fp8_block_args(M, N, K, w8a8=True, a_kind="group"):
    kb, nb = -(-K // 128), -(-N // 128)
    if not w8a8:
        return GemmArgs(meta(M, K, dtype=BF16), weight(N, K, E4M3), b_scale=meta(kb, nb))
    a_scale = {"group": meta(M, kb), "row": meta(M, 1), "tensor": meta()}[a_kind]
    return GemmArgs(meta(M, K, dtype=E4M3), weight(N, K, E4M3), a_scale=a_scale, b_scale=meta(kb, nb), out_dtype=BF16)


def fp4_args(M, N, K, kind="nvfp4", static=True):
    if kind == "nvfp4":
        return GemmArgs(
            meta(M, K, dtype=BF16),
            weight(N, K // 2, U8),
            b_scale=weight(N, K // 16, E4M3),
            b_scale_2=meta(),
            a_scale=meta() if static else None,
        )
    return GemmArgs(meta(M, K, dtype=BF16), weight(N, K // 2, U8), b_scale=weight(N, K // 32, U8))


def build(kernel, quant, args, pdl=False):
    adapter = A.adapter_for("gemm", kernel, quant)
    assert adapter is not None, (kernel, quant)
    assert A.quant_of("gemm", args) == quant
    call = A.build(adapter, args, Launch(pdl=pdl))
    return adapter, call, call.bound().arguments


def flashinfer_checks(arguments, *checkers):
    """FlashInfer's own requirement checkers (gemm_base.<name>) on the bound arguments; each returns True."""
    for name in checkers:
        assert getattr(gb, name)(**arguments) is True, name


@contextlib.contextmanager
def patched(**values):
    with contextlib.ExitStack() as stack:
        for name, value in values.items():
            stack.enter_context(mock.patch.object(gb, name, value))
        yield


def test_every_gemm_entry_has_an_adapter():
    for kernel, quants in tables.GEMM.items():
        for quant in quants:
            adapter = A.adapter_for("gemm", kernel, quant)
            assert adapter is not None, f"{kernel} {quant}: plan only"
            assert adapter.function in tables.GEMM[kernel][quant].functions


# ------------------------------------------------------------------------------------------------
# BF16
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("M,N,K", SHAPES)
def test_mm_bf16_cudnn(M, N, K):
    adapter, call, bound = build("flashinfer_cudnn", "none", bf16_args(M, N, K, bias=True))
    assert bound["backend"] == "cudnn" and bound["bias"] is not None  # fused
    with patched(CUDNN_AVAILABLE=True):
        flashinfer_checks(bound, "_check_mm_bf16_problem_size", "_cudnn_mm_bf16_requirement")
    assert adapter.prepared_bytes(bf16_args(M, N, K)) == 0  # W.t() is already column-major


@pytest.mark.parametrize("M,N,K", SHAPES)
def test_mm_bf16_cutlass_adds_the_bias_after(M, N, K):
    args = bf16_args(M, N, K, bias=True, epilogue="silu_and_mul")
    _, call, bound = build("flashinfer_cutlass", "none", args, pdl=True)
    assert bound["bias"] is None and bound["pdl"] is False
    flashinfer_checks(bound, "_check_mm_bf16_problem_size", "_cutlass_mm_bf16_requirement")
    out = call.finish(meta(M, N, dtype=BF16))
    assert tuple(out.shape) == (M, N // 2)


@pytest.mark.parametrize("M,N,K", SHAPES)
def test_mm_bf16_cute_dsl(M, N, K):
    _, call, bound = build("flashinfer_cutedsl", "none", bf16_args(M, N, K, bias=True), pdl=True)
    assert bound["pdl"] is True and bound["backend"] == "cute-dsl"
    # _cute_dsl_mm_bf16_requirement asks is_sm100a_supported(a.device): the sm_100 target's answer.
    with patched(is_sm100a_supported=lambda device: True):
        flashinfer_checks(bound, "_check_mm_bf16_problem_size", "_cute_dsl_mm_bf16_requirement")


def test_mm_bf16_copies_a_row_major_b_once():
    args = GemmArgs(meta(4, 512, dtype=BF16), meta(512, 256, dtype=BF16))  # b row-major [K, N]
    adapter = A.adapter_for("gemm", "flashinfer_cudnn", "none")
    assert adapter.prepared_bytes(args) == 512 * 256 * 2
    _, call, _ = build("flashinfer_cudnn", "none", args)
    assert call.args[1].t().is_contiguous()


def test_mm_bf16_check_rejects():
    adapter, call, _ = build("flashinfer_cudnn", "none", bf16_args(16, 256, 512))
    a, b = call.args
    with pytest.raises(A.AdapterCheckError, match="bf16"):
        adapter.check(A.Call(call.function, (a, b.to(torch.float16)), call.kwargs))
    with pytest.raises(A.AdapterCheckError, match="column-major"):
        adapter.check(A.Call(call.function, (a, meta(512, 256, dtype=BF16)), call.kwargs))
    spec = KernelSpec(op="gemm", act_dtype="float16", weight_dtype="float16")
    assert "float16" in adapter.supports(TARGETS["sm90"], spec)


# ------------------------------------------------------------------------------------------------
# FP8 per tensor
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("M,N,K", SHAPES)
def test_bmm_fp8_cublas(M, N, K):
    _, call, bound = build("flashinfer_cublas", "fp8_tensor", fp8_tensor_args(M, N, K))
    assert tuple(bound["A"].shape) == (1, M, K) and tuple(bound["B"].shape) == (1, K, N)
    flashinfer_checks(bound, "_check_bmm_fp8_problem_size", "_cublas_bmm_fp8_requirement")
    assert tuple(call.finish(meta(1, M, N, dtype=BF16)).shape) == (M, N)


@pytest.mark.parametrize("M,N,K", SHAPES)
def test_bmm_fp8_cute_dsl_pads_m_to_16(M, N, K):
    _, call, bound = build("flashinfer_cutedsl", "fp8_tensor", fp8_tensor_args(M, N, K))
    padded = -(-M // 16) * 16
    assert bound["A"].shape[1] == padded
    # _cute_dsl_bmm_fp8_requirement probes the DSL's arch for A.device (a GPU fact): sm_107's answer.
    with patched(_check_cute_dsl_arch=lambda device: None):
        flashinfer_checks(bound, "_check_bmm_fp8_problem_size", "_cute_dsl_bmm_fp8_requirement")
    assert tuple(call.finish(meta(1, padded, N, dtype=BF16)).shape) == (M, N)


def test_bmm_fp8_cute_dsl_table_rule_takes_any_m():
    spec = KernelSpec(
        op="gemm", quant="fp8_tensor", act_dtype="float8_e4m3fn", weight_dtype="float8_e4m3fn",
        shape=(("M", 3), ("N", 4096), ("K", 2048)),
    )  # fmt: skip
    assert tables.GEMM["flashinfer_cutedsl"]["fp8_tensor"].rule(TARGETS["sm107"], spec) is None
    bad = KernelSpec(op="gemm", quant="fp8_tensor", act_dtype="float8_e4m3fn", shape=(("N", 4100), ("K", 2048)))
    assert "N=4100" in tables.GEMM["flashinfer_cutedsl"]["fp8_tensor"].rule(TARGETS["sm107"], bad)


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("kernel", ["flashinfer_cudnn", "flashinfer_cutlass", "flashinfer_trtllm"])
def test_mm_fp8(kernel, M, N, K):
    adapter, call, bound = build(kernel, "fp8_tensor", fp8_tensor_args(M, N, K))
    checker = {
        "flashinfer_cudnn": "_cudnn_mm_fp8_requirement",
        "flashinfer_cutlass": "_cutlass_mm_fp8_requirement",
        "flashinfer_trtllm": "_trtllm_low_latency_gemm_fp8_requirement",
    }[kernel]
    with patched(CUDNN_AVAILABLE=True):
        flashinfer_checks(bound, checker)
    if kernel == "flashinfer_trtllm":
        assert tuple(bound["b"].shape) == (K // 128, N, 128)
        assert adapter.prepared_bytes(fp8_tensor_args(M, N, K)) == N * K
    else:
        assert tuple(bound["b"].shape) == (N, K) and bound["b"].is_contiguous()


def test_fp8_tensor_check_and_supports_reject():
    spec = KernelSpec(op="gemm", quant="fp8_tensor", act_dtype="float32", weight_dtype="float8_e4m3fn")
    for kernel in ("flashinfer_cublas", "flashinfer_cudnn", "flashinfer_cutedsl", "flashinfer_trtllm"):
        assert "FP8 x FP8" in A.adapter_for("gemm", kernel, "fp8_tensor").supports(TARGETS["sm100"], spec)
    cublas = A.adapter_for("gemm", "flashinfer_cublas", "fp8_tensor")
    args = GemmArgs(
        meta(8, 512, dtype=E4M3), weight(256, 512, E4M3), a_scale=meta(), b_scale=meta(), out_dtype=torch.float32
    )
    with pytest.raises(A.AdapterCheckError, match="bf16 / fp16"):
        A.build(cublas, args, Launch())
    _, call, _ = build("flashinfer_cublas", "fp8_tensor", fp8_tensor_args(8, 256, 512))
    A_, B_, sa, sb, dt = call.args
    with pytest.raises(A.AdapterCheckError, match="column-major"):
        cublas.check(A.Call(call.function, (A_, meta(1, 512, 256, dtype=E4M3), sa, sb, dt), call.kwargs))
    cudnn = A.adapter_for("gemm", "flashinfer_cudnn", "fp8_tensor")
    _, call, _ = build("flashinfer_cudnn", "fp8_tensor", fp8_tensor_args(8, 256, 512))
    with pytest.raises(A.AdapterCheckError, match="contiguous"):
        cudnn.check(A.Call(call.function, (call.args[0], call.args[1].t(), call.args[2]), call.kwargs))


# ------------------------------------------------------------------------------------------------
# FP8 128 x 128 blocks
# ------------------------------------------------------------------------------------------------


class _Recorder:
    """fp8_blockscale_gemm_sm90's JIT runner, replaced: the function's own checks run, nothing launches."""

    def __init__(self):
        self.calls = []

    def get_workspace_size(self, M, N, K):
        return 0

    def run_gemm(self, *args):
        self.calls.append(args)


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("w8a8", [False, True])
def test_fp8_blockscale_gemm_sm90(M, N, K, w8a8):
    adapter, call, bound = build("flashinfer_deepgemm", "fp8_block", fp8_block_args(M, N, K, w8a8=w8a8))
    assert tuple(bound["weight"].shape) == (N, K) and tuple(bound["weight_scale"].shape) == (N // 128, K // 128)
    if w8a8:
        assert tuple(bound["input_scale"].shape) == (K // 128, -(-M // 4) * 4)  # M-major, as the kernel reads it
    else:
        assert bound["input_scale"] is None
    recorder = _Recorder()
    # The function's arch check (_match_sm_version(input.device, ["90"])) is the sm_90 target's answer.
    with patched(_match_sm_version=lambda device, versions: True, get_fp8_blockscale_gemm_runner_sm90=lambda: recorder):
        out = tables.resolve(call.function)(*call.args, **call.kwargs)
    assert len(recorder.calls) == 1 and tuple(out.shape) == (M, N) and out.dtype == BF16
    assert adapter.prepared_bytes(fp8_block_args(M, N, K, w8a8=w8a8)) == (N // 128) * (K // 128) * 4


@pytest.mark.parametrize("a_kind", ["tensor", "row", "group"])
def test_fp8_blockscale_group_scales_from_any_a_scale(a_kind):
    M, N, K = 6, 256, 512
    args = fp8_block_args(M, N, K, a_kind=a_kind)
    cpu = GemmArgs(
        torch.zeros(M, K).to(E4M3),
        torch.zeros(N, K).to(E4M3).t(),
        a_scale=torch.arange(1.0, 1.0 + args.a_scale.numel()).reshape(args.a_scale.shape),
        b_scale=torch.ones(K // 128, N // 128),
        out_dtype=BF16,
    )
    groups = G._group_scales(cpu, 8)
    expected = torch.ones(K // 128, 8)
    full = cpu.a_scale.reshape(1, 1) if a_kind == "tensor" else cpu.a_scale.t()
    expected[:, :M] = full.expand(K // 128, M)
    torch.testing.assert_close(groups, expected)
    if a_kind == "group":  # element (k block j, row m) is a_scale[m, j]
        assert groups[3, 5] == cpu.a_scale[5, 3]


def test_fp8_blockscale_check_and_supports_reject():
    adapter, call, _ = build("flashinfer_deepgemm", "fp8_block", fp8_block_args(16, 256, 512))
    a, w, sa, sw = call.args
    with pytest.raises(A.AdapterCheckError, match="M-major"):
        adapter.check(A.Call(call.function, (a, w, sa.t().contiguous(), sw), call.kwargs))
    with pytest.raises(A.AdapterCheckError, match="weight_scale"):
        adapter.check(A.Call(call.function, (a, w, sa, sw.t()), call.kwargs))
    spec = KernelSpec(
        op="gemm", quant="fp8_block", act_dtype="float16", weight_dtype="float8_e4m3fn", block_shape=(128, 128)
    )
    assert "float16" in adapter.supports(TARGETS["sm90"], spec)
    odd = KernelSpec(
        op="gemm", quant="fp8_block", act_dtype="bfloat16", weight_dtype="float8_e4m3fn", shape=(("N", 96),)
    )
    assert "N=96" in adapter.supports(TARGETS["sm90"], odd)


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("kernel", ["flashinfer_cutlass", "flashinfer_trtllm"])
def test_gemm_fp8_nt_groupwise(kernel, M, N, K):
    _, call, bound = build(kernel, "fp8_block", fp8_block_args(M, N, K))
    Mp = -(-M // 4) * 4
    assert tuple(bound["a"].shape) == (Mp, K)
    checker = {
        "flashinfer_cutlass": "_cutlass_gemm_fp8_nt_groupwise_requirement",
        "flashinfer_trtllm": "_trtllm_gemm_fp8_nt_groupwise_requirement",
    }[kernel]
    flashinfer_checks(bound, "_check_gemm_fp8_nt_groupwise_problem_size", checker)
    assert tuple(call.finish(meta(Mp, N, dtype=BF16)).shape) == (M, N)


def test_gemm_fp8_nt_groupwise_check_rejects():
    adapter, call, _ = build("flashinfer_trtllm", "fp8_block", fp8_block_args(8, 256, 512))
    a, w, sa, sw = call.args
    with pytest.raises(A.AdapterCheckError, match="contiguous along M"):
        adapter.check(A.Call(call.function, (a, w, sa.contiguous(), sw), call.kwargs))
    spec = KernelSpec(op="gemm", quant="fp8_block", act_dtype="float32", weight_dtype="float8_e4m3fn")
    assert "FP8 x FP8" in adapter.supports(TARGETS["sm100"], spec)


# ------------------------------------------------------------------------------------------------
# FP4
# ------------------------------------------------------------------------------------------------


def test_swizzle_128x4_is_flashinfers_layout():
    """Each byte lands where FlashInfer's 128x4 layout puts it: tile (r // 128, c // 4) of 512 bytes, row-block
    major, and in the tile (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4 (the layout nvfp4_quantize documents)."""
    R, C = 130, 5
    sf = torch.arange(1, R * C + 1, dtype=torch.int64).remainder(251).add(1).to(U8).reshape(R, C)
    out = G._swizzle_128x4(sf)
    assert tuple(out.shape) == (256, 8)
    flat = out.reshape(-1)
    tiles_per_row_block = 8 // 4
    for r in range(R):
        for c in range(C):
            tile = (r // 128) * tiles_per_row_block + c // 4
            offset = tile * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4
            assert flat[offset] == sf[r, c]
    assert int((flat != 0).sum()) == R * C  # the padding is zero


BACKEND_CHECKERS = {
    "flashinfer_cutlass": "_cutlass_gemm_fp4_requirement",
    "flashinfer_cudnn": "_cudnn_gemm_fp4_requirement",
    "flashinfer_trtllm": "_trtllm_gemm_fp4_requirement",
    "flashinfer_cutedsl": "_cute_dsl_gemm_fp4_requirement",
}
FP4_CASES = [(k, "nvfp4") for k in BACKEND_CHECKERS] + [("flashinfer_cudnn", "mxfp4"), ("flashinfer_cutedsl", "mxfp4")]


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("kernel,quant", FP4_CASES)
def test_mm_fp4(kernel, quant, M, N, K):
    adapter, call, bound = build(kernel, quant, fp4_args(M, N, K, quant), pdl=True)
    bs = 16 if quant == "nvfp4" else 32
    assert bound["use_nvfp4"] is (quant == "nvfp4") and bound["block_size"] == bs
    assert tuple(bound["a"].shape) == (M, K // 2) and tuple(bound["b"].shape) == (K // 2, N)
    assert tuple(bound["a_descale"].shape) == (-(-M // 128) * 128, -(-(K // bs) // 4) * 4)
    assert tuple(bound["b_descale"].shape) == (-(-(K // bs) // 4) * 4, -(-N // 128) * 128)
    assert (bound["alpha"] is None) is (quant == "mxfp4")
    # Device facts the checkers read: cuDNN's library versions, the SM12x test, the CuTe-DSL probes (sm_100).
    with patched(
        CUDNN_AVAILABLE=True,
        _check_cudnn_fp4_availability=lambda: None,
        _match_sm_version=lambda device, versions: False,
        _check_cute_dsl_availability=lambda: None,
        _check_cute_dsl_arch=lambda device: None,
    ):
        flashinfer_checks(bound, "_check_mm_fp4_problem_size", BACKEND_CHECKERS[kernel])
    assert adapter.prepared_bytes(fp4_args(M, N, K, quant)) == N * K // 2 + bound["b_descale"].numel()


def test_mm_fp4_dynamic_activation_scale():
    _, call, bound = build("flashinfer_cutlass", "nvfp4", fp4_args(16, 256, 512, static=False))
    assert bound["alpha"] is not None and bound["alpha"].numel() == 1


def test_mm_fp4_check_and_supports_reject():
    adapter, call, _ = build("flashinfer_trtllm", "nvfp4", fp4_args(16, 256, 512))
    a, b, a_sf, b_sf, alpha, dt = call.args
    with pytest.raises(A.AdapterCheckError, match="b_descale"):
        adapter.check(A.Call(call.function, (a, b, a_sf, b_sf.t(), alpha, dt), call.kwargs))
    with pytest.raises(A.AdapterCheckError, match="output dtype"):
        adapter.check(A.Call(call.function, (a, b, a_sf, b_sf, alpha, torch.float16), call.kwargs))
    spec = KernelSpec(op="gemm", quant="nvfp4", act_dtype="bfloat16", weight_dtype="uint8", shape=(("N", 192),))
    assert "N=192" in adapter.supports(TARGETS["sm100"], spec)


def test_sm90_entries_are_declared_for_sm90():
    assert 90 in tables.declared_ccs(tables.GEMM["flashinfer_cublas"]["fp8_tensor"])
    assert tables.declared_ccs(tables.GEMM["flashinfer_deepgemm"]["fp8_block"]) == frozenset({90})
    assert max(tables.PRIORITIES[("gemm", "flashinfer_cublas")].values()) < 30  # below torch._scaled_mm


def test_deepgemm_is_chosen_where_it_measured_faster():
    """sm_90, weight-only FP8 block: DeepGEMM above our Triton GEMM at M > 64, at a symbolic M and for weights of
    >= 12M elements; ours below that; W8A8 block (not measured against ours) not chosen."""
    from rubin_compile.ops.gemm import GEMM

    def chosen(act, **shape):
        spec = KernelSpec(
            op="gemm",
            quant="fp8_block",
            act_dtype=act,
            weight_dtype="float8_e4m3fn",
            block_shape=(128, 128),
            shape=tuple(shape.items()),
        )
        return GEMM.select(spec, TARGETS["sm90"])

    assert chosen("bfloat16", M=128, N=4096, K=2048).chosen.name == "flashinfer_deepgemm"
    assert chosen("bfloat16", N=4096, K=2048).chosen.name == "flashinfer_deepgemm"  # symbolic M
    assert chosen("bfloat16", M=1, N=6144, K=4096).chosen.name == "flashinfer_deepgemm"
    small = chosen("bfloat16", M=1, N=4096, K=2048)
    assert small.chosen.name != "flashinfer_deepgemm"
    assert "our Triton GEMM measured faster" in dict(small.rejected)["flashinfer_deepgemm"]
    w8a8 = chosen("float8_e4m3fn", M=128, N=4096, K=2048)
    assert "not measured" in dict(w8a8.rejected)["flashinfer_deepgemm"]


@pytest.mark.parametrize(
    "kernel", ["flashinfer_cublas", "flashinfer_cudnn", "flashinfer_cutedsl", "flashinfer_cutlass"]
)
def test_weight_only_fp8_quantises_the_activation_per_call(kernel):
    """bf16 a with an FP8 weight (what rubin.dequantize folds into): the call gets an e4m3 a and one fp32 scale, and
    binds as the W8A8 call does."""
    args = GemmArgs(meta(8, 512, dtype=torch.bfloat16), weight(256, 512, E4M3), b_scale=meta())
    adapter = A.adapter_for("gemm", kernel, "fp8_tensor")
    spec = KernelSpec(op="gemm", quant="fp8_tensor", act_dtype="bfloat16", weight_dtype="float8_e4m3fn")
    assert adapter.supports(TARGETS["sm100"], spec) is None
    call = A.build(adapter, args, Launch())
    call.bound()
    assert call.args[0].dtype == E4M3


def test_weight_only_fp8_block_quantises_the_activation_per_group():
    args = fp8_block_args(6, 256, 512, w8a8=False)
    for kernel in ("flashinfer_cutlass", "flashinfer_trtllm"):
        adapter = A.adapter_for("gemm", kernel, "fp8_block")
        call = A.build(adapter, args, Launch())
        call.bound()
        a, _, sa, _ = call.args
        assert a.dtype == E4M3 and a.shape[0] == 8  # padded to a multiple of 4
