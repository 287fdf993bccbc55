"""The FlashInfer FA2 / FA3 attention adapters (rubin_compile/kernels/flashinfer/attention.py) on an sm_90 GPU.

``run(adapter, args, launch)`` -- the batch folded into the heads, ``single_prefill_with_kv_cache`` -- against
rubin.attention's reference computed on float32 copies of the same bf16 inputs: prefill with the causal mask
(S == Skv) and decode (S = 1, no mask) from a static cache (a slice of a longer contiguous buffer), B = 2,
GQA 1 and 4, lengths that are not multiples of 64, head dim 128 (each FlashInfer variant is JIT-compiled on
first use, 20-60 s: the parametrisation is kept small). Tolerance: bf16 output, |err| <= 1e-2 + 1e-2 |ref|
(logits of unit-variance inputs, one bf16 rounding of the output); FP8 KV (FA2): the reference dequantises
K / V with the same scales, 3e-2. Also: the decode call captured in a CUDA graph and replayed (no host sync).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("flashinfer")

from rubin_compile.kernels.flashinfer import adapter as fa  # noqa: E402
from rubin_compile.ops.attention import AttentionArgs, reference  # noqa: E402
from rubin_compile import target as T  # noqa: E402
from rubin_compile.ops.registry import KernelSpec, Launch  # noqa: E402

import rubin_compile.kernels.flashinfer  # noqa: E402, F401  (registers the adapters)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _cc_major() -> int:
    return torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 0


needs_sm90 = pytest.mark.skipif(_cc_major() != 9, reason="FA3 runs on sm_90 only (and these tests target the H200)")

D = 128


def _inputs(B, Hq, Hkv, S, Skv, kind, kv_dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn((B, S, Hq, D), generator=g, device="cuda").to(torch.bfloat16).transpose(1, 2)
    if kind == "prefill":  # Hugging Face projections: [B, S, H, D] memory seen as [B, H, S, D]
        k = torch.randn((B, Skv, Hkv, D), generator=g, device="cuda").transpose(1, 2)
        v = torch.randn((B, Skv, Hkv, D), generator=g, device="cuda").transpose(1, 2)
    else:  # a static cache [B, Hkv, max_len, D], the first Skv positions read
        k = torch.randn((B, Hkv, Skv + 61, D), generator=g, device="cuda")[:, :, :Skv]
        v = torch.randn((B, Hkv, Skv + 61, D), generator=g, device="cuda")[:, :, :Skv]
    return q, k.to(kv_dtype), v.to(kv_dtype)


def _fp32_reference(args: AttentionArgs) -> torch.Tensor:
    key = args.key if args.k_scale is None else args.key.float() * args.k_scale
    value = args.value if args.v_scale is None else args.value.float() * args.v_scale
    up = AttentionArgs(args.query.float(), key.float(), value.float(), is_causal=args.is_causal, scale=args.scale)
    return reference(up)


CASES = [
    # kind, S, Skv, causal
    ("prefill", 200, 200, True),
    ("decode", 1, 333, False),
]


@needs_sm90
@pytest.mark.parametrize("kernel", ["flashinfer_fa2", "flashinfer_fa3"])
@pytest.mark.parametrize("Hq,Hkv", [(8, 8), (32, 8)], ids=["gqa1", "gqa4"])
@pytest.mark.parametrize("kind,S,Skv,causal", CASES, ids=[c[0] for c in CASES])
def test_matches_reference_bf16(kernel, Hq, Hkv, kind, S, Skv, causal):
    if kernel == "flashinfer_fa3" and kind == "decode":  # FA3 declines decode (attention.py: FA3Prefill)
        spec = KernelSpec(op="attention", shape=(("S", S), ("D", 128)))
        assert "decode" in fa.adapter_for("attention", kernel, "none").supports(T.resolve("sm90"), spec)
        return
    q, k, v = _inputs(2, Hq, Hkv, S, Skv, kind)
    args = AttentionArgs(q, k, v, is_causal=causal)
    got = fa.run(fa.adapter_for("attention", kernel, "none"), args, Launch())
    want = _fp32_reference(args)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape and got.stride() == reference(args).stride()
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)


@needs_sm90
@pytest.mark.parametrize("kind,S,Skv,causal", CASES, ids=[c[0] for c in CASES])
def test_fa2_fp8_kv_matches_reference(kind, S, Skv, causal):
    q, k, v = _inputs(2, 32, 8, S, Skv, kind, kv_dtype=torch.float8_e4m3fn)
    scales = dict(k_scale=torch.tensor(0.5, device="cuda"), v_scale=torch.tensor(1.7, device="cuda"))
    args = AttentionArgs(q, k, v, is_causal=causal, **scales)
    got = fa.run(fa.adapter_for("attention", "flashinfer_fa2", "fp8_tensor"), args, Launch())
    torch.testing.assert_close(got.float(), _fp32_reference(args), atol=3e-2, rtol=3e-2)


@needs_sm90
def test_fa2_decode_captures_in_a_cuda_graph():
    adapter = fa.adapter_for("attention", "flashinfer_fa2", "none")
    q, k, v = _inputs(2, 32, 8, 1, 333, "decode")
    args = AttentionArgs(q, k, v)
    fa.run(adapter, args, Launch())  # warm-up: JIT build outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fa.run(adapter, args, Launch())
    q.copy_(torch.randn_like(q))  # new inputs in place, then replay
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), _fp32_reference(args), atol=1e-2, rtol=1e-2)


# ------------------------------------------------------------------------------------------------
# flashinfer_trtllm: trtllm-gen's paged decode / context kernels, sm_100 / 103 / 107 only
# ------------------------------------------------------------------------------------------------
# run() against the fp32 reference: decode from a static cache read in place (buffer length 4096, pages of 64)
# and at an odd length (Skv + 61: copied where no page size fits, Hkv = 4; pages of 16 in place for Hkv = 8), speculative-style causal decode (S = Skv = 5, the
# decode kernel), causal prefill in Hugging Face's layout (S = Skv = 256 in place, 200 copied), a dense prefill
# (no mask, S = 64 < Skv = 100: the context kernel with causal=False); FP8 e4m3 KV in decode (bf16 query
# against the FP8 cache) and prefill (K / V dequantised). Tolerances as above. Also the decode call captured
# in a CUDA graph and replayed.

needs_sm10x = pytest.mark.skipif(_cc_major() != 10, reason="trtllm-gen attention runs on cc major 10 only")

TRTLLM_GPU_CASES = [
    # kind, S, Skv, causal, buffer length (static cache) or None (Hugging Face layout)
    ("decode-in-place", 1, 333, False, 4096),
    ("decode-odd-length", 1, 333, False, 333 + 61),
    ("decode-causal-rows", 5, 5, True, None),
    ("prefill-in-place", 256, 256, True, None),
    ("prefill-copied", 200, 200, True, None),
    ("prefill-dense", 64, 100, False, None),
]


def _trtllm_inputs(B, Hq, Hkv, S, Skv, length, kv_dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn((B, S, Hq, D), generator=g, device="cuda").to(torch.bfloat16).transpose(1, 2)
    if length is None:
        k = torch.randn((B, Skv, Hkv, D), generator=g, device="cuda").to(kv_dtype).transpose(1, 2)
        v = torch.randn((B, Skv, Hkv, D), generator=g, device="cuda").to(kv_dtype).transpose(1, 2)
        return q, k, v
    k = torch.zeros((B, Hkv, length, D), device="cuda", dtype=kv_dtype)  # unwritten slots are zeros
    v = torch.zeros((B, Hkv, length, D), device="cuda", dtype=kv_dtype)
    k[:, :, :Skv] = torch.randn((B, Hkv, Skv, D), generator=g, device="cuda").to(kv_dtype)
    v[:, :, :Skv] = torch.randn((B, Hkv, Skv, D), generator=g, device="cuda").to(kv_dtype)
    return q, k[:, :, :Skv], v[:, :, :Skv]


@needs_sm10x
@pytest.mark.parametrize("Hq,Hkv", [(8, 8), (32, 4)], ids=["gqa1", "gqa8"])
@pytest.mark.parametrize("kind,S,Skv,causal,length", TRTLLM_GPU_CASES, ids=[c[0] for c in TRTLLM_GPU_CASES])
def test_trtllm_matches_reference_bf16(Hq, Hkv, kind, S, Skv, causal, length):
    q, k, v = _trtllm_inputs(2, Hq, Hkv, S, Skv, length)
    args = AttentionArgs(q, k, v, is_causal=causal)
    got = fa.run(fa.adapter_for("attention", "flashinfer_trtllm", "none"), args, Launch())
    want = _fp32_reference(args)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape and got.stride() == reference(args).stride()
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)


@needs_sm10x
@pytest.mark.parametrize("kind,S,Skv,causal,length", TRTLLM_GPU_CASES, ids=[c[0] for c in TRTLLM_GPU_CASES])
def test_trtllm_fp8_kv_matches_reference(kind, S, Skv, causal, length):
    q, k, v = _trtllm_inputs(2, 32, 4, S, Skv, length, kv_dtype=torch.float8_e4m3fn)
    scales = dict(k_scale=torch.tensor(0.5, device="cuda"), v_scale=torch.tensor(1.7, device="cuda"))
    args = AttentionArgs(q, k, v, is_causal=causal, **scales)
    got = fa.run(fa.adapter_for("attention", "flashinfer_trtllm", "fp8_tensor"), args, Launch())
    torch.testing.assert_close(got.float(), _fp32_reference(args), atol=3e-2, rtol=3e-2)


@needs_sm10x
def test_trtllm_decode_captures_in_a_cuda_graph():
    adapter = fa.adapter_for("attention", "flashinfer_trtllm", "none")
    q, k, v = _trtllm_inputs(2, 32, 4, 1, 333, 4096)
    args = AttentionArgs(q, k, v)
    fa.run(adapter, args, Launch())  # warm-up: cubins loaded, workspace made, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fa.run(adapter, args, Launch())
    q.copy_(torch.randn_like(q))  # new inputs in place, then replay
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), _fp32_reference(args), atol=1e-2, rtol=1e-2)


@needs_sm90
@pytest.mark.parametrize("B,layout", [(1, "hf"), (1, "static"), (2, "hf")])
def test_fa3_prefill_reads_every_kv_layout(B, layout):
    """FA3 in NHD from the layouts rubin.attention receives: Hugging Face's [B, S, H, D] seen as [B, H, S, D] (a view
    for B = 1) and a static cache [B, Hkv, L, D] sliced to the prompt (copied to NHD)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    S, Hq, Hkv = 300, 32, 4
    q = torch.randn((B, S, Hq, D), generator=g, device="cuda").to(torch.bfloat16).transpose(1, 2)
    if layout == "hf":
        k = torch.randn((B, S, Hkv, D), generator=g, device="cuda").to(torch.bfloat16).transpose(1, 2)
        v = torch.randn((B, S, Hkv, D), generator=g, device="cuda").to(torch.bfloat16).transpose(1, 2)
    else:
        k = torch.randn((B, Hkv, 1024, D), generator=g, device="cuda").to(torch.bfloat16)[:, :, :S]
        v = torch.randn((B, Hkv, 1024, D), generator=g, device="cuda").to(torch.bfloat16)[:, :, :S]
    args = AttentionArgs(q, k, v, is_causal=True)
    got = fa.run(fa.adapter_for("attention", "flashinfer_fa3", "none"), args, Launch())
    torch.testing.assert_close(got.float(), _fp32_reference(args), atol=1e-2, rtol=1e-2)
