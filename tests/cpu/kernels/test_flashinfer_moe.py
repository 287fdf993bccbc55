"""The FlashInfer MoE adapters (rubin_compile/kernels/flashinfer/moe.py) on the CPU.

Every registered (moe, kernel, quant) adapter builds its call on meta tensors for the example models' MoE shapes
(Qwen3-30B-A3B: H 2048, I 768, E 128, k 8; DeepSeek-V3 at TP8: H 7168, I 256, E 256, k 8; a small one), binds it
to the installed FlashInfer function's signature and runs the adapter's ``check``; FlashInfer's own declarations
are asked too: ``is_trtllm_moe_supported`` (its device lookup patched to answer cc 10.0) for the dtypes each
trtllm-gen call passes, and ``@supported_compute_capability`` of the CuTe-DSL functions. The weight layouts are
checked numerically on small CPU tensors: rubin's ``[gate; up]`` rows land where each kernel reads up and gate,
and the torch 128x4 scale swizzle is the inverse of FlashInfer's own unswizzle
(trace/templates/gemm.py:_unswizzle_batched_sf_128x4). The kernels run in tests/gpu/test_flashinfer_moe.py.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

pytest.importorskip("flashinfer")

from rubin_compile import target as target_mod  # noqa: E402
from rubin_compile.kernels.flashinfer import adapter as fa  # noqa: E402
from rubin_compile.kernels.flashinfer import moe as fmoe  # noqa: E402
from rubin_compile.kernels.flashinfer.adapter import AdapterCheckError, Call  # noqa: E402
from rubin_compile.ops.moe import MoEArgs  # noqa: E402
from rubin_compile.ops.registry import CANONICAL_OPS, KernelSpec, Launch  # noqa: E402

import rubin_compile.kernels.flashinfer  # noqa: E402, F401  (registers the adapters)

FP8 = torch.float8_e4m3fn
SHAPES = {  # name: (T, H, I, E, k)
    "qwen3-30b-a3b": (5, 2048, 768, 128, 8),
    "deepseek-v3-tp8": (3, 7168, 256, 256, 8),
    "small": (4, 256, 128, 8, 2),
}
MOE_ADAPTERS = sorted(key for key in fa.ADAPTERS if key[0] == "moe")


def _args(quant, T, H, I, E, k, device="meta", dtype=torch.bfloat16, static_scales=True):  # noqa: E741
    def t(*shape, dt=torch.float32):
        return torch.empty(shape, dtype=dt, device=device)

    x, ids, w = t(T, H, dt=dtype), t(T, k, dt=torch.int64), t(T, k)
    kw = {}
    acts = dict(a13_scale=t(), a2_scale=t()) if static_scales else {}
    if quant == "none":
        w13, w2 = t(E, 2 * I, H, dt=dtype), t(E, H, I, dt=dtype)
    elif quant == "fp8_tensor":
        w13, w2 = t(E, 2 * I, H, dt=FP8), t(E, H, I, dt=FP8)
        kw = dict(w13_scale=t(E), w2_scale=t(), **acts)
    elif quant == "fp8_block":
        w13, w2 = t(E, 2 * I, H, dt=FP8), t(E, H, I, dt=FP8)
        kw = dict(w13_scale=t(E, 2 * I // 128, H // 128), w2_scale=t(E, H // 128, I // 128), block_shape=[128, 128])
    elif quant == "nvfp4":
        w13, w2 = t(E, 2 * I, H // 2, dt=torch.uint8), t(E, H, I // 2, dt=torch.uint8)
        kw = dict(
            w13_scale=t(E, 2 * I, H // 16, dt=FP8), w2_scale=t(E, H, I // 16, dt=FP8), w13_scale_2=t(E), w2_scale_2=t(E)
        )
        kw.update(acts)
    elif quant == "mxfp4":
        w13, w2 = t(E, 2 * I, H // 2, dt=torch.uint8), t(E, H, I // 2, dt=torch.uint8)
        kw = dict(w13_scale=t(E, 2 * I, H // 32, dt=torch.uint8), w2_scale=t(E, H, I // 32, dt=torch.uint8))
    else:
        raise AssertionError(quant)
    return MoEArgs(x, w13, w2, w, ids, **kw)


def _spec(quant, H, I, E, k, act="bfloat16", static=True):  # noqa: E741
    weight = {"none": act, "nvfp4": "uint8", "mxfp4": "uint8"}.get(quant, "float8_e4m3fn")
    return KernelSpec(
        op="moe",
        quant=quant,
        act_dtype=act,
        weight_dtype=weight,
        block_shape=(128, 128) if quant == "fp8_block" else None,
        shape=(("E", E), ("H", H), ("I", I), ("k", k)),
        activation="silu",
        static_input_scales=static,
    )


def _target_for(kernel, quant):
    if kernel == "flashinfer_cutedsl" and quant == "none":
        return target_mod.TARGETS["sm90"]
    if kernel == "flashinfer_cutlass" and quant in ("fp8_block", "mxfp4"):
        return target_mod.TARGETS["sm90"]
    return target_mod.TARGETS["sm100"]


def _replace(call: Call, name: str, value) -> Call:
    """``call`` with its argument ``name`` (positional or keyword) replaced by ``value``."""
    bound = call.bound()
    bound.arguments[name] = value
    return dataclasses.replace(call, args=bound.args, kwargs=bound.kwargs)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("key", MOE_ADAPTERS, ids=lambda k: f"{k[1]}-{k[2]}")
def test_builds_binds_and_checks_on_meta(key, shape):
    _, kernel, quant = key
    T, H, I, E, k = SHAPES[shape]  # noqa: E741
    adapter = fa.ADAPTERS[key]
    target = _target_for(kernel, quant)
    spec = _spec(quant, H, I, E, k)
    # the kernel as selection sees it: the entry's rule and the adapter's limits accept these shapes
    assert CANONICAL_OPS["moe"].kernel(kernel).supports(target, spec) is None
    args = _args(quant, T, H, I, E, k)
    call = fa.build(adapter, args, Launch(pdl=True))  # prepare, call, check
    bound = call.bound()
    assert call.function == adapter.function
    if "enable_pdl" in bound.arguments:
        assert bound.arguments["enable_pdl"] is True
    assert adapter.prepared_bytes(args) > 0
    out = call.finish([torch.empty(T, H, dtype=torch.bfloat16, device="meta")])
    assert out.shape == (T, H) and out.dtype == args.hidden_states.dtype


def _trtllm_dtype(t: torch.Tensor, scale_len=None):
    from flashinfer.fused_moe.core import DtypeTrtllmGen

    if t.dtype == torch.bfloat16:
        return DtypeTrtllmGen.Bfloat16
    if t.dtype == FP8:
        return DtypeTrtllmGen.E4m3
    return DtypeTrtllmGen.E2m1


@pytest.mark.parametrize("quant", ["none", "fp8_tensor", "fp8_block", "nvfp4"])
def test_trtllm_dtypes_pass_flashinfers_support_check(quant, monkeypatch):
    """core.py:is_trtllm_moe_supported for the weight / activation dtypes the call passes, on cc 10.0 (its
    ``get_compute_capability`` is patched: this machine has no GPU)."""
    from flashinfer.fused_moe import core

    monkeypatch.setattr(core, "get_compute_capability", lambda device: (10, 0))
    monkeypatch.setattr(core.torch.cuda, "current_device", lambda: 0)
    adapter = fa.ADAPTERS[("moe", "flashinfer_trtllm", quant)]
    call = fa.build(adapter, _args(quant, *SHAPES["small"]), Launch())
    b = call.bound().arguments
    assert core.is_trtllm_moe_supported(_trtllm_dtype(b["gemm1_weights"]), _trtllm_dtype(b["hidden_states"]))


def test_cute_dsl_declared_ccs():
    from rubin_compile.kernels.flashinfer.tables import resolve

    assert resolve(fa.ADAPTERS[("moe", "flashinfer_cutedsl", "nvfp4")].function).is_compute_capability_supported(107)
    assert resolve(fa.ADAPTERS[("moe", "flashinfer_cutedsl", "none")].function).is_compute_capability_supported(90)


# ------------------------------------------------------------------------------------------------
# check() and supports() say no
# ------------------------------------------------------------------------------------------------


def _small_call(kernel, quant):
    adapter = fa.ADAPTERS[("moe", kernel, quant)]
    return adapter, fa.build(adapter, _args(quant, *SHAPES["small"]), Launch())


def test_trtllm_check_catches_bf16_activations_for_nvfp4():
    adapter, call = _small_call("flashinfer_trtllm", "nvfp4")
    bad = _replace(call, "hidden_states", torch.empty(4, 256, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(AdapterCheckError, match="hidden_states must be torch.uint8"):
        adapter.check(bad)


def test_trtllm_check_catches_wrong_block_scale_shape():
    adapter, call = _small_call("flashinfer_trtllm", "fp8_block")
    bad = _replace(call, "hidden_states_scale", torch.empty(4, 2, device="meta"))  # [T, H/128], not transposed
    with pytest.raises(AdapterCheckError, match="hidden_states_scale must be"):
        adapter.check(bad)


def test_trtllm_check_catches_int64_routing_ids():
    adapter, call = _small_call("flashinfer_trtllm", "none")
    ids, w = call.bound().arguments["topk_ids"]
    with pytest.raises(AdapterCheckError, match="int32"):
        adapter.check(_replace(call, "topk_ids", (ids.to(torch.int64), w)))


def test_cutedsl_check_catches_wrong_scale_layout():
    adapter, call = _small_call("flashinfer_cutedsl", "nvfp4")
    linear = torch.empty(8, 256, 16, dtype=FP8, device="meta")  # the linear scales, not the MMA view
    with pytest.raises(AdapterCheckError, match="w1_weight_sf must be"):
        adapter.check(_replace(call, "w1_weight_sf", linear))


def test_cutlass_check_catches_unswapped_dtype():
    adapter, call = _small_call("flashinfer_cutlass", "nvfp4")
    packed = call.bound().arguments["fc1_expert_weights"].view(torch.uint8)  # not viewed as int64
    with pytest.raises(AdapterCheckError, match="fc1_expert_weights must be torch.int64"):
        adapter.check(_replace(call, "fc1_expert_weights", packed))


def test_biases_are_refused():
    T, H, I, E, k = SHAPES["small"]  # noqa: E741
    args = dataclasses.replace(_args("none", T, H, I, E, k), w13_bias=torch.empty(E, 2 * I, device="meta"))
    with pytest.raises(AdapterCheckError, match="biases"):
        fa.build(fa.ADAPTERS[("moe", "flashinfer_trtllm", "none")], args, Launch())


@pytest.mark.parametrize("kernel", ["flashinfer_trtllm", "flashinfer_cutedsl", "flashinfer_cutlass"])
def test_nvfp4_without_static_activation_scales_is_rejected(kernel):
    reason = (
        CANONICAL_OPS["moe"]
        .kernel(kernel)
        .supports(target_mod.TARGETS["sm100"], _spec("nvfp4", 2048, 768, 128, 8, static=False))
    )
    assert reason and "a13_scale" in reason and "a2_scale" in reason


@pytest.mark.parametrize(
    "kernel, quant, shape, words",
    [
        ("flashinfer_trtllm", "nvfp4", (2048, 768, 128, 40), "top_k <= 32"),
        ("flashinfer_trtllm", "fp8_block", (2048, 64, 128, 8), "I=64 must be a multiple of 128"),
        ("flashinfer_cutedsl", "nvfp4", (2048, 32, 128, 8), "I=32 must be a multiple of 64"),
        ("flashinfer_cutedsl", "nvfp4", (2112, 768, 128, 8), "H=2112 must be a multiple of 128"),
    ],
)
def test_shape_rules_reject_with_a_reason(kernel, quant, shape, words):
    reason = CANONICAL_OPS["moe"].kernel(kernel).supports(target_mod.TARGETS["sm100"], _spec(quant, *shape))
    assert reason and words in reason


# ------------------------------------------------------------------------------------------------
# the layouts, numerically (small CPU tensors)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows, cols", [(256, 8), (128, 4), (200, 6), (384, 48)])
def test_swizzle_128x4_is_the_inverse_of_flashinfers_unswizzle(rows, cols):
    from flashinfer.trace.templates.gemm import _unswizzle_batched_sf_128x4

    sf = torch.randint(0, 256, (3, rows, cols), dtype=torch.uint8)
    swizzled = fmoe._swizzle_128x4(sf)
    assert swizzled.shape == (3, -(-rows // 128) * 128, -(-cols // 4) * 4)
    assert torch.equal(_unswizzle_batched_sf_128x4(swizzled.reshape(-1), 3, rows, cols), sf)


def _marked(E, inter, H, dtype=torch.bfloat16):
    """w13 whose row r of expert e holds the value r + 1000 e (so a layout can be read back), gate rows first."""
    rows = torch.arange(2 * inter, dtype=torch.float32)[None, :, None] + 1000 * torch.arange(E)[:, None, None]
    return rows.expand(E, 2 * inter, H).to(dtype)


def test_up_gate_swap_for_flashinfer_canonical_order():
    w13 = _marked(2, 128, 8, torch.float32)
    swapped = fmoe._up_gate(w13, 128)
    assert torch.equal(swapped[:, :128], w13[:, 128:]) and torch.equal(swapped[:, 128:], w13[:, :128])


def test_cute_dsl_sm90_interleave_reads_rubins_gate_then_up():
    """sm90_fused_moe.py: GEMM1 rows as [up 0:32 | gate 0:32 | up 32:64 | ...]."""
    E, inter, H = 2, 64, 8
    w13 = _marked(E, inter, H, torch.float32)
    args = MoEArgs(
        torch.zeros(1, H), w13, torch.zeros(E, H, inter), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int64)
    )
    w1 = fa.ADAPTERS[("moe", "flashinfer_cutedsl", "none")].prepare(args)["w1_weight"]
    gate, up = w13[:, :inter], w13[:, inter:]
    for block in range(inter // 32):
        assert torch.equal(w1[:, 64 * block : 64 * block + 32], up[:, 32 * block : 32 * block + 32])
        assert torch.equal(w1[:, 64 * block + 32 : 64 * block + 64], gate[:, 32 * block : 32 * block + 32])


def test_trtllm_fp8_block_gemm1_is_up_then_gate_with_its_scales():
    T, H, I, E, k = 1, 256, 128, 4, 2  # noqa: E741
    w13 = _marked(E, I, H).to(FP8)
    s13 = torch.arange(E * 2 * I // 128 * H // 128, dtype=torch.float32).reshape(E, 2 * I // 128, H // 128)
    args = MoEArgs(
        torch.zeros(T, H, dtype=torch.bfloat16),
        w13,
        torch.zeros(E, H, I, dtype=FP8),
        torch.ones(T, k),
        torch.zeros(T, k, dtype=torch.int64),
        w13_scale=s13,
        w2_scale=torch.ones(E, H // 128, I // 128),
        block_shape=[128, 128],
    )
    p = fa.ADAPTERS[("moe", "flashinfer_trtllm", "fp8_block")].prepare(args)
    assert torch.equal(p["gemm1_weights"].float(), torch.cat((w13[:, I:], w13[:, :I]), 1).float())
    assert torch.equal(p["gemm1_weights_scale"], torch.cat((s13[:, 1:], s13[:, :1]), 1))


def test_trtllm_nvfp4_rows_follow_flashinfers_permutation_for_weights_and_scales():
    """The packed GEMM1 rows and their scale rows move together: the same row permutation (FlashInfer's
    w3_w1 permute) applied to [up; gate], then the scales swizzled."""
    from flashinfer.fused_moe.core import _maybe_get_cached_w3_w1_permute_indices

    T, H, I, E, k = 1, 128, 128, 4, 2  # noqa: E741
    rows = (torch.arange(2 * I)[None, :, None] % 251 + 3 * torch.arange(E)[:, None, None]).to(torch.uint8)
    w13 = rows.expand(E, 2 * I, H // 2).contiguous()
    s13 = rows.expand(E, 2 * I, H // 16).contiguous().view(FP8)
    one = torch.ones(())
    args = MoEArgs(
        torch.zeros(T, H, dtype=torch.bfloat16),
        w13,
        torch.zeros(E, H, I // 2, dtype=torch.uint8),
        torch.ones(T, k),
        torch.zeros(T, k, dtype=torch.int64),
        w13_scale=s13,
        w2_scale=torch.zeros(E, H, I // 16, dtype=FP8),
        w13_scale_2=torch.full((E,), 2.0),
        w2_scale_2=torch.full((E,), 3.0),
        a13_scale=one * 0.5,
        a2_scale=one * 4.0,
    )
    p = fa.ADAPTERS[("moe", "flashinfer_trtllm", "nvfp4")].prepare(args)
    up_gate = torch.cat((w13[:, I:], w13[:, :I]), 1)
    perm = _maybe_get_cached_w3_w1_permute_indices({}, up_gate[0], 128)
    assert torch.equal(p["gemm1_weights"], up_gate[:, perm])
    perm_sf = _maybe_get_cached_w3_w1_permute_indices({}, up_gate[0, :, : H // 16], 128, num_elts_per_sf=16)
    expect_sf = fmoe._swizzle_128x4(up_gate[:, perm_sf, : H // 16])
    assert torch.equal(p["gemm1_weights_scale"].view(torch.uint8).reshape(expect_sf.shape), expect_sf)
    assert torch.allclose(p["output1_scale_gate_scalar"], torch.full((E,), 1.0))  # a13 * w13_scale_2
    assert torch.allclose(p["output1_scale_scalar"], torch.full((E,), 0.25))  # ... / a2
    assert torch.allclose(p["output2_scale_scalar"], torch.full((E,), 12.0))  # a2 * w2_scale_2


def test_cute_dsl_nvfp4_interleaves_up_and_gate_in_64_row_groups():
    T, H, I, E, k = 1, 128, 128, 2, 1  # noqa: E741
    rows = (torch.arange(2 * I)[None, :, None] + 7 * torch.arange(E)[:, None, None]).to(torch.uint8)
    args = MoEArgs(
        torch.zeros(T, H, dtype=torch.bfloat16),
        rows.expand(E, 2 * I, H // 2).contiguous(),
        torch.zeros(E, H, I // 2, dtype=torch.uint8),
        torch.ones(T, k),
        torch.zeros(T, k, dtype=torch.int64),
        w13_scale=rows.expand(E, 2 * I, H // 16).contiguous().view(FP8),
        w2_scale=torch.zeros(E, H, I // 16, dtype=FP8),
        w13_scale_2=torch.ones(E),
        w2_scale_2=torch.ones(E),
        a13_scale=torch.ones(()),
        a2_scale=torch.ones(()),
    )
    w1 = fa.ADAPTERS[("moe", "flashinfer_cutedsl", "nvfp4")].prepare(args)["w1_weight"]
    gate, up = rows[:, :I, 0], rows[:, I:, 0]
    assert torch.equal(w1[:, :64, 0], up[:, :64]) and torch.equal(w1[:, 64:128, 0], gate[:, :64])
    assert torch.equal(w1[:, 128:192, 0], up[:, 64:]) and torch.equal(w1[:, 192:, 0], gate[:, 64:])


# ------------------------------------------------------------------------------------------------
# MXFP4 (GPT-OSS): trtllm-gen MxE2m1 x BF16, CUTLASS W4A16 on sm_90, CuTe-DSL MXFP8 x MXFP4
# ------------------------------------------------------------------------------------------------

MXFP4_KERNELS = ("flashinfer_trtllm", "flashinfer_cutlass", "flashinfer_cutedsl")
GPT_OSS_120B = (3, 2880, 2880, 128, 4)  # T, H, I, E, k


def _mxfp4_args(T, H, I, E, k, activation="silu", bias=False, device="meta", gen=None):  # noqa: E741
    def u8(*shape):
        if device == "meta":
            return torch.empty(shape, dtype=torch.uint8, device="meta")
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)

    def f(*shape, dt=torch.float32):
        return torch.empty(shape, dtype=dt, device=device) if device == "meta" else torch.randn(shape, generator=gen)

    return MoEArgs(
        f(T, H, dt=torch.bfloat16),
        u8(E, 2 * I, H // 2),
        u8(E, H, I // 2),
        f(T, k),
        torch.zeros(T, k, dtype=torch.int64, device=device),
        activation=activation,
        w13_scale=u8(E, 2 * I, H // 32),
        w2_scale=u8(E, H, I // 32),
        w13_bias=f(E, 2 * I, dt=torch.bfloat16) if bias else None,
        w2_bias=f(E, H, dt=torch.bfloat16) if bias else None,
    )


def _mxfp4_target(kernel):
    return target_mod.TARGETS["sm90" if kernel == "flashinfer_cutlass" else "sm100"]


@pytest.mark.parametrize("kernel", ["flashinfer_trtllm", "flashinfer_cutlass"])
@pytest.mark.parametrize("activation", ["swigluoai", "swigluoai:1.5:6.0", "swigluoai_uninterleave", "silu"])
def test_mxfp4_gpt_oss_builds_padded_with_biases_and_swiglu_constants(kernel, activation):
    """GPT-OSS-120B's MoE (H = I = 2880, E 128, k 4, biases, swigluoai): selection accepts it, H and I are padded
    to 2944, the biases and SwiGLU constants reach the call, the result is sliced back to H."""
    T, H, I, E, k = GPT_OSS_120B  # noqa: E741
    spec = dataclasses.replace(_spec("mxfp4", H, I, E, k), activation=activation)
    assert CANONICAL_OPS["moe"].kernel(kernel).supports(_mxfp4_target(kernel), spec) is None
    adapter = fa.ADAPTERS[("moe", kernel, "mxfp4")]
    args = _mxfp4_args(T, H, I, E, k, activation=activation, bias=True)
    call = fa.build(adapter, args, Launch(pdl=True))
    b = call.bound().arguments
    alpha, limit = {"swigluoai:1.5:6.0": (1.5, 6.0), "silu": (None, None)}.get(activation, (1.702, 7.0))
    if kernel == "flashinfer_trtllm":
        assert b["hidden_states"].shape == (T, 2944) and b["intermediate_size"] == 2944
        assert b["gemm1_bias"].shape == (E, 2 * 2944) and b["gemm2_bias"].dtype == torch.float32
        names = ("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit")
    else:
        assert b["input"].shape == (T, 2944) and b["fc2_expert_weights"].shape == (E, 2944, 2944 // 2)
        assert b["fc1_expert_biases"].shape == (E, 2 * 2944) and b["fc1_expert_biases"].dtype == torch.bfloat16
        names = ("swiglu_alpha", "swiglu_beta", "swiglu_limit")
    if alpha is None:
        assert all(b[n] is None for n in names)
    else:
        assert all(b[n].shape == (E,) and b[n].dtype == torch.float32 for n in names)
    out = call.finish(torch.empty(T, 2944, dtype=torch.bfloat16, device="meta"))
    assert out.shape == (T, H)


@pytest.mark.parametrize("kernel", ["flashinfer_trtllm", "flashinfer_cutlass"])
def test_mxfp4_swiglu_constants_are_the_activations(kernel):
    """On real (CPU) tensors: alpha / beta / limit are the string's, beta 1 (GPT-OSS's ``up + 1``)."""
    gen = torch.Generator().manual_seed(0)
    args = _mxfp4_args(1, 128, 128, 4, 2, activation="swigluoai:1.25:5.5", bias=True, device="cpu", gen=gen)
    if kernel == "flashinfer_cutlass":
        pytest.importorskip("flashinfer.fused_moe.prepare")
    p = fa.ADAPTERS[("moe", kernel, "mxfp4")].prepare(args)
    names = ("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit") if kernel == "flashinfer_trtllm" else (
        "swiglu_alpha", "swiglu_beta", "swiglu_limit")  # fmt: skip
    for name, value in zip(names, (1.25, 1.0, 5.5)):
        assert torch.equal(p[name], torch.full((4,), value))


def test_mxfp4_trtllm_dtypes_pass_flashinfers_support_check(monkeypatch):
    from flashinfer.fused_moe import core
    from flashinfer.fused_moe.core import DtypeTrtllmGen

    monkeypatch.setattr(core, "get_compute_capability", lambda device: (10, 0))
    monkeypatch.setattr(core.torch.cuda, "current_device", lambda: 0)
    call = fa.build(fa.ADAPTERS[("moe", "flashinfer_trtllm", "mxfp4")], _mxfp4_args(*SHAPES["small"]), Launch())
    b = call.bound().arguments
    assert b["hidden_states"].dtype == torch.bfloat16 and b["gemm1_weights_scale"].shape[-1] == 256 // 32
    assert core.is_trtllm_moe_supported(DtypeTrtllmGen.MxE2m1, DtypeTrtllmGen.Bfloat16)


def test_mxfp4_cutedsl_passes_flashinfers_w4a8_validation():
    """fused_moe/cute_dsl/fused_moe.py:validate_w4a8_inputs (shapes, dtypes and MMA strides of the scales) on the
    meta tensors of the call, and the function's declared compute capabilities."""
    from flashinfer.fused_moe.cute_dsl.fused_moe import validate_w4a8_inputs

    from rubin_compile.kernels.flashinfer.tables import resolve

    for shape in ("qwen3-30b-a3b", "deepseek-v3-tp8", "small"):
        adapter = fa.ADAPTERS[("moe", "flashinfer_cutedsl", "mxfp4")]
        b = fa.build(adapter, _mxfp4_args(*SHAPES[shape]), Launch()).bound().arguments
        validate_w4a8_inputs(*(b[n] for n in ("x", "x_sf", "token_final_scales", "w1_weight", "w1_weight_sf",
                                               "w2_weight", "w2_weight_sf")))  # fmt: skip
    fn = resolve(fa.ADAPTERS[("moe", "flashinfer_cutedsl", "mxfp4")].function)
    assert fn.is_compute_capability_supported(100) and not fn.is_compute_capability_supported(107)


@pytest.mark.parametrize(
    "kernel, target, words",
    [
        ("flashinfer_trtllm", "sm103", "sm_103"),
        ("flashinfer_cutlass", "sm100", "sm_90 W4A16"),
        ("flashinfer_cutedsl", "sm100", "H=2880 must be a multiple of 128"),
    ],
)
def test_mxfp4_supports_says_no_with_a_reason(kernel, target, words):
    spec = dataclasses.replace(_spec("mxfp4", 2880, 2880, 128, 4), activation="swigluoai")
    reason = CANONICAL_OPS["moe"].kernel(kernel).supports(target_mod.TARGETS[target], spec)
    assert reason and words in reason


@pytest.mark.parametrize("kernel", MXFP4_KERNELS)
def test_mxfp4_rejects_unmapped_activations(kernel):
    spec = dataclasses.replace(_spec("mxfp4", 2048, 768, 128, 8), activation="gelu")
    reason = CANONICAL_OPS["moe"].kernel(kernel).supports(_mxfp4_target(kernel), spec)
    assert reason and "gelu" in reason


def test_mxfp4_cutedsl_refuses_biases():
    args = _mxfp4_args(*SHAPES["small"], activation="swigluoai", bias=True)
    with pytest.raises(AdapterCheckError, match="biases"):
        fa.build(fa.ADAPTERS[("moe", "flashinfer_cutedsl", "mxfp4")], args, Launch())


@pytest.mark.parametrize(
    "kernel, name, value, words",
    [
        (
            "flashinfer_trtllm",
            "gemm1_weights_scale",
            torch.empty(8, 256, 16, dtype=torch.uint8),
            "must be torch.float8",
        ),
        ("flashinfer_trtllm", "hidden_states", torch.empty(4, 256, dtype=FP8), "hidden_states must be torch.bfloat16"),
        ("flashinfer_cutlass", "quant_scales", [torch.empty(8, 256, 8, dtype=torch.uint8)] * 2, "quant_scales[0]"),
        ("flashinfer_cutlass", "use_w4_group_scaling", False, "use_w4_group_scaling"),
        ("flashinfer_cutedsl", "x_sf", torch.empty(4, 8, dtype=FP8), "x_sf must be torch.uint8"),
    ],
)
def test_mxfp4_check_catches(kernel, name, value, words):
    adapter = fa.ADAPTERS[("moe", kernel, "mxfp4")]
    call = fa.build(adapter, _mxfp4_args(*SHAPES["small"]), Launch())
    if isinstance(value, torch.Tensor):
        value = value.to("meta")
    elif isinstance(value, list):
        value = [v.to("meta") for v in value]
    with pytest.raises(AdapterCheckError, match=re.escape(words)):
        adapter.check(_replace(call, name, value))


def test_mxfp4_trtllm_rows_scales_and_biases_move_together():
    """swigluoai's interleaved rows (gate even, up odd) become [up; gate], padded, then FlashInfer's w3_w1 permute:
    weights, E8M0 scale rows and biases alike (marked rows read back)."""
    from flashinfer.fused_moe.core import _maybe_get_cached_w3_w1_permute_indices

    T, H, I, E, k = 1, 128, 64, 4, 2  # noqa: E741  (I padded to 128)
    rows = (torch.arange(2 * I)[None, :, None] + 3 * torch.arange(E)[:, None, None]).to(torch.uint8)
    args = MoEArgs(
        torch.zeros(T, H, dtype=torch.bfloat16),
        rows.expand(E, 2 * I, H // 2).contiguous(),
        torch.zeros(E, H, I // 2, dtype=torch.uint8),
        torch.ones(T, k),
        torch.zeros(T, k, dtype=torch.int64),
        activation="swigluoai",
        w13_scale=rows.expand(E, 2 * I, H // 32).contiguous(),
        w2_scale=torch.zeros(E, H, I // 32, dtype=torch.uint8),
        w13_bias=rows[..., 0].to(torch.bfloat16) + 1,
        w2_bias=torch.zeros(E, H, dtype=torch.bfloat16),
    )
    p = fa.ADAPTERS[("moe", "flashinfer_trtllm", "mxfp4")].prepare(args)
    zeros = torch.zeros(E, 128 - I, dtype=torch.uint8)
    up_gate = torch.cat((rows[:, 1::2, 0], zeros, rows[:, 0::2, 0], zeros), 1)  # [E, 256]
    perm = _maybe_get_cached_w3_w1_permute_indices({}, torch.empty(256, H // 2, dtype=torch.uint8), 128)
    assert torch.equal(p["gemm1_weights"][:, :, 0], up_gate[:, perm])
    perm_sf = _maybe_get_cached_w3_w1_permute_indices({}, torch.empty(256, H // 32, dtype=torch.uint8), 128, 16)
    expect_sf = fmoe._swizzle_128x4(up_gate[:, perm_sf, None].expand(E, 256, H // 32))
    assert torch.equal(p["gemm1_weights_scale"].view(torch.uint8).reshape(expect_sf.shape), expect_sf)
    bias = torch.cat((rows[:, 1::2, 0] + 1, zeros, rows[:, 0::2, 0] + 1, zeros), 1).float()
    bias[:, I:128] = 0
    bias[:, 128 + I :] = 0
    perm_b = _maybe_get_cached_w3_w1_permute_indices({}, torch.empty(256, 1), 128)
    assert torch.equal(p["gemm1_bias"], bias[:, perm_b])


def _kernel_bit_moves():
    """(mask, shift) of interleave_fp4_weights_for_sm90_mixed_gemm_kernel, read from FlashInfer's CUDA source."""
    import pathlib
    import re as _re

    import flashinfer

    src = pathlib.Path(flashinfer.__file__).parent / (
        "data/csrc/nv_internal/tensorrt_llm/kernels/cutlass_kernels/moe_gemm/moe_gemm_mixed_utils.cu"
    )
    if not src.exists():
        pytest.skip(f"{src} is not installed")
    text = src.read_text()
    body = text[text.index("interleave_fp4_weights_for_sm90_mixed_gemm_kernel") :]
    body = body[: body.index("__global__")]
    pairs = _re.findall(r"mask = 0b([01]+);\s*fp4x8_interleaved \|= \(fp4x8_raw & mask\) (<<|>>) (\d+);", body)
    return [(int(m, 2), int(n) if d == "<<" else -int(n)) for m, d, n in pairs]


def test_sm90_fp4_interleave_is_the_kernels_loop():
    """``_interleave_fp4_sm90`` against a scalar walk of the CUDA kernel's loops with its bit moves read from
    the .cu source (the GPU test compares with the kernel itself)."""
    moves = _kernel_bit_moves()
    assert sorted(moves) == sorted(fmoe._SM90_FP4_BITS)
    n, k = 32, 128
    w = torch.randint(0, 256, (2, n, k // 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    out = fmoe._interleave_fp4_sm90(w)
    src, expect = w.tolist(), [[[None] * (k // 2) for _ in range(n)] for _ in range(2)]
    for e in range(2):
        for block_id in range(n // 2):
            for partition_id in range(k // 64):
                for lane_id in range(16):
                    row_id = block_id // 8 * 16 + block_id % 8
                    mma_id = lane_id // 4
                    dst_row = row_id + (mma_id % 2) * 8
                    col = partition_id * 32 + mma_id * 8 + lane_id % 4
                    dst_col = partition_id * 32 + lane_id // 8 * 16 + (lane_id % 4) * 4
                    s = src[e]
                    raw = s[row_id][col] | s[row_id + 8][col] << 8 | s[row_id][col + 4] << 16
                    raw |= s[row_id + 8][col + 4] << 24
                    word = 0
                    for mask, shift in moves:
                        word |= (raw & mask) << shift if shift > 0 else (raw & mask) >> -shift
                    for j in range(4):
                        expect[e][dst_row][dst_col + j] = (word >> (8 * j)) & 0xFF
    assert torch.equal(out, torch.tensor(expect, dtype=torch.uint8))
    assert fmoe._interleave_fp4_sm90(w.to("meta")).shape == w.shape


def test_cutlass_w4a16_scales_are_flashinfers_interleave_of_up_gate():
    from flashinfer.fused_moe.prepare import interleave_moe_scales_for_sm90_mixed_gemm

    gen = torch.Generator().manual_seed(2)
    args = _mxfp4_args(1, 128, 128, 2, 1, device="cpu", gen=gen)
    p = fa.ADAPTERS[("moe", "flashinfer_cutlass", "mxfp4")].prepare(args)
    s = args.w13_scale
    expect = interleave_moe_scales_for_sm90_mixed_gemm(torch.cat((s[:, 128:], s[:, :128]), 1))
    assert torch.equal(p["fc1_sf"].view(torch.uint8), expect)
    assert torch.equal(p["fc1"], fmoe._interleave_fp4_sm90(torch.cat((args.w13[:, 128:], args.w13[:, :128]), 1)))
