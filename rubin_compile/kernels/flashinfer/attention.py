"""Adapters from rubin.attention to FlashInfer's attention kernels.

FA2 / FA3 (``flashinfer_fa2``, ``flashinfer_fa3``): ``flashinfer.prefill.single_prefill_with_kv_cache`` with
``backend="fa2"`` / ``"fa3"``, for prefill (S > 1) and decode (S = 1) alike, the batch folded into the heads.

Why this entry point and not the batch wrappers (``BatchPrefillWith{Ragged,Paged}KVCacheWrapper``,
``BatchDecodeWithPagedKVCacheWrapper``), measured nothing, from the source:

* The wrappers' ``plan()`` runs host code (it copies the indptr arrays to pinned host memory and schedules the
  work on the CPU, flashinfer/prefill.py:BatchPrefillWithPagedKVCacheWrapper.plan) and keeps the schedule in
  the wrapper; the plan would have to be made once per (device, shape) outside any CUDA graph capture and kept
  with its workspace buffers, which ``Adapter.prepare`` (keyed on weights, of which attention has none) cannot
  hold. ``single_prefill_with_kv_cache`` needs no plan: every call is a pure function of its tensors and
  capturable (its 32 MiB split-KV scratch, ``SINGLE_KERNEL_TMP_SIZE``, is a ``torch.empty`` from the caching
  allocator, i.e. from the graph's pool during a capture).
* rubin.attention's batch is uniform (every element has S queries and Skv keys), so the batch is exactly more
  heads: query [B, Hq, S, D] is [S, B*Hq, D] and key [B, Hkv, Skv, D] is [B*Hkv, Skv, D] (``kv_layout="HND"``),
  and query head ``b*Hq + h`` reads key head ``(b*Hq + h) // n = b*Hkv + h // n`` -- GQA's grouping. One
  launch for the batch, where a loop over the batch would be B launches (and no single ``Call``).
* The kernel takes the q / k / v head and token strides (data/csrc/single_prefill.cu, single_prefill_sm90.cu
  read ``stride(0)`` / ``stride(1)``), so the fold is a view whenever the batch stride is Hkv (Hq) times the
  head stride: a contiguous static KV cache [B, Hkv, max_len, D] (sliced or not), a concatenated dynamic cache,
  any B = 1 tensor, and the decode query. Otherwise (Hugging Face prefill projections [B, S, H, D] seen as
  [B, H, S, D] with B > 1) ``reshape`` copies that tensor once.
* ``single_decode_with_kv_cache`` (the CUDA-core decode kernel) would need contiguous q / k / v and D == Dv
  (data/csrc/single_decode.cu: CHECK_INPUT, "CUDA cores template only supports equal head dim") and is a
  second function, where an adapter names one; FA2's prefill kernel splits the KV sequence itself for a short
  query (SinglePrefillWithKVCacheDispatched, ``partition_kv`` into the scratch), so decode is served by it.
  FA3's single-request kernel has no KV split: a long-context decode runs B*Hkv CTAs (slow, correct).

Masks: FA2 takes one bool ``custom_mask`` [S, Skv] for all heads (so with the fold, one for the batch too), FA3
none (flashinfer/utils.py:is_fa3_backend_supported: ``use_custom_mask`` -> False). A spec's ``activation`` says
``"mask"`` but not whether it is bool or additive nor whether it varies over batch / heads, so both adapters
reject masks and SDPA (or the Triton decode kernel) runs them. Causal: FlashInfer aligns the causal mask
bottom-right (query i sees keys j <= i + Skv - S); rubin's is upper-left (j <= i). For S <= Skv no query sees
a key at or beyond S, so the adapters pass the first S keys, where both alignments agree; S > Skv (rows that
see every key under upper-left, nothing under bottom-right) is rejected.

FP8 KV cache (FA2 only: FA3 wants an FP8 query too, tables.py's rule): FA2 runs a bf16 / fp16 query against
e4m3 / e5m2 keys and values (gen_single_prefill_module: ``fp8_enabled`` only for an FP8 *query*). The
per-tensor ``k_scale`` / ``v_scale`` arrive as device tensors; FlashInfer's ``k_scale`` / ``v_scale`` arguments
are host floats (``sm_scale *= k_scale``), which would cost a device-to-host sync per call and break capture.
So ``k_scale`` is folded into the query (``(q.float() * k_scale).to(q.dtype)``: q.K*s == (q*s).K) and ``v_scale``
into the output (``out * v_scale``: softmax(.) @ (V*s) == (softmax(.) @ V) * s), both on the GPU; each is one
rounding to the query's dtype, as the reference's dequantisation of K and V is.

trtllm-gen (``flashinfer_trtllm``, sm_100 / 103 / 107): ``trtllm_batch_decode_with_kv_cache`` for one query
per batch element (up to 16 causal ones) and ``trtllm_batch_context_with_kv_cache`` otherwise, chosen per call
(``Adapter.functions``). Both take a paged HND cache; a static cache and most projections are seen as pages in
place (``TrtllmGenAttention`` says how, and when K / V are copied). Their scales are device tensors (no host
sync); the workspace and counters are long-lived per-device buffers (``adapter.buffer``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from rubin_compile.kernels.flashinfer.adapter import FP8, Adapter, AdapterCheckError, Call, buffer, register, require
from rubin_compile.ops.attention import AttentionArgs, dequantized
from rubin_compile.ops.registry import KernelSpec, Launch
from rubin_compile.target import Target

_HALF = (torch.bfloat16, torch.float16)


def _last_dim_unit(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit-stride head dim (FlashInfer's kernels load rows of the head dim as vectors)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _causal_mask_reason(spec: KernelSpec) -> Optional[str]:
    S, Skv = spec.dim("S"), spec.dim("Skv")
    if spec.activation == "causal" and S is not None and Skv is not None and S > Skv:
        return (
            f"causal attention with more queries than keys (S={S} > Skv={Skv}): FlashInfer's causal mask is "
            "aligned bottom-right, rubin's upper-left, and they differ there"
        )
    return None


class _SinglePrefill(Adapter):
    """rubin.attention -> ``single_prefill_with_kv_cache(q [S, B*Hq, D], k / v [B*Hkv, Skv, D(v)] HND,
    causal=, sm_scale=, backend=)``; see the module docstring for the fold, the causal shift and FP8."""

    function = "flashinfer.prefill.single_prefill_with_kv_cache"
    backend = ""
    kv_layout = "HND"

    def supports(self, target: Target, spec: KernelSpec) -> Optional[str]:
        if spec.activation == "mask":
            return (
                "an explicit attention mask: FlashInfer's FA2 takes one bool mask for all heads and FA3 none, "
                "and the spec does not say the mask is of that kind (SDPA runs it)"
            )
        return _causal_mask_reason(spec)

    def call(self, args: AttentionArgs, prepared: dict[str, torch.Tensor], launch: Launch) -> Call:
        if args.attn_mask is not None:
            raise AdapterCheckError(f"{self.name}: an explicit attn_mask is not supported (supports() rejects it)")
        B, Hq, Hkv, S, Skv, Dv = args.B, args.Hq, args.Hkv, args.S, args.Skv, args.Dv
        query, key, value = args.query, args.key, args.value
        if args.is_causal:
            if S > Skv:
                raise AdapterCheckError(f"{self.name}: {_causal_mask_reason(_spec_of(args))}")
            if S < Skv:  # upper-left == bottom-right over the first S keys (module docstring)
                key, value, Skv = key[:, :, :S], value[:, :, :S], S
        if args.k_scale is not None:
            query = (query.float() * args.k_scale.reshape(())).to(query.dtype)
        q = _last_dim_unit(query.permute(2, 0, 1, 3).reshape(S, B * Hq, args.D))
        if self.kv_layout == "HND":
            k = _last_dim_unit(key.reshape(B * Hkv, Skv, args.D))
            v = _last_dim_unit(value.reshape(B * Hkv, Skv, Dv))
        else:  # NHD [Skv, B*Hkv, D], tokens outermost (a copy unless the memory already is)
            k = _natural_nhd(key.permute(2, 0, 1, 3).reshape(Skv, B * Hkv, args.D))
            v = _natural_nhd(value.permute(2, 0, 1, 3).reshape(Skv, B * Hkv, Dv))
        v_scale = args.v_scale

        def finish(out: torch.Tensor) -> torch.Tensor:
            # out: [S, B*Hq, Dv] contiguous; the op's result is [B, Hq, S, Dv] laid out as [B, S, Hq, Dv].
            if B == 1 or S == 1:  # the same memory order: a view
                result = out.view(B, S, Hq, Dv).transpose(1, 2)
            else:
                result = out.new_empty((B, S, Hq, Dv)).transpose(1, 2)
                result.copy_(out.view(S, B, Hq, Dv).permute(1, 2, 0, 3))
            if v_scale is not None:
                result.mul_(v_scale.reshape(()))
            return result

        kwargs = dict(causal=bool(args.is_causal), kv_layout=self.kv_layout, sm_scale=args.scale, backend=self.backend)
        return Call(self.function, (q, k, v), kwargs, finish)

    def check(self, call: Call) -> None:
        bound = call.bound().arguments
        q, k, v = bound["q"], bound["k"], bound["v"]
        require(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, self, "q, k, v must be 3-D ([tokens, heads, dim])")
        require(bound["kv_layout"] == self.kv_layout, self, f"k / v are built as {self.kv_layout}")
        if self.kv_layout == "NHD":
            for name, t in (("k", k), ("v", v)):
                require(t.stride(0) >= t.stride(1) >= t.stride(2) == 1, self, f"{name} must be NHD, tokens outermost")
        require(bound["backend"] == self.backend, self, f"backend must be {self.backend!r}")
        require(q.dtype in _HALF, self, f"the query must be bf16 / fp16, got {q.dtype}")
        require(k.dtype == v.dtype, self, f"key and value dtypes differ: {k.dtype}, {v.dtype}")
        kv_ok = (q.dtype,) + (FP8 if self.backend == "fa2" else ())
        require(k.dtype in kv_ok, self, f"key / value dtype {k.dtype} with a {q.dtype} query (allowed: {kv_ok})")
        require(k.shape[:2] == v.shape[:2], self, f"key {tuple(k.shape)} and value {tuple(v.shape)} differ")
        require(q.shape[2] == k.shape[2], self, f"query head dim {q.shape[2]} != key head dim {k.shape[2]}")
        heads, tokens = (k.shape[0], k.shape[1]) if self.kv_layout == "HND" else (k.shape[1], k.shape[0])
        require(heads > 0 and q.shape[1] % heads == 0, self, "query heads must be a multiple of KV heads")
        for name, t in (("q", q), ("k", k), ("v", v)):
            require(t.stride(-1) == 1, self, f"{name}'s head dim must have stride 1, got strides {t.stride()}")
        if bound["causal"]:
            require(q.shape[0] == tokens, self, "causal needs as many keys as queries (bottom-right alignment)")
        require(bound["custom_mask"] is None and bound["packed_custom_mask"] is None, self, "no custom mask is passed")
        require(
            bound["k_scale"] is None and bound["v_scale"] is None, self, "scales are applied on the GPU, not as floats"
        )
        if self.backend == "fa3":
            from flashinfer.utils import is_fa3_prefill_head_dim_supported

            require(
                is_fa3_prefill_head_dim_supported(q.shape[2], v.shape[2]),
                self,
                f"FA3 has no kernel for head dims {q.shape[2]} / {v.shape[2]} (utils.py:is_fa3_prefill_head_dim_supported)",
            )


def _spec_of(args: AttentionArgs) -> KernelSpec:
    """The part of the node's spec the causal rule reads, for an error raised at call time."""
    return KernelSpec(op="attention", shape=(("S", args.S), ("Skv", args.Skv)), activation="causal")


@register("attention", "flashinfer_fa2", "none", "fp8_tensor")
class FA2Prefill(_SinglePrefill):
    name = "flashinfer_fa2.single_prefill"
    tested_on = ("H200",)  # tests/gpu/test_flashinfer_*.py passed there (benchmarks/results/flashinfer-h200.log)
    backend = "fa2"


# FA3 with an FP8 KV cache is plan only: FlashInfer's FA3 FP8 kernel wants the query in FP8 too
# (utils.py:is_fa3_backend_supported; single_prefill_with_kv_cache asserts q.dtype == k.dtype == v.dtype), and
# rubin.attention's query is bf16 / fp16 (tables.py's _fa3_fp8 rejects it before the adapter is asked).
@register("attention", "flashinfer_fa3", "none")
class FA3Prefill(_SinglePrefill):
    """FA3 for prefill only, K / V in NHD. On the H200 (FlashInfer 0.7.2.post1) FA3's single-request kernel with
    ``kv_layout="HND"`` aborted the process (a TMA descriptor it builds with the head and token strides swapped:
    "Failed to initialize the TMA descriptor", then SIGFPE; benchmarks/results/flashinfer-h200.log), for the
    Hugging Face layout and the static cache alike; NHD with tokens outermost is the layout its own tests use.
    Decode is left to our split-KV kernel / FA2: this kernel does not split the KV length, so one query token
    runs B * Hkv blocks. Its host code builds TMA descriptors with the driver API, which needs the calling thread's
    CUDA context current: called first from a fresh thread (benchmarks/flashinfer_kernels.py's threaded warm-up) it failed
    with error 201 (invalid context) and then an illegal instruction; from the thread that runs the model (where
    torch has made a CUDA call) it ran."""

    name = "flashinfer_fa3.single_prefill"
    backend = "fa3"
    kv_layout = "NHD"
    tested_on = (
        "H200",
    )  # tests/gpu/test_flashinfer_attention.py passed there (benchmarks/results/flashinfer-h200.log)

    def supports(self, target: Target, spec: KernelSpec) -> Optional[str]:
        S = spec.dim("S")
        if S is not None and S <= _DECODE_QUERIES:
            return f"{S} query positions: decode (FA3's single-request kernel does not split the KV length)"
        return super().supports(target, spec)

    def call(self, args: AttentionArgs, prepared: dict[str, torch.Tensor], launch: Launch) -> Call:
        if args.S <= _DECODE_QUERIES:  # a symbolic S planned for prefill, run at decode
            raise AdapterCheckError(f"{self.name}: {args.S} query positions are decode; FA3 runs prefill here")
        return super().call(args, prepared, launch)


_DECODE_QUERIES = 4  # kernels/triton/__init__.py's DECODE_MAX_QUERIES


def _natural_nhd(t: torch.Tensor) -> torch.Tensor:
    """``t`` [tokens, heads, dim] with tokens outermost in memory (what FA3's TMA descriptors take), copied if not."""
    return t if t.stride(0) >= t.stride(1) >= t.stride(2) == 1 else t.contiguous()


# ------------------------------------------------------------------------------------------------
# flashinfer_trtllm: trtllm-gen's paged-KV decode and context kernels (sm_100 / 103 / 107)
# ------------------------------------------------------------------------------------------------

_TRTLLM_DECODE = "flashinfer.decode.trtllm_batch_decode_with_kv_cache"
_TRTLLM_CONTEXT = "flashinfer.prefill.trtllm_batch_context_with_kv_cache"
# Page sizes tried, largest first. trtllm-gen needs a power of 2 (kernelParams.h: "NumTokensPerPage must be
# power of 2"); 16 / 32 / 64 are the sizes vLLM serves on every trtllm-gen path
# (vllm/v1/attention/backends/flashinfer.py:get_supported_kernel_block_sizes; >= 128 only for GQA, through the
# dynamic-page-size cubins, fmhaKernels.cuh:useDynamicNumTokensPerPage).
_PAGE_SIZES = (64, 32, 16)
# Causal queries per batch element given to the decode kernel (its q_len_per_req, a speculative-decoding depth;
# FlashInfer states no limit, 16 is this adapter's choice: short causal blocks); more, or non-causal S > 1, go
# to the context kernel. The decode kernel's mask is causal, bottom-right (launcher: TrtllmGenAttentionMaskType::Causal for
# generation), which for one query is no mask.
_DECODE_MAX_CAUSAL_S = 16
# The workspace (softmax stats, the multi-CTA split-KV partials: "scratch takes the rest of the workspace
# buffer", trtllm_fmha_kernel_launcher.cu): FlashInfer's documented size, zero-initialised as FlashInfer's
# examples and vLLM (_get_trtllm_workspace_buffer) make it.
_WORKSPACE_BYTES = 128 * 1024 * 1024
_TRTLLM_HEAD_DIMS = (64, 128, 256)


def _decode_kernel(S: int, causal: bool) -> bool:
    """Whether a call with ``S`` queries per batch element runs the decode kernel (else the context kernel)."""
    return S == 1 or (causal and S <= _DECODE_MAX_CAUSAL_S)


def _fp8_decode_ok(q_dtype, kv_dtype) -> bool:
    # decode.py: uses_bf16q_fp8kv (bf16 query, e4m3 K / V, bf16 output) selects the BF16-Q / FP8-KV transform
    # cubins; no other mixed pair is documented.
    return q_dtype == torch.bfloat16 and kv_dtype == torch.float8_e4m3fn


def _canonical_singletons(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the strides of its size-1 dims replaced by contiguous ones (they address nothing, but TMA
    descriptors take every stride and want multiples of 16 bytes; vLLM's canonicalize_singleton_dim_strides)."""
    if all(size != 1 for size in t.shape):
        return t
    strides, running = list(t.stride()), 1
    for i in range(t.dim() - 1, -1, -1):
        if t.shape[i] == 1:
            strides[i] = running
        running = max(running, strides[i] * t.shape[i])
    return t.as_strided(t.shape, strides)


def _paged_view(t: torch.Tensor, kv_len: int, page: int) -> Optional[tuple[torch.Tensor, int, int]]:
    """``t`` [B, H, >= kv_len, D] (head dim stride 1) seen in place as HND pages [num_pages, H, page, D]:
    ``(pages, pages_per_batch, pages_per_row)``, page ``b * pages_per_batch + j`` holding tokens
    ``j*page ..`` of batch element ``b`` (for every head: the head stride stays ``t``'s); ``None`` where the
    batch stride is not a whole number of pages or the last page would leave ``t``'s storage."""
    B, H, _, D = t.shape
    sB, sH, sT, _ = t.stride()
    row = -(-kv_len // page)
    if B > 1 and sB % (page * sT):
        return None
    per_batch = sB // (page * sT) if B > 1 else row
    num_pages = (B - 1) * per_batch + row
    # the last element of the view: page num_pages - 1, head H - 1, token page - 1, dim D - 1
    last = t.storage_offset() + (num_pages - 1) * page * sT + (H - 1) * sH + (page - 1) * sT + D - 1
    if last >= t.untyped_storage().nbytes() // t.element_size():
        return None
    view = t.as_strided((num_pages, H, page, D), (page * sT, sH, sT, 1), t.storage_offset())
    return view, per_batch, row


def _paged_kv(key: torch.Tensor, value: torch.Tensor, kv_len: int, scales=None, dtype=None):
    """K / V caches, the page size, pages per batch element and pages per row for the first ``kv_len``
    positions: views of ``key`` / ``value`` where possible, else zero-padded contiguous copies (always when
    ``scales`` = (k_scale, v_scale) is given: the copies are then K / V dequantised to ``dtype``)."""
    key, value = _last_dim_unit(key), _last_dim_unit(value)
    if scales is None and key.stride() == value.stride():  # one set of strides for both (launcher: kv_stride_*)
        for page in _PAGE_SIZES:
            k, v = _paged_view(key, kv_len, page), _paged_view(value, kv_len, page)
            if k is not None and v is not None:
                return k[0], v[0], page, k[1], k[2]
    page = _PAGE_SIZES[0]
    B, H, _, D = key.shape
    padded = -(-kv_len // page) * page
    copies = []
    for t, scale in zip((key, value), scales or (None, None)):
        t = t[:, :, :kv_len] if scales is None else dequantized(t[:, :, :kv_len], scale, dtype)
        # zeros: the kernel reads the last page whole and masks the tail; masked V rows must be finite
        buf = t.new_zeros((B, H, padded, D))
        buf[:, :, :kv_len].copy_(t)
        copies.append(_paged_view(buf, kv_len, page))
    (k, per_batch, row), (v, _, _) = copies
    return k, v, page, per_batch, row


def _counter_bytes(device: torch.device, batch: int, heads: int) -> int:
    """trtllm-gen's multi-CTA KV counter bytes (utils.py:get_trtllm_gen_multi_ctas_kv_counter_bytes), for the
    device's SM count (a nominal 148, B200's, on meta / CPU devices, where nothing runs)."""
    from flashinfer.utils import get_device_sm_count, get_trtllm_gen_multi_ctas_kv_counter_bytes

    sm_count = get_device_sm_count(device) if device.type == "cuda" else 148
    return get_trtllm_gen_multi_ctas_kv_counter_bytes(batch, heads, sm_count)


@register("attention", "flashinfer_trtllm", "none", "fp8_tensor")
class TrtllmGenAttention(Adapter):
    """rubin.attention -> trtllm-gen's paged-KV kernels: ``trtllm_batch_decode_with_kv_cache`` for one query
    per batch element (or up to 16 causal ones) and ``trtllm_batch_context_with_kv_cache`` otherwise, chosen
    per call (``functions``), ``backend="trtllm-gen"``, ``kv_layout="HND"``.

    The paged cache without a copy: both kernels take K / V as [num_pages, Hkv, page_size, D] with arbitrary
    page, head and token strides (head dim stride 1: decode.py's "Contiguity requirements"; the launcher reads
    ``stride(0)`` / ``stride(-3)`` / ``stride(-2)`` into the TMA descriptor, trtllm_fmha_kernel_launcher.cu).
    So rubin's key [B, Hkv, Skv, D] with strides (sB, sH, sT, 1) is pages of P tokens in place,
    ``as_strided([pages, Hkv, P, D], [P*sT, sH, sT, 1])``, page ``b*sB/(P*sT) + j`` holding tokens
    ``j*P .. j*P+P-1`` of element b (each head through the head stride), whenever sB is a multiple of P*sT (any
    B = 1 tensor; a static cache [B, Hkv, L, D] sliced to Skv when P divides Hkv*L; Hugging Face's [B, S, H, D]
    projections when P divides Skv) and the last page stays inside the tensor's storage. P is the largest of
    64 / 32 / 16 that fits. The block table (int32 [B, ceil(Skv/P)]), ``seq_lens`` (int32 [B]) and the
    context kernel's cumulative lengths are built on the GPU per call (arange / full: no host sync, capturable).
    Otherwise (K and V with different strides, or no page size fits) K and V are copied, each call, into
    zero-padded contiguous [B, Hkv, ceil(Skv/P)*P, D] buffers. The kernel reads the last page whole and masks
    the positions past ``seq_lens``: those must hold finite values (a static cache's unwritten slots are
    zeros, Hugging Face's StaticCache allocates with torch.zeros; the copies' padding is zeroed).

    Masks: no explicit mask (``supports`` rejects ``"mask"``). Causal: both kernels align the causal mask
    bottom-right (decode: row j of a request sees ``seq_len - (S - 1 - j)`` keys; context: TRT-LLM's
    chunked-prefill convention), rubin's is upper-left, so the kernels get the first S keys (``seq_lens`` = S),
    where both agree; S > Skv is rejected (as FA2 / FA3). Without a mask: S = 1 runs the decode kernel over
    all Skv keys, S > 1 the context kernel with ``causal=False`` (its dense mode).

    Scales: ``bmm1_scale`` = scale (a float) or, with an FP8 cache, ``scale * k_scale`` and ``bmm2_scale`` =
    ``v_scale``: float32 [1] device tensors, which trtllm-gen takes by pointer (no host sync; FlashInfer
    multiplies bmm1 by log2(e) on the GPU). FP8 KV (e4m3, per-tensor scales): the decode kernel runs a bf16
    query against e4m3 K / V (decode.py: uses_bf16q_fp8kv); the context kernel has no bf16-query / FP8-KV
    cubins (vLLM dequantises the pages for it, vllm/v1/attention/backends/flashinfer.py:
    trtllm_prefill_attn_kvfp8_dequant), so for a prefill K / V are dequantised on the GPU exactly as the
    reference does (``ops.attention.dequantized``: one copy of the keys read, which the prefill's
    S x Skv attention dwarfs) and the call is the bf16 one. Other FP8 pairs (e5m2, an fp16 query) are rejected where
    the decode kernel would run them.

    Buffers (``adapter.buffer``, per device, outside cudagraph pools): the 128 MiB zeroed workspace and the
    multi-CTA counters (zeroed once; the kernel resets them after each launch). D must equal Dv (the launcher
    checks K and V caches of one shape; ``out`` has the query's shape).
    """

    name = "flashinfer_trtllm.paged"
    function = _TRTLLM_DECODE
    functions = (_TRTLLM_CONTEXT,)

    def supports(self, target: Target, spec: KernelSpec) -> Optional[str]:
        if spec.activation == "mask":
            return "an explicit attention mask: trtllm-gen's paged kernels take none (SDPA runs it)"
        reason = _causal_mask_reason(spec)
        if reason:
            return reason
        d, dv = spec.dim("D"), spec.dim("Dv")
        if d is not None and dv is not None and d != dv:
            return f"shape limit: trtllm-gen's paged kernels need Dv == D (K and V caches of one shape), got {d} / {dv}"
        if d is not None and d not in _TRTLLM_HEAD_DIMS:
            return f"shape limit: head dim {d}: trtllm-gen attention cubins are for head dims {_TRTLLM_HEAD_DIMS}"
        if spec.quant == "fp8_tensor":
            S = spec.dim("S")
            decode = S is None or _decode_kernel(S, spec.activation == "causal")
            if decode and (spec.act_dtype, spec.weight_dtype) != ("bfloat16", "float8_e4m3fn"):
                return (
                    f"an FP8 KV cache in decode needs a bf16 query and e4m3 K / V (trtllm-gen's BF16-Q / FP8-KV "
                    f"cubins), got query {spec.act_dtype}, KV {spec.weight_dtype}"
                )
        return None

    def call(self, args: AttentionArgs, prepared: dict[str, torch.Tensor], launch: Launch) -> Call:
        if args.attn_mask is not None:
            raise AdapterCheckError(f"{self.name}: an explicit attn_mask is not supported (supports() rejects it)")
        B, Hq, S, Skv, D, Dv = args.B, args.Hq, args.S, args.Skv, args.D, args.Dv
        if D != Dv:
            raise AdapterCheckError(f"{self.name}: Dv ({Dv}) must equal D ({D})")
        causal = bool(args.is_causal)
        if causal and S > Skv:
            raise AdapterCheckError(f"{self.name}: {_causal_mask_reason(_spec_of(args))}")
        kv_len = S if causal else Skv  # causal: the first S keys (upper-left == bottom-right there)
        decode = _decode_kernel(S, causal)
        query, key, value = args.query, args.key[:, :, :kv_len], args.value[:, :, :kv_len]
        device = query.device
        fp8, scales = key.dtype in FP8, None
        if fp8 and not decode:  # no bf16-query / FP8-KV context cubins: dequantise as the reference does
            fp8, scales = False, (args.k_scale, args.v_scale)
        elif fp8 and not _fp8_decode_ok(query.dtype, key.dtype):
            raise AdapterCheckError(
                f"{self.name}: FP8 decode needs a bf16 query and e4m3 K / V, got {query.dtype} / {key.dtype}"
            )
        k_cache, v_cache, page, per_batch, row = _paged_kv(key, value, kv_len, scales, query.dtype)
        q = _canonical_singletons(_last_dim_unit(query.transpose(1, 2).reshape(B * S, Hq, D)))
        out = torch.empty((B * S, Hq, Dv), dtype=query.dtype, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        block_tables = torch.arange(row, **i32) + (torch.arange(B, **i32) * per_batch)[:, None]
        seq_lens = torch.full((B,), kv_len, **i32)
        scale = 1 / math.sqrt(D) if args.scale is None else float(args.scale)
        if fp8:  # per-tensor scales as float32 [1] device tensors (no host sync); None means 1
            bmm1 = args.k_scale.reshape(1) * scale if args.k_scale is not None else scale
            bmm2 = args.v_scale.reshape(1) if args.v_scale is not None else 1.0
        else:
            bmm1, bmm2 = scale, 1.0
        # (off CUDA nothing runs: the CPU tests' calls get a token workspace, not 128 MiB kept for the process)
        size = _WORKSPACE_BYTES if device.type == "cuda" else 4096
        workspace = buffer(
            ("flashinfer_trtllm.attention_workspace", size),
            device,
            lambda: torch.zeros(size, dtype=torch.uint8, device=device),
        )
        counter = _counter_bytes(device, B, Hq)
        counter = max(4096, 1 << (counter - 1).bit_length())  # a few sizes, each made once per device
        counters = buffer(
            ("flashinfer_trtllm.multi_ctas_kv_counter", counter),
            device,
            lambda: torch.zeros(counter, dtype=torch.uint8, device=device),
        )
        common = dict(
            bmm1_scale=bmm1,
            bmm2_scale=bmm2,
            out=out,
            kv_layout="HND",
            enable_pdl=bool(launch.pdl),
            multi_ctas_kv_counter_buffer=counters,
            backend="trtllm-gen",
        )
        head = (q, (k_cache, v_cache), workspace, block_tables, seq_lens)
        if decode:
            call = Call(_TRTLLM_DECODE, head, dict(max_seq_len=kv_len, q_len_per_req=S, **common))
        else:
            cum_q = torch.arange(0, (B + 1) * S, S, **i32)
            cum_kv = torch.arange(0, (B + 1) * kv_len, kv_len, **i32)
            kwargs = dict(
                max_q_len=S, max_kv_len=kv_len, batch_size=B, cum_seq_lens_q=cum_q, cum_seq_lens_kv=cum_kv, **common
            )
            call = Call(_TRTLLM_CONTEXT, head, dict(causal=causal, **kwargs))

        def finish(result: torch.Tensor) -> torch.Tensor:
            # [B*S, Hq, Dv] contiguous, token b*S + s: the op's [B, S, Hq, Dv] layout, a view
            return result.view(B, S, Hq, Dv).transpose(1, 2)

        call.finish = finish
        return call

    def check(self, call: Call) -> None:
        from flashinfer.utils import _check_block_tables_shape, check_shape_dtype_device

        b = call.bound().arguments
        decode = call.function == _TRTLLM_DECODE
        q, kv, out = b["query"], b["kv_cache"], b["out"]
        require(b["backend"] == "trtllm-gen", self, "backend must be 'trtllm-gen'")
        require(b["kv_layout"] == "HND", self, "the caches are built as HND [pages, heads, page_size, dim]")
        require(q.dim() == 3, self, f"the query must be [tokens, heads, dim], got {tuple(q.shape)}")
        require(q.dtype in _HALF, self, f"the query must be bf16 / fp16, got {q.dtype}")
        require(isinstance(kv, tuple) and len(kv) == 2, self, "kv_cache must be a (key, value) tuple")
        k, v = kv
        require(k.dim() == 4 and k.shape == v.shape, self, f"K / V caches {tuple(k.shape)} / {tuple(v.shape)}")
        require(k.stride() == v.stride(), self, "the kernel reads K's strides for V too (launcher: kv_stride_*)")
        require(k.dtype == v.dtype, self, f"K / V dtypes differ: {k.dtype}, {v.dtype}")
        if decode:
            ok = k.dtype == q.dtype or _fp8_decode_ok(q.dtype, k.dtype)
        else:
            ok = k.dtype == q.dtype
        require(ok, self, f"K / V dtype {k.dtype} with a {q.dtype} query has no {call.function} kernel")
        num_pages, Hkv, page, D = k.shape
        T, Hq, Dq = q.shape
        require(Dq == D, self, f"query head dim {Dq} != key head dim {D}")
        require(Hkv > 0 and Hq % Hkv == 0, self, "query heads must be a multiple of KV heads")
        require(page in _PAGE_SIZES, self, f"page size {page} is not one of {_PAGE_SIZES}")
        for name, t in (("query", q), ("key cache", k), ("value cache", v)):
            require(t.stride(-1) == 1, self, f"{name}'s head dim must have stride 1 (TMA), got {t.stride()}")
            strides = [s * t.element_size() for s in t.stride()[:-1]]
            require(all(s % 16 == 0 for s in strides), self, f"{name}'s strides {t.stride()} are not 16-byte multiples")
            require((t.storage_offset() * t.element_size()) % 16 == 0, self, f"{name} is not 16-byte aligned")
        try:
            check_shape_dtype_device(out, q.shape, q.dtype, q.device, "out")
            _check_block_tables_shape(b["block_tables"], b["uses_shared_paged_kv_idx"])
        except ValueError as exc:
            raise AdapterCheckError(f"{self.name}: {exc}") from None
        require(out.is_contiguous(), self, "out must be contiguous [tokens, heads, dim] (the kernel's O layout)")
        batch = T // b["q_len_per_req"] if decode else b["batch_size"]
        if decode:
            require(batch * b["q_len_per_req"] == T, self, "query tokens must be batch * q_len_per_req")
            require(b["max_q_len"] is None and b["cum_seq_lens_q"] is None, self, "uniform queries per request")
            require(b["mask"] is None and not b["enable_block_sparse_attention"], self, "no mask, no block sparsity")
            require(b["causal_seqlens_kv_global"] is None, self, "no decode context parallelism")
            require(b["bf16q_fp8kv_transform_mode"] is None, self, "FlashInfer's default FP8-KV transform")
        else:
            require(b["max_q_len"] * batch == T, self, "query tokens must be batch_size * max_q_len")
            for name in ("cum_seq_lens_q", "cum_seq_lens_kv"):
                t = b[name]
                require(t.dtype == torch.int32 and tuple(t.shape) == (batch + 1,), self, f"{name} int32 [B + 1]")
            require(isinstance(b["causal"], bool), self, "causal must be a bool")
        bt, seq_lens = b["block_tables"], b["seq_lens"]
        require(bt.dtype == torch.int32 and bt.shape[0] == batch, self, f"block_tables int32 [{batch}, pages]")
        require(seq_lens.dtype == torch.int32 and tuple(seq_lens.shape) == (batch,), self, f"seq_lens int32 [{batch}]")
        max_kv = b["max_seq_len"] if decode else b["max_kv_len"]
        require(0 < max_kv <= bt.shape[1] * page, self, f"max kv length {max_kv} exceeds the block table's pages")
        require(b["window_left"] == -1 and b["sinks"] is None, self, "no sliding window, no sinks")
        require(b["kv_cache_sf"] is None and not b["return_lse"], self, "no NVFP4 scale factors, no LSE")
        require(b["uses_shared_paged_kv_idx"], self, "one page table for K and V")
        for name in ("bmm1_scale", "bmm2_scale"):
            s = b[name]
            if isinstance(s, torch.Tensor):
                require(s.dtype == torch.float32 and s.numel() == 1, self, f"{name} must be one float32 element")
                require(s.device == q.device, self, f"{name} must be on the query's device")
            else:
                require(isinstance(s, float), self, f"{name} must be a float or a float32 tensor")
        ws, counters = b["workspace_buffer"], b["multi_ctas_kv_counter_buffer"]
        require(ws.dtype == torch.uint8 and ws.is_contiguous() and ws.numel() > 0, self, "workspace: uint8")
        require(
            counters.is_contiguous()
            and counters.numel() * counters.element_size() >= _counter_bytes(q.device, batch, Hq),
            self,
            "multi_ctas_kv_counter_buffer is smaller than get_trtllm_gen_multi_ctas_kv_counter_bytes",
        )
