"""The FlashInfer attention adapters (rubin_compile/kernels/flashinfer/attention.py) on the CPU.

Every call is built on meta tensors for the example models' attention shapes, bound to the installed
FlashInfer function's signature and checked (the adapter's ``check`` and FlashInfer's own Python-side checks:
``_check_kv_layout``, ``_check_pos_encoding_mode``, ``is_fa3_backend_supported``,
``is_fa3_prefill_head_dim_supported``). The fold of the batch into the heads, the causal shift and the FP8 scales
are then checked numerically: ``emulated`` below is single_prefill_with_kv_cache's documented semantics (q
[qo_len, Hq, D], HND k / v, GQA grouping h // (Hq / Hkv), the causal mask aligned bottom-right, ``sm_scale``)
in float64 torch, so ``finish(emulated(call))`` must equal the op's reference. The kernels themselves run in
tests/gpu/test_flashinfer_attention.py.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("flashinfer")

from rubin_compile import target as target_mod  # noqa: E402
from rubin_compile.kernels.flashinfer import adapter as fa  # noqa: E402
from rubin_compile.kernels.flashinfer import tables  # noqa: E402
from rubin_compile.kernels.flashinfer.adapter import AdapterCheckError, Call  # noqa: E402
from rubin_compile.ops import attention as attn  # noqa: E402
from rubin_compile.ops.attention import AttentionArgs  # noqa: E402
from rubin_compile.ops.registry import KernelSpec, Launch  # noqa: E402

import rubin_compile.kernels.flashinfer  # noqa: E402, F401  (registers the adapters)

SM90 = target_mod.TARGETS["sm90"]

# name: (B, Hq, Hkv, S, Skv, D, Dv); Qwen3-30B-A3B: 32 query heads, 4 KV heads, D 128; DeepSeek-V3's MLA
# prefill at TP8 (16 heads, D 192 = 128 nope + 64 rope, Dv 128); a small MHA one.
SHAPES = {
    "qwen3-prefill": (2, 32, 4, 300, 300, 128, 128),
    "qwen3-decode-static-cache": (8, 32, 4, 1, 4096, 128, 128),
    "deepseek-v3-mla-prefill": (1, 16, 16, 257, 257, 192, 128),
    "small-mha": (2, 4, 4, 17, 17, 64, 64),
}


def _hf(B, H, S, D, dtype, device="meta"):
    """A Hugging Face projection: [B, S, H, D] memory seen as [B, H, S, D]."""
    return torch.empty(B, S, H, D, dtype=dtype, device=device).transpose(1, 2)


def _meta_args(shape, *, causal=True, kv_dtype=torch.bfloat16, static_cache=False):
    B, Hq, Hkv, S, Skv, D, Dv = shape
    q = _hf(B, Hq, S, D, torch.bfloat16)
    if static_cache:  # a contiguous [B, Hkv, max_len, D] buffer, the first Skv positions read
        k = torch.empty(B, Hkv, Skv + 64, D, dtype=kv_dtype, device="meta")[:, :, :Skv]
        v = torch.empty(B, Hkv, Skv + 64, Dv, dtype=kv_dtype, device="meta")[:, :, :Skv]
    else:
        k, v = _hf(B, Hkv, Skv, D, kv_dtype), _hf(B, Hkv, Skv, Dv, kv_dtype)
    scales = {}
    if kv_dtype in fa.FP8:
        scales = dict(k_scale=torch.empty((), device="meta"), v_scale=torch.empty((), device="meta"))
    return AttentionArgs(q, k, v, is_causal=causal, **scales)


def _flashinfer_checks(call: Call, backend: str) -> None:
    """FlashInfer's own Python-side checks of single_prefill_with_kv_cache's arguments."""
    from flashinfer.utils import (
        PosEncodingMode,
        _check_kv_layout,
        _check_pos_encoding_mode,
        is_fa3_backend_supported,
        is_fa3_prefill_head_dim_supported,
    )

    b = call.bound().arguments
    _check_kv_layout(b["kv_layout"])
    _check_pos_encoding_mode(b["pos_encoding_mode"])
    if backend == "fa3":
        assert is_fa3_backend_supported(
            PosEncodingMode[b["pos_encoding_mode"]].value,
            b["use_fp16_qk_reduction"],
            b["custom_mask"] is not None,
            b["q"].dtype,
            b["k"].dtype,
        )
        assert is_fa3_prefill_head_dim_supported(b["q"].shape[-1], b["v"].shape[-1])


def _adapter(kernel, quant="none"):
    a = fa.adapter_for("attention", kernel, quant)
    assert a is not None, (kernel, quant)
    return a


CASES = (
    [
        ("flashinfer_fa2", "none", name, dict(static_cache="decode" in name, causal="decode" not in name))
        for name in SHAPES
    ]
    + [
        ("flashinfer_fa3", "none", name, dict(static_cache="decode" in name, causal="decode" not in name))
        for name in SHAPES
    ]
    + [
        (
            "flashinfer_fa2",
            "fp8_tensor",
            "qwen3-decode-static-cache",
            dict(kv_dtype=torch.float8_e4m3fn, static_cache=True, causal=False),
        ),
        ("flashinfer_fa2", "fp8_tensor", "qwen3-prefill", dict(kv_dtype=torch.float8_e5m2)),
    ]
)


@pytest.mark.parametrize("kernel,quant,name,opts", CASES, ids=[f"{k}-{q}-{n}" for k, q, n, _ in CASES])
def test_call_builds_binds_and_checks_on_meta(kernel, quant, name, opts):
    adapter = _adapter(kernel, quant)
    args = _meta_args(SHAPES[name], **opts)
    assert fa.quant_of("attention", args) == quant
    B, Hq, Hkv, S, Skv, D, Dv = SHAPES[name]
    if kernel == "flashinfer_fa3" and S <= 4:  # FA3 declines decode (FA3Prefill)
        with pytest.raises(AdapterCheckError, match="decode"):
            fa.build(adapter, args, Launch())
        return
    call = fa.build(adapter, args, Launch())
    assert call.function in tables.entry_point("attention", kernel, quant).functions
    _flashinfer_checks(call, adapter.backend)
    q, k, v = call.args
    kv = (B * Hkv, Skv) if adapter.kv_layout == "HND" else (Skv, B * Hkv)  # FA3: NHD (FA3Prefill)
    assert tuple(q.shape) == (S, B * Hq, D) and tuple(k.shape) == (*kv, D) and tuple(v.shape) == (*kv, Dv)
    out = call.finish(torch.empty(S, B * Hq, Dv, dtype=torch.bfloat16, device="meta"))
    want = attn._output_like(args.query, Dv)
    assert out.shape == want.shape and out.stride() == want.stride() and out.dtype == torch.bfloat16


def test_static_cache_and_decode_query_fold_without_copies():
    """A contiguous static cache and a decode query become the kernel's tensors as views (no copy)."""
    args = _meta_args(SHAPES["qwen3-decode-static-cache"], static_cache=True, causal=False)
    q, k, v = fa.build(_adapter("flashinfer_fa2"), args, Launch()).args
    assert k._base is args.key._base and v._base is args.value._base
    assert q._base is args.query._base


@pytest.mark.parametrize("kernel", ["flashinfer_fa2", "flashinfer_fa3"])
def test_check_catches_wrong_dtype_and_stride(kernel):
    adapter = _adapter(kernel)
    call = fa.build(adapter, _meta_args(SHAPES["small-mha"]), Launch())
    q, k, v = call.args
    bad = Call(call.function, (q.float(), k, v), call.kwargs, call.finish)
    with pytest.raises(AdapterCheckError, match="query must be bf16"):
        adapter.check(bad)
    strided = torch.empty(q.shape[0], q.shape[1], 2 * q.shape[2], dtype=q.dtype, device="meta")[..., ::2]
    with pytest.raises(AdapterCheckError, match="stride 1"):
        adapter.check(Call(call.function, (strided, k, v), call.kwargs, call.finish))
    with pytest.raises(AdapterCheckError, match="multiple of KV heads"):
        adapter.check(Call(call.function, (q[:, :3], k, v), call.kwargs, call.finish))
    fp8 = Call(call.function, (q, k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)), call.kwargs, call.finish)
    if kernel == "flashinfer_fa3":
        with pytest.raises(AdapterCheckError, match="key / value dtype"):
            adapter.check(fp8)
    else:
        adapter.check(fp8)  # FA2 runs a bf16 query against an FP8 cache


def test_fa3_check_catches_head_dim_without_kernel():
    adapter = _adapter("flashinfer_fa3")
    with pytest.raises(AdapterCheckError, match="head dims 96"):
        fa.build(adapter, _meta_args((1, 4, 4, 8, 8, 96, 96)), Launch())
    fa.build(_adapter("flashinfer_fa2"), _meta_args((1, 4, 4, 8, 8, 96, 96)), Launch())  # FA2 instantiates any


def test_fa3_fp8_is_plan_only():
    assert fa.adapter_for("attention", "flashinfer_fa3", "fp8_tensor") is None
    spec = KernelSpec(op="attention", quant="fp8_tensor", weight_dtype="float8_e4m3fn", shape=(("D", 128),))
    assert "FP8 query" in tables.check_entry(
        tables.entry_point("attention", "flashinfer_fa3", "fp8_tensor"), SM90, spec
    )


@pytest.mark.parametrize("kernel", ["flashinfer_fa2", "flashinfer_fa3"])
def test_supports_rejects_masks_and_causal_with_more_queries(kernel):
    adapter = _adapter(kernel)
    spec = KernelSpec(op="attention", shape=(("D", 128), ("S", 16), ("Skv", 16)))
    assert adapter.supports(SM90, spec) is None
    assert adapter.supports(SM90, KernelSpec(op="attention", shape=spec.shape, activation="causal")) is None
    assert "mask" in adapter.supports(SM90, KernelSpec(op="attention", shape=spec.shape, activation="mask"))
    more = KernelSpec(op="attention", shape=(("D", 128), ("S", 20), ("Skv", 16)), activation="causal")
    assert "bottom-right" in adapter.supports(SM90, more)
    assert adapter.supports(SM90, KernelSpec(op="attention", shape=more.shape)) is None  # no mask: any S
    with pytest.raises(AdapterCheckError, match="bottom-right"):
        fa.build(adapter, _meta_args((1, 4, 4, 20, 16, 64, 64)), Launch())


def test_fa3_table_rule_rejects_head_dims_without_kernel():
    entry = tables.entry_point("attention", "flashinfer_fa3", "none")
    ok = KernelSpec(op="attention", shape=(("D", 128), ("Dv", 128)))
    mla = KernelSpec(op="attention", shape=(("D", 192), ("Dv", 128)))
    odd = KernelSpec(op="attention", shape=(("D", 96), ("Dv", 96)))
    assert tables.check_entry(entry, SM90, ok) is None and tables.check_entry(entry, SM90, mla) is None
    assert "head dims" in tables.check_entry(entry, SM90, odd)


# ------------------------------------------------------------------------------------------------
# numerics of the fold, the causal shift and the scales against single_prefill's documented semantics
# ------------------------------------------------------------------------------------------------


def emulated(q, k, v, *, causal=False, kv_layout="NHD", sm_scale=None, backend="auto", **unused):
    """single_prefill_with_kv_cache's semantics in float64 (FP8 K / V read as their values, as the kernel does)."""
    assert kv_layout == "HND"
    S, Hq, D = q.shape
    Hkv, Skv, _ = k.shape
    n = Hq // Hkv
    qf = q.double().transpose(0, 1)  # [Hq, S, D]
    kf = k.double().repeat_interleave(n, 0)
    vf = v.double().repeat_interleave(n, 0)
    logits = qf @ kf.transpose(1, 2) * (1 / math.sqrt(D) if sm_scale is None else sm_scale)
    if causal:  # bottom-right: query i sees key j <= i + Skv - S
        i = torch.arange(S)[:, None]
        j = torch.arange(Skv)[None, :]
        logits = logits.masked_fill(j > i + Skv - S, float("-inf"))
    out = torch.softmax(logits, -1) @ vf  # [Hq, S, Dv]
    return out.transpose(0, 1).contiguous().to(q.dtype)  # [S, Hq, Dv]


NUMERIC = {
    # name: (B, Hq, Hkv, S, Skv, D, Dv, causal, layout)
    "prefill-causal-gqa4-hf-layout": (2, 8, 2, 13, 13, 16, 16, True, "hf"),
    "causal-fewer-queries-shifted": (2, 4, 2, 5, 11, 16, 16, True, "hf"),
    "decode-static-cache": (3, 8, 2, 1, 19, 16, 8, False, "cache"),
    "decode-causal-one-key": (2, 4, 4, 1, 9, 16, 16, True, "cache"),
    "prefill-no-mask-b1": (1, 6, 3, 7, 10, 16, 16, False, "hf"),
}


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-kv"])
@pytest.mark.parametrize("name", list(NUMERIC))
def test_fold_and_finish_match_the_reference(name, fp8):
    B, Hq, Hkv, S, Skv, D, Dv, causal, layout = NUMERIC[name]
    g = torch.Generator().manual_seed(0)
    dtype = torch.float32  # the emulation is exact in fp32 inputs; the layouts and the fold are what is tested
    q = torch.randn(B, S, Hq, D, generator=g).to(dtype).transpose(1, 2)
    if layout == "hf":
        k = torch.randn(B, Skv, Hkv, D, generator=g).transpose(1, 2)
        v = torch.randn(B, Skv, Hkv, Dv, generator=g).transpose(1, 2)
    else:
        k = torch.randn(B, Hkv, Skv + 5, D, generator=g)[:, :, :Skv]
        v = torch.randn(B, Hkv, Skv + 5, Dv, generator=g)[:, :, :Skv]
    scales = {}
    if fp8:
        q = q.to(torch.bfloat16)
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        scales = dict(k_scale=torch.tensor(0.37), v_scale=torch.tensor(1.9))
    args = AttentionArgs(q, k, v, is_causal=causal, scale=0.3, **scales)
    call = _adapter("flashinfer_fa2", "fp8_tensor" if fp8 else "none").call(args, {}, Launch())
    got = call.finish(emulated(*call.args, **call.kwargs))
    want = attn.reference(args)
    assert got.shape == want.shape and got.stride() == want.stride()
    tol = 2e-2 if fp8 else 1e-5  # fp8: the query scaled in bf16, the output rounded to bf16 before v_scale
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# ------------------------------------------------------------------------------------------------
# flashinfer_trtllm: trtllm_batch_decode_with_kv_cache / trtllm_batch_context_with_kv_cache (paged, HND)
# ------------------------------------------------------------------------------------------------

TRTLLM_DECODE = "flashinfer.decode.trtllm_batch_decode_with_kv_cache"
TRTLLM_CONTEXT = "flashinfer.prefill.trtllm_batch_context_with_kv_cache"
SM100 = target_mod.TARGETS["sm100"]

# name: (B, Hq, Hkv, S, Skv, kind); kind "cache": a static cache [B, Hkv, 32768, D] read to Skv, "hf": Hugging
# Face projections [B, S, H, D] seen as [B, H, S, D]. Qwen3-30B-A3B: 32 / 4 heads; Llama-3.1-8B: 32 / 8; D 128.
TRTLLM_SHAPES = {
    "qwen3-decode-4096": (8, 32, 4, 1, 4096, "cache"),
    "qwen3-decode-16384": (8, 32, 4, 1, 16384, "cache"),
    "qwen3-prefill-2048": (2, 32, 4, 2048, 2048, "hf"),
    "llama31-8b-decode-4096": (4, 32, 8, 1, 4096, "cache"),
    "llama31-8b-prefill-2048": (1, 32, 8, 2048, 2048, "hf"),
}
STATIC_LEN = 32768


def _trtllm_meta_args(name, kv_dtype=torch.bfloat16, q_dtype=torch.bfloat16):
    B, Hq, Hkv, S, Skv, kind = TRTLLM_SHAPES[name]
    q = _hf(B, Hq, S, 128, q_dtype)
    if kind == "cache":
        k = torch.empty(B, Hkv, STATIC_LEN, 128, dtype=kv_dtype, device="meta")[:, :, :Skv]
        v = torch.empty(B, Hkv, STATIC_LEN, 128, dtype=kv_dtype, device="meta")[:, :, :Skv]
    else:
        k, v = _hf(B, Hkv, Skv, 128, kv_dtype), _hf(B, Hkv, Skv, 128, kv_dtype)
    scales = {}
    if kv_dtype in fa.FP8:
        scales = dict(k_scale=torch.empty((), device="meta"), v_scale=torch.empty((), device="meta"))
    return AttentionArgs(q, k, v, is_causal=kind == "hf", **scales)


def _trtllm_flashinfer_checks(call: Call) -> None:
    """The Python-side checks trtllm_batch_{decode,context}_with_kv_cache run on their arguments (decode.py /
    prefill.py), on the bound arguments: block-table rank, ``out``'s shape / dtype / device, the counter
    buffer's size and alignment (meta tensors' data_ptr is 0), the bmm1 tensor's dtype, the SM107-only
    cubin selectors off."""
    from flashinfer.decode import _get_trtllm_gen_bmm1_scale_arg
    from flashinfer.utils import (
        _check_block_tables_shape,
        _resolve_trtllm_gen_multi_ctas_kv_counter_buffer,
        check_shape_dtype_device,
        check_trtllm_gen_sm107_only_feature,
    )

    b = call.bound().arguments
    q = b["query"]
    k_cache, v_cache = b["kv_cache"]
    decode = call.function == TRTLLM_DECODE
    batch = q.shape[0] // b["q_len_per_req"] if decode else b["batch_size"]
    kwargs = dict(block_sparse=False, num_kv_heads=k_cache.size(-3), batch_size=batch) if decode else {}
    _check_block_tables_shape(b["block_tables"], b["uses_shared_paged_kv_idx"], **kwargs)
    check_shape_dtype_device(b["out"], q.shape, q.dtype, q.device, "out")
    _resolve_trtllm_gen_multi_ctas_kv_counter_buffer(b["multi_ctas_kv_counter_buffer"], batch, q.size(1), 148, q.device)
    if isinstance(b["bmm1_scale"], torch.Tensor):
        _get_trtllm_gen_bmm1_scale_arg(b["bmm1_scale"], b.get("bmm1_scale_log2"), q.device)
    if isinstance(b["bmm2_scale"], torch.Tensor):
        assert b["bmm2_scale"].dtype == torch.float32
    if decode:
        assert b["backend"] == "trtllm-gen" and b["causal_seqlens_kv_global"] is None
        assert (b["cp_world"], b["cp_rank"]) == (1, 0)
    else:
        check_trtllm_gen_sm107_only_feature(b["use_fp16_softmax"], "use_fp16_softmax", q.device)
        check_trtllm_gen_sm107_only_feature(b["uses_spcompress"], "uses_spcompress", q.device)
        assert b["causal"] or b["window_left"] < 0  # "Sliding-window non-causal attention is not supported"


TRTLLM_CASES = [(name, "none") for name in TRTLLM_SHAPES] + [(name, "fp8_tensor") for name in TRTLLM_SHAPES]


@pytest.mark.parametrize("name,quant", TRTLLM_CASES, ids=[f"{q}-{n}" for n, q in TRTLLM_CASES])
def test_trtllm_call_builds_binds_and_checks_on_meta(name, quant):
    B, Hq, Hkv, S, Skv, kind = TRTLLM_SHAPES[name]
    adapter = _adapter("flashinfer_trtllm", quant)
    args = _trtllm_meta_args(name, kv_dtype=torch.float8_e4m3fn if quant == "fp8_tensor" else torch.bfloat16)
    assert fa.quant_of("attention", args) == quant
    call = fa.build(adapter, args, Launch(pdl=True))
    assert call.function == (TRTLLM_DECODE if S == 1 else TRTLLM_CONTEXT)
    assert call.function in tables.entry_point("attention", "flashinfer_trtllm", quant).functions
    _trtllm_flashinfer_checks(call)
    b = call.bound().arguments
    q, (k_cache, v_cache) = b["query"], b["kv_cache"]
    assert tuple(q.shape) == (B * S, Hq, 128) and b["enable_pdl"] is True
    page = k_cache.shape[2]
    assert page == 64 and tuple(b["block_tables"].shape) == (B, -(-Skv // page))
    if kind == "cache" or quant == "none":  # in place: the cache / projections seen as pages (no copy)
        assert k_cache._base is args.key._base and v_cache._base is args.value._base
        assert q._base is args.query._base
    else:  # an FP8 prefill: K / V dequantised (the context kernel has no bf16-query / FP8-KV cubins)
        assert k_cache.dtype == torch.bfloat16 and k_cache._base is not args.key._base
    if quant == "fp8_tensor" and S == 1:
        assert k_cache.dtype == torch.float8_e4m3fn
        assert isinstance(b["bmm1_scale"], torch.Tensor) and isinstance(b["bmm2_scale"], torch.Tensor)
    else:
        assert b["bmm1_scale"] == pytest.approx(1 / math.sqrt(128)) and b["bmm2_scale"] == 1.0
    out = call.finish(b["out"])
    want = attn._output_like(args.query, 128)
    assert out.shape == want.shape and out.stride() == want.stride() and out.dtype == torch.bfloat16


def test_trtllm_static_cache_pages_address_the_cache():
    """Page ``b * Hkv * L / P + j`` of the view starts at token ``j * P`` of element b's rows (each head)."""
    call = fa.build(_adapter("flashinfer_trtllm"), _trtllm_meta_args("qwen3-decode-16384"), Launch())
    k_cache = call.bound().arguments["kv_cache"][0]
    assert k_cache.stride() == (64 * 128, STATIC_LEN * 128, 128, 1)
    assert k_cache.shape[0] == 7 * 4 * STATIC_LEN // 64 + 16384 // 64
    assert call.bound().arguments["max_seq_len"] == 16384


def test_trtllm_entry_names_both_functions_on_blackwell_only():
    for quant in ("none", "fp8_tensor"):
        entry = tables.entry_point("attention", "flashinfer_trtllm", quant)
        assert set(entry.functions) == {TRTLLM_DECODE, TRTLLM_CONTEXT}
        assert tables.declared_ccs(entry) == {100, 103, 107}
        assert "cc [100, 103, 107]" in tables.check_entry(entry, SM90, KernelSpec(op="attention", quant=quant))
    adapter = _adapter("flashinfer_trtllm")
    assert adapter.function == TRTLLM_DECODE and adapter.functions == (TRTLLM_CONTEXT,)


def test_trtllm_supports():
    a = _adapter("flashinfer_trtllm")

    def spec(activation=None, quant="none", act="bfloat16", kv="bfloat16", **dims):
        shape = {"D": 128, "Dv": 128, "S": 1, "Skv": 4096, **dims}  # a size None: dynamic, not in the spec
        shape = tuple((n, s) for n, s in shape.items() if s is not None)
        return KernelSpec(
            op="attention", quant=quant, act_dtype=act, weight_dtype=kv, shape=shape, activation=activation
        )

    assert a.supports(SM100, spec()) is None
    assert a.supports(SM100, spec("causal", S=2048, Skv=2048)) is None
    assert a.supports(SM100, spec(S=300, Skv=300)) is None  # no mask, S > 1: the context kernel's dense mode
    assert "mask" in a.supports(SM100, spec("mask"))
    assert "bottom-right" in a.supports(SM100, spec("causal", S=20, Skv=16))
    assert "Dv == D" in a.supports(SM100, spec(D=192, Dv=128))
    assert "head dim 96" in a.supports(SM100, spec(D=96, Dv=96))
    fp8 = dict(quant="fp8_tensor", kv="float8_e4m3fn")
    assert a.supports(SM100, spec(**fp8)) is None
    assert "bf16 query and e4m3" in a.supports(SM100, spec(act="float16", **fp8))
    assert "bf16 query and e4m3" in a.supports(SM100, spec(quant="fp8_tensor", kv="float8_e5m2"))
    assert a.supports(SM100, spec("causal", S=None, Skv=None, **fp8)) is None
    assert "bf16 query and e4m3" in a.supports(SM100, spec("causal", S=None, Skv=None, act="float16", **fp8))
    # a prefill dequantises K / V, whatever the FP8 pair
    assert a.supports(SM100, spec("causal", S=2048, Skv=2048, act="float16", **fp8)) is None


def test_trtllm_check_catches_wrong_arguments():
    adapter = _adapter("flashinfer_trtllm")
    call = fa.build(adapter, _trtllm_meta_args("qwen3-decode-4096"), Launch())
    b = call.bound().arguments

    def broken(**changes):  # the call with some arguments replaced
        return Call(call.function, (), {**b, **changes}, call.finish)

    adapter.check(broken())
    q, (k, v) = b["query"], b["kv_cache"]
    with pytest.raises(AdapterCheckError, match="query must be bf16"):
        adapter.check(broken(query=q.float(), out=b["out"].float()))
    with pytest.raises(AdapterCheckError, match="K's strides for V"):
        adapter.check(broken(kv_cache=(k, v.contiguous())))
    with pytest.raises(AdapterCheckError, match="page size 8"):
        small = torch.empty(k.shape[0], k.shape[1], 8, 128, dtype=k.dtype, device="meta")
        adapter.check(broken(kv_cache=(small, small)))
    with pytest.raises(AdapterCheckError, match="no flashinfer.decode"):
        e5m2 = k.to(torch.float8_e5m2)
        adapter.check(broken(kv_cache=(e5m2, e5m2)))
    with pytest.raises(AdapterCheckError, match="block_tables int32"):
        adapter.check(broken(block_tables=b["block_tables"].long()))
    with pytest.raises(AdapterCheckError, match="exceeds the block table"):
        adapter.check(broken(max_seq_len=4096 + 64))
    with pytest.raises(AdapterCheckError, match="16-byte"):
        odd = torch.empty(k.shape[0], k.shape[1], k.shape[2], 136, dtype=k.dtype, device="meta")[..., 4:132]
        adapter.check(broken(kv_cache=(odd, odd)))
    with pytest.raises(AdapterCheckError, match="Invalid shape of out"):
        adapter.check(broken(out=b["out"][:, :16]))
    with pytest.raises(AdapterCheckError, match="bmm1_scale must be one float32"):
        adapter.check(broken(bmm1_scale=torch.empty(2, device="meta")))
    fp8 = broken(kv_cache=(k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)))
    adapter.check(fp8)  # the decode kernel runs a bf16 query against an e4m3 cache
    ctx = fa.build(adapter, _trtllm_meta_args("qwen3-prefill-2048"), Launch())
    cb = ctx.bound().arguments
    e4m3 = tuple(t.to(torch.float8_e4m3fn) for t in cb["kv_cache"])
    with pytest.raises(AdapterCheckError, match="no flashinfer.prefill"):
        adapter.check(Call(ctx.function, ctx.args[:1] + (e4m3,) + ctx.args[2:], ctx.kwargs, ctx.finish))


# numerics: trtllm-gen's documented paged semantics in float64, read through the call's own views


def emulated_trtllm(call: Call) -> torch.Tensor:
    """What the decode / context kernel computes from the call's arguments: per request b, the first
    ``seq_lens[b]`` tokens of the pages ``block_tables[b]`` (HND: [page, head, token, dim]); decode: the
    request's ``q_len_per_req`` query rows, row j seeing ``seq_len - (q_len - 1 - j)`` keys (causal, bottom-right);
    context: rows ``cum_seq_lens_q[b]:[b+1]``, bottom-right causal or dense; logits * bmm1_scale, output *
    bmm2_scale, GQA head h -> h // (Hq / Hkv)."""
    b = call.bound().arguments
    q, (k_cache, v_cache) = b["query"], b["kv_cache"]
    decode = call.function == TRTLLM_DECODE
    T, Hq, D = q.shape
    Hkv, page = k_cache.shape[1], k_cache.shape[2]
    n = Hq // Hkv
    batch = T // b["q_len_per_req"] if decode else b["batch_size"]
    bmm1 = float(b["bmm1_scale"]) if not isinstance(b["bmm1_scale"], torch.Tensor) else b["bmm1_scale"].item()
    bmm2 = float(b["bmm2_scale"]) if not isinstance(b["bmm2_scale"], torch.Tensor) else b["bmm2_scale"].item()
    out = torch.empty(T, Hq, D, dtype=torch.float64)
    for r in range(batch):
        L = int(b["seq_lens"][r])
        pages = b["block_tables"][r, : -(-L // page)].long()
        K = k_cache[pages].double().permute(1, 0, 2, 3).reshape(Hkv, -1, D)[:, :L].repeat_interleave(n, 0)
        V = v_cache[pages].double().permute(1, 0, 2, 3).reshape(Hkv, -1, D)[:, :L].repeat_interleave(n, 0)
        if decode:
            lo, hi, causal = r * b["q_len_per_req"], (r + 1) * b["q_len_per_req"], True
        else:
            lo, hi, causal = int(b["cum_seq_lens_q"][r]), int(b["cum_seq_lens_q"][r + 1]), b["causal"]
        Q = q[lo:hi].double().transpose(0, 1)  # [Hq, rows, D]
        logits = Q @ K.transpose(1, 2) * bmm1
        if causal:
            rows = hi - lo
            i, j = torch.arange(rows)[:, None], torch.arange(L)[None, :]
            logits = logits.masked_fill(j > i + L - rows, float("-inf"))
        out[lo:hi] = (torch.softmax(logits, -1) @ V * bmm2).transpose(0, 1)
    return out.to(q.dtype)


TRTLLM_NUMERIC = {
    # name: (B, Hq, Hkv, S, Skv, causal, layout, buffer length) -- layout "cache": [B, Hkv, length, D] read to Skv
    "decode-static-cache-in-place": (3, 8, 2, 1, 37, False, "cache", 128),
    "decode-static-cache-copied": (2, 8, 2, 1, 37, False, "cache", 45),
    "decode-causal-one-key": (2, 4, 4, 1, 9, True, "cache", 64),
    "decode-causal-spec-rows": (2, 8, 2, 5, 5, True, "hf", 5),
    "prefill-causal-hf-copied": (2, 8, 2, 19, 19, True, "hf", 19),
    "prefill-causal-hf-in-place": (2, 8, 2, 32, 32, True, "hf", 32),
    "prefill-causal-fewer-queries": (2, 4, 2, 17, 40, True, "hf", 40),
    "prefill-dense-b1": (1, 6, 3, 7, 10, False, "hf", 10),
}


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-kv"])
@pytest.mark.parametrize("name", list(TRTLLM_NUMERIC))
def test_trtllm_pages_and_finish_match_the_reference(name, fp8):
    B, Hq, Hkv, S, Skv, causal, layout, length = TRTLLM_NUMERIC[name]
    D = 16
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, S, Hq, D, generator=g).to(torch.bfloat16).transpose(1, 2)
    kv_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    if layout == "hf":
        k = torch.randn(B, Skv, Hkv, D, generator=g).to(kv_dtype).transpose(1, 2)
        v = torch.randn(B, Skv, Hkv, D, generator=g).to(kv_dtype).transpose(1, 2)
    else:
        k = torch.randn(B, Hkv, length, D, generator=g).to(kv_dtype)
        v = torch.randn(B, Hkv, length, D, generator=g).to(kv_dtype)
        k[:, :, Skv:] = 0  # a static cache's unwritten slots (the kernel reads them whole, masked)
        v[:, :, Skv:] = 0
        k, v = k[:, :, :Skv], v[:, :, :Skv]
    scales = dict(k_scale=torch.tensor(0.37), v_scale=torch.tensor(1.9)) if fp8 else {}
    args = AttentionArgs(q, k, v, is_causal=causal, scale=0.3, **scales)
    adapter = _adapter("flashinfer_trtllm", "fp8_tensor" if fp8 else "none")
    call = fa.build(adapter, args, Launch())
    _trtllm_flashinfer_checks(call)
    k_cache = call.bound().arguments["kv_cache"][0]
    in_place = "in-place" in name or (layout == "cache" and "copied" not in name)
    assert (k_cache.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()) == (
        in_place and not (fp8 and S > 1)
    )
    got = call.finish(emulated_trtllm(call))
    want = attn.reference(args)
    assert got.shape == want.shape and got.stride() == want.stride()
    tol = 2e-2 if fp8 else 1e-2  # bf16 inputs; fp8: the scales applied in fp32 (kernel) vs bf16 (reference)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_trtllm_call_rejects_what_supports_rejects():
    adapter = _adapter("flashinfer_trtllm", "fp8_tensor")
    with pytest.raises(AdapterCheckError, match="bottom-right"):
        fa.build(adapter, _meta_args((1, 4, 4, 20, 16, 128, 128)), Launch())
    with pytest.raises(AdapterCheckError, match="Dv"):
        fa.build(adapter, _meta_args((1, 16, 16, 8, 8, 192, 128)), Launch())
    fp16 = _trtllm_meta_args("qwen3-decode-4096", kv_dtype=torch.float8_e4m3fn, q_dtype=torch.float16)
    with pytest.raises(AdapterCheckError, match="FP8 decode needs a bf16 query"):
        fa.build(adapter, fp16, Launch())
    prefill = _trtllm_meta_args("qwen3-prefill-2048", kv_dtype=torch.float8_e5m2, q_dtype=torch.float16)
    call = fa.build(adapter, prefill, Launch())  # a prefill dequantises any FP8 pair
    assert call.function == TRTLLM_CONTEXT and call.bound().arguments["kv_cache"][0].dtype == torch.float16
