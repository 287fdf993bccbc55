"""Adapters from rubin.moe to FlashInfer 0.7.2's fused MoE entry points (tables.MOE).

rubin.moe's arguments (ops/moe.py): ``hidden_states`` [T, H]; ``w13`` [E, 2I, H] with the **gate rows first**,
``[0, I)``, then the up rows ``[I, 2I)`` (vLLM's layout); ``w2`` [E, H, I]; precomputed routing ``topk_ids`` /
``topk_weights`` [T, k]. FlashInfer's canonical GEMM1 order is the reverse, ``[up, gate]``
(fused_moe/api.py:MoEWeightPack: "w1 is [E, 2I, H] ... with rows in [up, gate] order"; TensorRT-LLM's
``w3_w1``), so every adapter whose preparation starts from FlashInfer's canonical order swaps the halves first
(``_up_gate``); the SM90 CuTe-DSL kernel has its own helper that takes rubin's order as it is
(``interleave_up_gate_sm90``: "gate-first concatenated weights ([gate; up])").

Only entry points that take precomputed routing are called (``*_routed_moe`` with ``(topk_ids, topk_weights)``,
``token_selected_experts`` / ``token_final_scales``); ids go as int32, weights as float32. rubin's ``"silu"`` is
FlashInfer's ``ActivationType.Swiglu`` (``silu(gate) * up``); the tables' rule admits silu only.

Quantised weights (ops/moe.py; the lead's canonical FP4 formats): FP8 e4m3 with per-tensor / per-expert or
128x128 block scales (dequantised = fp8 * scale); FP4 packed two e2m1 per byte (uint8) along the reduction dim
with LINEAR block scales (NVFP4: e4m3 per 16 and a float32 ``*_scale_2`` per expert; MXFP4: E8M0 per 32) and
optional static activation scales ``a13_scale`` / ``a2_scale`` (ModelOpt ``input_scale``: dequantised =
quantised * scale). FlashInfer's global scales are the reciprocals (quantisation multipliers), so e.g. the
FC1 dequantisation ``1 / (a1_gs * w1_gs)`` of its tests is ``a13_scale * w13_scale_2`` here.

Kernels that quantise activations do it in ``call`` with FlashInfer's own quantisers (``fp4_quantize``,
``TrtllmFp8BlockConfig.prepare_activations``, ``TrtllmFp8PerTensorConfig.prepare_activations``), all device
ops with no host synchronisation, so capturable. Where the intermediate (FC2's input) is quantised inside the
kernel with a static scale, the adapter needs ``a2_scale`` (and ``a13_scale``) and ``supports`` says so.

On meta tensors (the CPU checks) ``fp4_quantize`` cannot run ("device must be a cuda device"); ``_nvfp4_act``
then makes meta tensors of the shapes and dtypes it returns for the linear layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from rubin_compile.kernels.flashinfer.adapter import Adapter, Call, register, require
from rubin_compile.ops.moe import MoEArgs, activation_info
from rubin_compile.ops.registry import KernelSpec, Launch
from rubin_compile.target import Target

FP8 = torch.float8_e4m3fn
SWIGLU = 3  # flashinfer/tllm_enums.py:ActivationType.Swiglu (silu(gate) * up)
RENORMALIZE = 1  # tllm_enums.py:RoutingMethodType.Renormalize; with precomputed routing only its checks apply
MAJOR_K, BLOCK_MAJOR_K = 0, 2  # tllm_enums.py:WeightLayout
DEEPSEEK_FP8 = 1  # tllm_enums.py:Fp8QuantizationType.DeepSeekFp8
SF_LAYOUT_LINEAR = 2  # tllm_enums.py:SfLayout.layout_linear
EPILOGUE_TILE_M = 128  # "TRTLLM kernel-internal constant" (fused_moe/prepare.py:prepare_trtllm_fp4_weights)


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def _up_gate(w: torch.Tensor, inter: int) -> torch.Tensor:
    """rubin's ``[gate; up]`` rows (dim 1) -> FlashInfer's canonical ``[up; gate]`` (a copy)."""
    return torch.cat((w[:, inter:], w[:, :inter]), dim=1).contiguous()


def _per_expert(scale: torch.Tensor, E: int) -> torch.Tensor:
    """A per-tensor ([] / [1]) or per-expert ([E], [E, 1], [E, 1, 1]) scale as float32 [E]."""
    s = scale.to(torch.float32).reshape(-1)
    return (s.expand(E) if s.numel() == 1 else s.reshape(E)).contiguous()


def _scalar(scale: torch.Tensor) -> torch.Tensor:
    """A per-tensor scale as a 0-dim float32 tensor."""
    return scale.to(torch.float32).reshape(())


def _swizzle_128x4(sf: torch.Tensor) -> torch.Tensor:
    """Linear block scales [..., M, K] (one byte each) -> the 128x4-swizzled layout that FlashInfer's
    ``block_scale_interleave`` (quantization/fp4_quantization.py, a CUDA kernel) and
    ``fp4_quantize(is_sf_swizzled_layout=True)`` write: padded to [..., round_up(M, 128), round_up(K, 4)],
    element (m, k) at tile (m // 128, k // 4), then (m % 32, (m % 128) // 32, k % 4). Built with torch ops so
    that it runs on meta tensors too (the inverse of trace/templates/gemm.py:_unswizzle_batched_sf_128x4);
    tests/gpu/test_flashinfer_moe.py compares it with ``block_scale_interleave``."""
    *lead, M, K = sf.shape
    pm, pk = -(-M // 128) * 128, -(-K // 4) * 4
    if (pm, pk) != (M, K):
        sf = torch.nn.functional.pad(sf.view(torch.uint8), (0, pk - K, 0, pm - M)).view(sf.dtype)
    v = sf.reshape(*lead, pm // 128, 4, 32, pk // 4, 4)
    n = len(lead)
    v = v.permute(*range(n), n, n + 3, n + 2, n + 1, n + 4)  # [mt, kt, m % 32, (m % 128) // 32, k % 4]
    return v.contiguous().reshape(*lead, pm, pk)


def _nvfp4_act(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, H] -> NVFP4 (uint8 [T, H/2], linear e4m3 scales [T, H/16]) with FlashInfer's ``fp4_quantize``
    (the quantisation of fused_moe/prepare.py:prepare_trtllm_fp4_activations, with our global scale)."""
    T, H = x.shape
    if x.is_meta:
        return (
            torch.empty(T, H // 2, dtype=torch.uint8, device="meta"),
            torch.empty(T, H // 16, dtype=FP8, device="meta"),
        )
    from flashinfer import fp4_quantize

    if x.dtype not in (torch.bfloat16, torch.float16):
        x = x.to(torch.bfloat16)
    q, sf = fp4_quantize(x, global_scale, sf_vec_size=16, sf_use_ue8m0=False, is_sf_swizzled_layout=False)
    return q.view(torch.uint8), sf.view(FP8).reshape(T, -1)


def _routing(args: MoEArgs) -> tuple[torch.Tensor, torch.Tensor]:
    return args.topk_ids.to(torch.int32).contiguous(), args.topk_weights.to(torch.float32).contiguous()


def _first(out: Any) -> torch.Tensor:
    """The output tensor of an entry point that returns it alone or as the first of a list."""
    return out[0] if isinstance(out, (list, tuple)) else out


def _finish(args: MoEArgs):
    dtype = args.hidden_states.dtype
    return lambda out: _first(out).to(dtype)


def _meta_args(args: MoEArgs) -> MoEArgs:
    """``args`` with every tensor replaced by a meta tensor of its shape and dtype (for ``prepared_bytes``)."""
    changes = {
        f.name: torch.empty_like(getattr(args, f.name), device="meta")
        for f in dataclasses.fields(args)
        if f.init and isinstance(getattr(args, f.name), torch.Tensor)
    }
    return dataclasses.replace(args, **changes)


def _arg(call: Call, name: str) -> Any:
    return call.bound().arguments[name]


def _need(adapter: Adapter, call: Call, name: str, dtype, shape=None, value=None) -> torch.Tensor:
    """``call``'s argument ``name`` must be a tensor of ``dtype`` (a dtype or a tuple) and ``shape``."""
    t = _arg(call, name) if value is None else value
    require(isinstance(t, torch.Tensor), adapter, f"{name} must be a tensor, got {type(t).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    require(t.dtype in dtypes, adapter, f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if shape is not None:
        require(tuple(t.shape) == tuple(shape), adapter, f"{name} must be {tuple(shape)}, got {tuple(t.shape)}")
    return t


def _fp8_per_tensor_activation(hidden_states: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The hidden states in e4m3 with the static FC1 input scale (its reciprocal), as FlashInfer's per-tensor FP8 MoE
    preparation quantises them (``TrtllmFp8PerTensorConfig.prepare_activations``); on meta tensors, the shape."""
    x = hidden_states.to(torch.bfloat16)
    if x.is_meta:
        return torch.empty(x.shape, dtype=FP8, device="meta")
    from flashinfer.fused_moe.api import TrtllmFp8PerTensorConfig

    xq, _ = TrtllmFp8PerTensorConfig.prepare_activations(x, hidden_states_scale_global=scale_inv)
    return xq


class _MoEAdapter(Adapter):
    """What every adapter here shares: the weights' sources, the prepared bytes (prepare on meta tensors),
    the limits that no FlashInfer MoE entry point we call has (biases, packed CPU layouts, the op's optional
    features), and the checks of the routing tensors."""

    static_scales = False  # needs a13_scale and a2_scale (the intermediate is quantised inside the kernel)
    takes_biases = False  # the entry point adds expert biases

    def supports(self, target: Target, spec: KernelSpec) -> Optional[str]:
        if spec.weight_layout != "plain":
            return f"{self.name} reads plain weights only, not {spec.weight_layout}"
        if spec.has_bias and not self.takes_biases:
            return f"{self.name} takes no expert biases (w13_bias / w2_bias)"
        if spec.features:
            return f"{self.name} does not implement {', '.join(spec.features)}"
        if self.static_scales and not spec.static_input_scales:
            return (
                f"{self.name} quantises FC2's input inside the kernel with a static scale: it needs the "
                "checkpoint's activation scales a13_scale and a2_scale (ModelOpt input_scale), which this node lacks"
            )
        return None

    def sources(self, args: MoEArgs):
        names = ("w13", "w2", "w13_scale", "w2_scale", "w13_scale_2", "w2_scale_2", "a13_scale", "a2_scale")
        return tuple(t for t in (getattr(args, n, None) for n in names) if t is not None)

    def prepared_bytes(self, args: MoEArgs) -> int:
        prepared = self.prepare(_meta_args(args))
        return sum(t.numel() * t.element_size() for t in prepared.values())

    def _plain(self, args: MoEArgs) -> None:
        """What the call itself must not carry (the spec cannot tell selection about biases)."""
        require(args.w13_bias is None and args.w2_bias is None, self, "expert biases are not passed to this kernel")
        require(not args.weight_layout.cpu_packed, self, "weights must be in the plain layout")
        require(not args.apply_router_weight_on_input, self, "apply_router_weight_on_input is not implemented")
        require(args.activation == "silu", self, f"activation {args.activation!r} is not mapped (silu only)")

    def _scale_2(self, args: MoEArgs) -> tuple[torch.Tensor, torch.Tensor]:
        s13, s2 = getattr(args, "w13_scale_2", None), getattr(args, "w2_scale_2", None)
        require(s13 is not None and s2 is not None, self, "NVFP4 weights need w13_scale_2 and w2_scale_2")
        return _per_expert(s13, args.E), _per_expert(s2, args.E)

    def _act_scales(self, args: MoEArgs) -> tuple[torch.Tensor, torch.Tensor]:
        a13, a2 = getattr(args, "a13_scale", None), getattr(args, "a2_scale", None)
        require(
            a13 is not None and a2 is not None,
            self,
            "static activation scales a13_scale and a2_scale are needed (FC2's input is quantised in the kernel)",
        )
        return _scalar(a13), _scalar(a2)

    def _check_routing(self, call: Call, ids_name: str, weights_name: str, T: int, k: int) -> None:
        bound = call.bound().arguments
        ids, weights = bound[ids_name], bound[weights_name]
        if isinstance(ids, tuple):  # trtllm-gen's (topk_ids, topk_weights) pair
            ids, weights = ids
        _need(self, call, ids_name, torch.int32, (T, k), value=ids)
        _need(self, call, weights_name, (torch.float32, torch.bfloat16), (T, k), value=weights)


# ------------------------------------------------------------------------------------------------
# trtllm-gen (sm_100 / sm_103 / sm_107): flashinfer/fused_moe/core.py:trtllm_*_routed_moe
# ------------------------------------------------------------------------------------------------


def _trtllm_common(args: MoEArgs, launch: Launch) -> dict[str, Any]:
    return dict(
        num_experts=args.E,
        top_k=args.k,
        n_group=None,
        topk_group=None,
        intermediate_size=args.I,
        local_expert_offset=0,
        local_num_experts=args.E,
        routed_scaling_factor=None,
        routing_method_type=RENORMALIZE,
        do_finalize=True,
        enable_pdl=launch.pdl,
        activation_type=SWIGLU,
    )


class _TrtllmAdapter(_MoEAdapter):
    def _check_trtllm(self, call: Call) -> None:
        b = call.bound().arguments
        E, k, inter = b["num_experts"], b["top_k"], b["intermediate_size"]
        # trtllm_fused_moe_kernel_launcher.cu (check_routing / check_moe)
        require(inter % 128 == 0, self, f"intermediate_size must be a multiple of 128, got {inter}")
        require(E % 4 == 0, self, f"num_experts must be divisible by 4, got {E}")
        require(E > k, self, f"num_experts ({E}) must be greater than top_k ({k})")
        require(0 < k <= 32, self, f"the routing kernel (no groups) supports top_k <= 32, got {k}")
        require(b["do_finalize"] is True, self, "do_finalize must be True (the output, not the unreduced GEMM2)")
        require(b["activation_type"] == SWIGLU, self, "activation_type must be Swiglu")


@register("moe", "flashinfer_trtllm", "none")
class TrtllmBf16(_TrtllmAdapter):
    """``trtllm_bf16_routed_moe``: BF16 weights in the BlockMajorK layout, made by FlashInfer's own
    ``prepare_trtllm_bf16_weights`` (gated-activation row reorder + ``shuffle_matrix_a`` row permutation with
    epilogue tile 128 for GEMM1, the shuffle for GEMM2, then 128-byte K blocks) from ``[up; gate]`` rows."""

    name = "flashinfer_trtllm_bf16_routed"
    function = "flashinfer.fused_moe.trtllm_bf16_routed_moe"

    def prepare(self, args: MoEArgs) -> dict[str, torch.Tensor]:
        from flashinfer.fused_moe.prepare import prepare_trtllm_bf16_weights

        view = prepare_trtllm_bf16_weights(
            _up_gate(args.w13, args.I),
            args.w2.contiguous(),
            num_local_experts=args.E,
            hidden_size=args.H,
            intermediate_size=args.I,
        )
        return {"gemm1_weights": view["gemm1_weights"], "gemm2_weights": view["gemm2_weights"]}

    def call(self, args: MoEArgs, prepared: dict[str, torch.Tensor], launch: Launch) -> Call:
        self._plain(args)
        return Call(
            self.function,
            (_routing(args), args.hidden_states, prepared["gemm1_weights"], prepared["gemm2_weights"]),
            dict(_trtllm_common(args, launch), use_shuffled_weight=True, weight_layout=BLOCK_MAJOR_K),
            _finish(args),
        )

    def check(self, call: Call) -> None:
        self._check_trtllm(call)
        b = call.bound().arguments
        x = _need(self, call, "hidden_states", torch.bfloat16)
        T, H = x.shape
        E, k, inter = b["num_experts"], b["top_k"], b["intermediate_size"]
        self._check_routing(call, "topk_ids", "topk_ids", T, k)
        # BlockMajorK of bf16: [E, K / 64, Mn, 64] (128-byte blocks; prepare_trtllm_bf16_weights)
        _need(self, call, "gemm1_weights", torch.bfloat16, (E, H // 64, 2 * inter, 64))
        _need(self, call, "gemm2_weights", torch.bfloat16, (E, inter // 64, H, 64))
        require(b["weight_layout"] == BLOCK_MAJOR_K and b["use_shuffled_weight"], self, "needs shuffled BlockMajorK")


def _trtllm_permutes(w1: torch.Tensor, w2: torch.Tensor, sf: Optional[int] = None) -> tuple[torch.Tensor, ...]:
    """The row permutations FlashInfer's trtllm-gen preparations apply to every expert of GEMM1 (gated-act
    reorder chained with ``shuffle_matrix_a`` / ``shuffle_matrix_sf_a``) and GEMM2 (the shuffle), from one
    expert's matrix (they depend on its shape only): fused_moe/core.py:_maybe_get_cached_w3_w1_permute_indices,
    get_w2_permute_indices_with_cache, as prepare.py:prepare_trtllm_fp4_weights calls them."""
    from flashinfer.fused_moe.core import _maybe_get_cached_w3_w1_permute_indices, get_w2_permute_indices_with_cache

    cache: dict = {}
    p1 = _maybe_get_cached_w3_w1_permute_indices(cache, w1, EPILOGUE_TILE_M, num_elts_per_sf=sf)
    p2 = get_w2_permute_indices_with_cache(cache, w2, EPILOGUE_TILE_M, num_elts_per_sf=sf, is_gated_act_gemm=True)
    return p1.to(w1.device), p2.to(w2.device)


@register("moe", "flashinfer_trtllm", "fp8_block")
class TrtllmFp8Block(_TrtllmAdapter):
    """``trtllm_fp8_block_scale_routed_moe`` with DeepSeek FP8 (128x128 weight blocks, 1x128 activation
    blocks) in the MajorK layout, unshuffled: what prepare.py:prepare_trtllm_fp8_block_weights makes for
    DeepSeekFp8 (no reorder, no shuffle), here from the checkpoint's FP8 weights and float32 block scales with
    GEMM1's halves (weights and scale rows) swapped to ``[up; gate]`` (I % 128 == 0, the rule's, keeps a scale
    row within one half). Activations are quantised per 1x128 group in ``call`` by
    ``TrtllmFp8BlockConfig.prepare_activations`` (scales transposed to [H/128, T], as the launcher wants);
    tolerance: FP8 activations."""

    name = "flashinfer_trtllm_fp8_block_routed"
    function = "flashinfer.fused_moe.trtllm_fp8_block_scale_routed_moe"

    def prepare(self, args: MoEArgs) -> dict[str, torch.Tensor]:
        return {
            "gemm1_weights": _up_gate(args.w13, args.I),
            "gemm1_weights_scale": _up_gate(args.w13_scale.to(torch.float32), args.I // 128),
            "gemm2_weights": args.w2.contiguous(),
            "gemm2_weights_scale": args.w2_scale.to(torch.float32).contiguous(),
        }

    def call(self, args: MoEArgs, prepared: dict[str, torch.Tensor], launch: Launch) -> Call:
        from flashinfer.fused_moe.api import QuantConfig, QuantFormat, TrtllmFp8BlockConfig

        self._plain(args)
        require(tuple(args.block_shape or ()) == (128, 128), self, "block_shape must be [128, 128]")
        quant = QuantConfig(QuantFormat.DeepSeekFp8, QuantFormat.DeepSeekFp8)
        x, x_scale = TrtllmFp8BlockConfig.prepare_activations(args.hidden_states.to(torch.bfloat16), quant=quant)
        p = prepared
        return Call(
            self.function,
            (
                _routing(args),
                None,
                x,
                x_scale,
                p["gemm1_weights"],
                p["gemm1_weights_scale"],
                p["gemm2_weights"],
                p["gemm2_weights_scale"],
            ),
            dict(
                _trtllm_common(args, launch),
                use_shuffled_weight=False,
                weight_layout=MAJOR_K,
                fp8_quantization_type=DEEPSEEK_FP8,
            ),
            _finish(args),
        )

    def check(self, call: Call) -> None:
        self._check_trtllm(call)
        b = call.bound().arguments
        x = _need(self, call, "hidden_states", FP8)
        T, H = x.shape
        E, k, inter = b["num_experts"], b["top_k"], b["intermediate_size"]
        self._check_routing(call, "topk_ids", "topk_ids", T, k)
        require(H % 128 == 0, self, f"hidden size must be a multiple of 128, got {H}")
        _need(self, call, "hidden_states_scale", torch.float32, (H // 128, T))
        _need(self, call, "gemm1_weights", FP8, (E, 2 * inter, H))
        _need(self, call, "gemm1_weights_scale", torch.float32, (E, 2 * inter // 128, H // 128))
        _need(self, call, "gemm2_weights", FP8, (E, H, inter))
        _need(self, call, "gemm2_weights_scale", torch.float32, (E, H // 128, inter // 128))
        require(int(b["fp8_quantization_type"]) == DEEPSEEK_FP8, self, "fp8_quantization_type must be DeepSeekFp8")
        require(b["weight_layout"] == MAJOR_K and not b["use_shuffled_weight"], self, "needs unshuffled MajorK")


@register("moe", "flashinfer_trtllm", "fp8_tensor")
class TrtllmFp8PerTensor(_TrtllmAdapter):
    """``trtllm_fp8_per_tensor_scale_routed_moe``: FP8 weights, shuffled as prepare.py:
    prepare_trtllm_fp8_per_tensor_weights does (gated-act reorder + shuffle, epilogue tile 128), and the three
    per-expert epilogue scales it folds, from rubin's dequantisation scales: ``output1_scales_gate_scalar =
    w13_scale * a13_scale`` (FC1's dequantisation), ``output1_scales_scalar = w13_scale * a13_scale / a2_scale``
    (dequantise, then quantise the intermediate), ``output2_scales_scalar = a2_scale * w2_scale``. Needs the
    static activation scales (W8A8); the hidden states are quantised with ``a13_scale`` in ``call``
    (``TrtllmFp8PerTensorConfig.prepare_activations``)."""

    name = "flashinfer_trtllm_fp8_per_tensor_routed"
    function = "flashinfer.fused_moe.trtllm_fp8_per_tensor_scale_routed_moe"
    static_scales = True

    def prepare(self, args: MoEArgs) -> dict[str, torch.Tensor]:
        a13, a2 = self._act_scales(args)
        w1 = _up_gate(args.w13, args.I).view(torch.uint8)
        w2 = args.w2.contiguous().view(torch.uint8)
        p1, p2 = _trtllm_permutes(w1[0], w2[0])
        s13, s2 = _per_expert(args.w13_scale, args.E), _per_expert(args.w2_scale, args.E)
        return {
            "gemm1_weights": w1[:, p1].contiguous().view(FP8),
            "gemm2_weights": w2[:, p2].contiguous().view(FP8),
            "output1_scales_scalar": (s13 * a13 / a2).contiguous(),
            "output1_scales_gate_scalar": (s13 * a13).contiguous(),
            "output2_scales_scalar": (a2 * s2).contiguous(),
            "a13_scale_inv": (1.0 / a13).contiguous(),
        }

    def call(self, args: MoEArgs, prepared: dict[str, torch.Tensor], launch: Launch) -> Call:
        self._plain(args)
        p = prepared
        xq = _fp8_per_tensor_activation(args.hidden_states, p["a13_scale_inv"])
        return Call(
            self.function,
            (
                _routing(args),
                None,
                xq,
                p["gemm1_weights"],
                p["output1_scales_scalar"],
                p["output1_scales_gate_scalar"],
                p["gemm2_weights"],
                p["output2_scales_scalar"],
            ),
            dict(_trtllm_common(args, launch), use_routing_scales_on_input=False),
            _finish(args),
        )

    def check(self, call: Call) -> None:
        self._check_trtllm(call)
        b = call.bound().arguments
        x = _need(self, call, "hidden_states", FP8)
        T, H = x.shape
        E, k, inter = b["num_experts"], b["top_k"], b["intermediate_size"]
        self._check_routing(call, "topk_ids", "topk_ids", T, k)
        _need(self, call, "gemm1_weights", FP8, (E, 2 * inter, H))
        _need(self, call, "gemm2_weights", FP8, (E, H, inter))
        for name in ("output1_scales_scalar", "output1_scales_gate_scalar", "output2_scales_scalar"):
            _need(self, call, name, torch.float32, (E,))


@register("moe", "flashinfer_trtllm", "nvfp4")
class TrtllmNvfp4(_TrtllmAdapter):
    """``trtllm_fp4_block_scale_routed_moe`` with NVFP4 weights and NVFP4 activations (E2m1 weights take E2m1
    activations only: core.py:is_trtllm_moe_supported). Prepared as prepare.py:prepare_trtllm_fp4_weights does
    after its quantisation: GEMM1 rows swapped to ``[up; gate]``, then per expert the gated-act reorder +
    ``shuffle_matrix_a`` rows (epilogue tile 128) on the packed weights and the same with ``num_elts_per_sf=16``
    on the e4m3 scales, which are then 128x4-swizzled (``block_scale_interleave``; ``_swizzle_128x4`` here, see
    there); GEMM2 the shuffle only. Epilogue scalars per expert, from the dequantisation scales:
    ``output1_scale_gate_scalar = a13_scale * w13_scale_2``, ``output1_scale_scalar = that / a2_scale``,
    ``output2_scale_scalar = a2_scale * w2_scale_2``; ``gemm1_alpha`` (SwiGLU's alpha) ones, as the
    preparation passes for gated NVFP4. Hidden states quantised in ``call`` with ``fp4_quantize`` and the global
    scale ``1 / a13_scale``, linear scales. Needs static a13_scale / a2_scale. Tolerance: NVFP4 activations."""

    name = "flashinfer_trtllm_fp4_routed_nvfp4"
    function = "flashinfer.fused_moe.trtllm_fp4_block_scale_routed_moe"
    static_scales = True

    def prepare(self, args: MoEArgs) -> dict[str, torch.Tensor]:
        E, H, inter = args.E, args.H, args.I
        s13_2, s2_2 = self._scale_2(args)
        a13, a2 = self._act_scales(args)
        w1 = _up_gate(args.w13, inter)
        sf1 = _up_gate(args.w13_scale, inter).view(torch.uint8)
        w2, sf2 = args.w2.contiguous(), args.w2_scale.contiguous().view(torch.uint8)
        p1, p2 = _trtllm_permutes(w1[0], w2[0])
        q1, q2 = _trtllm_permutes(sf1[0], sf2[0], sf=16)
        gate = (a13 * s13_2).contiguous()
        return {
            "gemm1_weights": w1[:, p1].contiguous(),
            "gemm1_weights_scale": _swizzle_128x4(sf1[:, q1]).view(FP8).reshape(E, 2 * inter, H // 16),
            "gemm2_weights": w2[:, p2].contiguous(),
            "gemm2_weights_scale": _swizzle_128x4(sf2[:, q2]).view(FP8).reshape(E, H, inter // 16),
            "gemm1_alpha": torch.ones(E, dtype=torch.float32, device=args.w13.device),
            "output1_scale_scalar": (gate / a2).contiguous(),
            "output1_scale_gate_scalar": gate,
            "output2_scale_scalar": (a2 * s2_2).contiguous(),
            "a13_scale_inv": (1.0 / a13).reshape(1).contiguous(),
        }

    def call(self, args: MoEArgs, prepared: dict[str, torch.Tensor], launch: Launch) -> Call:
        self._plain(args)
        p = prepared
        x, x_sf = _nvfp4_act(args.hidden_states, p["a13_scale_inv"])
        return Call(
            self.function,
            (
                _routing(args),
                None,
                x,
                x_sf,
                p["gemm1_weights"],
                p["gemm1_weights_scale"],
                None,
                p["gemm1_alpha"],
                None,
                None,
                p["gemm2_weights"],
                p["gemm2_weights_scale"],
                None,
                p["output1_scale_scalar"],
                p["output1_scale_gate_scalar"],
                p["output2_scale_scalar"],
            ),
            dict(_trtllm_common(args, launch), hidden_states_scale_layout=SF_LAYOUT_LINEAR),
            _finish(args),
        )

    def check(self, call: Call) -> None:
        self._check_trtllm(call)
        b = call.bound().arguments
        x = _need(self, call, "hidden_states", torch.uint8)
        T, H = x.shape[0], 2 * x.shape[1]
        E, k, inter = b["num_experts"], b["top_k"], b["intermediate_size"]
        self._check_routing(call, "topk_ids", "topk_ids", T, k)
        _need(self, call, "hidden_states_scale", FP8, (T, H // 16))
        require(int(b["hidden_states_scale_layout"]) == SF_LAYOUT_LINEAR, self, "activation scales must be linear")
        _need(self, call, "gemm1_weights", torch.uint8, (E, 2 * inter, H // 2))
        _need(self, call, "gemm1_weights_scale", FP8, (E, 2 * inter, H // 16))
        _need(self, call, "gemm2_weights", torch.uint8, (E, H, inter // 2))
        _need(self, call, "gemm2_weights_scale", FP8, (E, H, inter // 16))
        for name in ("gemm1_alpha", "output1_scale_scalar", "output1_scale_gate_scalar", "output2_scale_scalar"):
            _need(self, call, name, torch.float32, (E,))
        # the 128x4 swizzle is unpadded only for these (fused_moe/prepare.py reshapes the same way)
        require(H % 128 == 0, self, f"hidden size must be a multiple of 128, got {H}")


# ------------------------------------------------------------------------------------------------
# CuTe-DSL: fused_moe/cute_dsl/fused_moe.py (sm_100 / 103 / 107), sm90_fused_moe.py (sm_90)
# ------------------------------------------------------------------------------------------------


@register("moe", "flashinfer_cutedsl", "nvfp4")
class CuteDslNvfp4(_MoEAdapter):
    """``cute_dsl_fused_moe(quant_mode="w4a4")``: NVFP4 weights and activations (the Rubin NVFP4 MoE).
    Prepared as prepare.py:prepare_cute_dsl_weights does after its quantisation: GEMM1 ``[up; gate]`` rows
    interleaved in groups of 64 (``_interleave_linear_and_gate``), weights and e4m3 scale rows alike; scales
    128x4-swizzled (``_swizzle_128x4``, what ``fp4_quantize(is_sf_swizzled_layout=True)`` writes) and viewed in
    the CuTe MMA layout by ``cute_dsl.utils.convert_sf_to_mma_layout``. Global scales as FlashInfer's tests
    compute them: ``w1_alpha = a13_scale * w13_scale_2``, ``fc2_input_scale = 1 / a2_scale``, ``w2_alpha =
    a2_scale * w2_scale_2``; activations quantised in ``call`` (``fp4_quantize``, global scale
    ``1 / a13_scale``, linear scales [T, H/16, 1] as CuteDslRunner.pack_inputs passes them). Needs static
    a13_scale / a2_scale. ``cute_dsl_fused_moe`` is FlashInfer's functional API; its docstring points to
    ``CuteDslMoEWrapper`` for CUDA graphs."""

    name = "flashinfer_cutedsl_nvfp4"
    function = "flashinfer.fused_moe.cute_dsl_fused_moe"
    static_scales = True

    def prepare(self, args: MoEArgs) -> dict[str, torch.Tensor]:
        from flashinfer.cute_dsl.utils import convert_sf_to_mma_layout
        from flashinfer.fused_moe.prepare import _interleave_linear_and_gate

        E, H, inter = args.E, args.H, args.I
        s13_2, s2_2 = self._scale_2(args)
        a13, a2 = self._act_scales(args)
        w1 = _interleave_linear_and_gate(_up_gate(args.w13, inter), group_size=64, dim=1)
        sf1 = _interleave_linear_and_gate(_up_gate(args.w13_scale.view(torch.uint8), inter), group_size=64, dim=1)
        sf2 = args.w2_scale.contiguous().view(torch.uint8)
        mma1 = convert_sf_to_mma_layout(_swizzle_128x4(sf1).view(FP8), m=2 * inter, k=H, num_groups=E)
        mma2 = convert_sf_to_mma_layout(_swizzle_128x4(sf2).view(FP8), m=H, k=inter, num_groups=E)
        return {
            "w1_weight": w1,
            "w1_weight_sf": mma1,
            "w1_alpha": (a13 * s13_2).contiguous(),
            "fc2_input_scale": (1.0 / a2).reshape(1).contiguous(),
            "w2_weight": args.w2.contiguous(),
            "w2_weight_sf": mma2,
            "w2_alpha": (a2 * s2_2).contiguous(),
            "a13_scale_inv": (1.0 / a13).reshape(1).contiguous(),
        }

    def call(self, args: MoEArgs, prepared: dict[str, torch.Tensor], launch: Launch) -> Call:
        self._plain(args)
        p = prepared
        x, x_sf = _nvfp4_act(args.hidden_states, p["a13_scale_inv"])
        ids, weights = _routing(args)
        return Call(
            self.function,
            (
                x,
                x_sf.unsqueeze(-1),
                ids,
                weights,
                p["w1_weight"],
                p["w1_weight_sf"],
                p["w1_alpha"],
                p["fc2_input_scale"],
                p["w2_weight"],
                p["w2_weight_sf"],
                p["w2_alpha"],
                args.E,
                args.k,
            ),
            dict(output_dtype=torch.bfloat16, enable_pdl=launch.pdl, activation_type=SWIGLU, quant_mode="w4a4"),
            _finish(args),
        )

    def check(self, call: Call) -> None:
        b = call.bound().arguments
        x = _need(self, call, "x", torch.uint8)
        T, H = x.shape[0], 2 * x.shape[1]
        E, k = b["num_experts"], b["top_k"]
        self._check_routing(call, "token_selected_experts", "token_final_scales", T, k)
        _need(self, call, "x_sf", FP8, (T, H // 16, 1))
        w1 = _need(self, call, "w1_weight", torch.uint8)
        require(tuple(w1.shape[::2]) == (E, H // 2), self, f"w1_weight must be [E={E}, 2I, H/2], got {tuple(w1.shape)}")
        two_i = w1.shape[1]
        _need(self, call, "w2_weight", torch.uint8, (E, H, two_i // 4))
        # the 6-D MMA view: (32, 4, m_tiles, 4, k_tiles, E) (cute_dsl/utils.py:convert_sf_to_mma_layout)
        _need(self, call, "w1_weight_sf", FP8, (32, 4, two_i // 128, 4, -(-H // 64), E))
        _need(self, call, "w2_weight_sf", FP8, (32, 4, H // 128, 4, -(-two_i // 128), E))
        for name in ("w1_alpha", "w2_alpha"):
            _need(self, call, name, torch.float32, (E,))
        _need(self, call, "fc2_input_scale", torch.float32, (1,))
        require(b["quant_mode"] == "w4a4", self, "quant_mode must be w4a4")


@register("moe", "flashinfer_cutedsl", "none")
class CuteDslBf16Sm90(_MoEAdapter):
    """``cute_dsl_fused_moe_bf16`` (sm_90): BF16 / FP16 weights with GEMM1's up / gate rows interleaved every 32
    rows by FlashInfer's ``interleave_up_gate_sm90``, which takes rubin's ``[gate; up]`` order as it is. Routing
    weights float32 ("normalized by the caller": rubin's are used as given); output in x's dtype."""

    name = "flashinfer_cutedsl_bf16_sm90"
    function = "flashinfer.fused_moe.cute_dsl_fused_moe_bf16"

    def prepare(self, args: MoEArgs) -> dict[str, torch.Tensor]:
        from flashinfer.fused_moe.cute_dsl.sm90_contiguous_gather_grouped_gemm_act_fusion import (
            interleave_up_gate_sm90,
        )

        return {"w1_weight": interleave_up_gate_sm90(args.w13), "w2_weight": args.w2.contiguous()}

    def call(self, args: MoEArgs, prepared: dict[str, torch.Tensor], launch: Launch) -> Call:
        self._plain(args)
        ids, weights = _routing(args)
        return Call(
            self.function,
            (args.hidden_states, ids, weights, prepared["w1_weight"], prepared["w2_weight"], args.E, args.k),
            dict(enable_pdl=launch.pdl, activation_type=SWIGLU),
            _finish(args),
        )

    def check(self, call: Call) -> None:
        b = call.bound().arguments
        x = _need(self, call, "x", (torch.bfloat16, torch.float16))
        T, H = x.shape
        E, k = b["num_experts"], b["top_k"]
        self._check_routing(call, "token_selected_experts", "token_final_scales", T, k)
        _need(self, call, "token_final_scales", torch.float32, (T, k))
        w1 = _need(self, call, "w1_weight", x.dtype)
        require(w1.dim() == 3 and tuple(w1.shape[::2]) == (E, H), self, f"w1_weight must be [E, 2I, H={H}]")
        inter = w1.shape[1] // 2
        _need(self, call, "w2_weight", x.dtype, (E, H, inter))
        require(inter % 32 == 0 and H % 8 == 0, self, f"needs I % 32 == 0 and H % 8 == 0, got I={inter}, H={H}")


# ------------------------------------------------------------------------------------------------
# CUTLASS: fused_moe/core.py:cutlass_fused_moe (quant_scales as prepare.py's CUTLASS preparations fold them)
# ------------------------------------------------------------------------------------------------


class _CutlassAdapter(_MoEAdapter):
    function = "flashinfer.fused_moe.cutlass_fused_moe"

    def _kwargs(self, args: MoEArgs, launch: Launch, output_dtype: torch.dtype, **extra) -> dict[str, Any]:
        return dict(output_dtype=output_dtype, enable_pdl=launch.pdl, activation_type=SWIGLU, **extra)

    def _check_common(self, call: Call, x_cols_per_h: int = 1) -> tuple[int, int, int, int]:
        b = call.bound().arguments
        x = b["input"]
        T = x.shape[0]
        ids = _need(self, call, "token_selected_experts", torch.int32)
        k = ids.shape[1]
        self._check_routing(call, "token_selected_experts", "token_final_scales", T, k)
        _need(self, call, "token_final_scales", torch.float32, (T, k))
        w2 = b["fc2_expert_weights"]
        E, H = w2.shape[0], w2.shape[1]
        require(x.shape[1] * x_cols_per_h == H, self, f"input [T, {x.shape[1]}] does not match hidden size {H}")
        require(int(b["activation_type"]) == SWIGLU, self, "activation_type must be Swiglu")
        require(b["min_latency_mode"] is False, self, "min_latency_mode is not implemented")
        return T, H, E, k


@register("moe", "flashinfer_cutlass", "none")
class CutlassBf16(_CutlassAdapter):
    """``cutlass_fused_moe`` with BF16 / FP16 weights, GEMM1 as ``[up; gate]`` (prepare.py:
    prepare_cutlass_bf16_weights: "CUTLASS BF16 kernels consume these weights directly")."""

    name = "flashinfer_cutlass_bf16"

    def prepare(self, args: MoEArgs) -> dict[str, torch.Tensor]:
        return {"fc1": _up_gate(args.w13, args.I), "fc2": args.w2.contiguous()}

    def call(self, args: MoEArgs, prepared: dict[str, torch.Tensor], launch: Launch) -> Call:
        self._plain(args)
        ids, weights = _routing(args)
        x = args.hidden_states
        return Call(
            self.function,
            (x, ids, weights, prepared["fc1"], prepared["fc2"]),
            self._kwargs(args, launch, x.dtype, quant_scales=[]),
            _finish(args),
        )

    def check(self, call: Call) -> None:
        T, H, E, k = self._check_common(call)
        x = _need(self, call, "input", (torch.bfloat16, torch.float16))
        fc2 = _need(self, call, "fc2_expert_weights", x.dtype)
        inter = fc2.shape[2]
        _need(self, call, "fc1_expert_weights", x.dtype, (E, 2 * inter, H))
        require(_arg(call, "output_dtype") == x.dtype, self, "output_dtype must be the input's")


@register("moe", "flashinfer_cutlass", "fp8_tensor")
class CutlassFp8PerTensor(_CutlassAdapter):
    """``cutlass_fused_moe`` W8A8 FP8 with per-tensor / per-expert scales: ``quant_scales`` =
    [fc1 dequant [E] = w13_scale * a13_scale, fc2 activation quant [] = 1 / a2_scale, fc2 dequant [E] =
    w2_scale * a2_scale, fc1 input dequant [] = a13_scale] (the folding of prepare.py:
    prepare_cutlass_fp8_per_tensor_weights), input quantised with ``a13_scale`` in ``call``
    ("For FP8, the input must be quantized"). Needs static activation scales."""

    name = "flashinfer_cutlass_fp8_per_tensor"
    static_scales = True

    def prepare(self, args: MoEArgs) -> dict[str, torch.Tensor]:
        a13, a2 = self._act_scales(args)
        s13, s2 = _per_expert(args.w13_scale, args.E), _per_expert(args.w2_scale, args.E)
        return {
            "fc1": _up_gate(args.w13, args.I),
            "fc2": args.w2.contiguous(),
            "fc1_dequant": (s13 * a13).contiguous(),
            "fc2_act_quant": (1.0 / a2).contiguous(),
            "fc2_dequant": (s2 * a2).contiguous(),
            "fc1_act_dequant": a13.clone(),
            "a13_scale_inv": (1.0 / a13).contiguous(),
        }

    def call(self, args: MoEArgs, prepared: dict[str, torch.Tensor], launch: Launch) -> Call:
        self._plain(args)
        p = prepared
        xq = _fp8_per_tensor_activation(args.hidden_states, p["a13_scale_inv"])
        ids, weights = _routing(args)
        scales = [p["fc1_dequant"], p["fc2_act_quant"], p["fc2_dequant"], p["fc1_act_dequant"]]
        return Call(
            self.function,
            (xq, ids, weights, p["fc1"], p["fc2"]),
            self._kwargs(args, launch, torch.bfloat16, quant_scales=scales),
            _finish(args),
        )

    def check(self, call: Call) -> None:
        T, H, E, k = self._check_common(call)
        _need(self, call, "input", FP8)
        inter = _need(self, call, "fc2_expert_weights", FP8).shape[2]
        _need(self, call, "fc1_expert_weights", FP8, (E, 2 * inter, H))
        scales = _arg(call, "quant_scales")
        require(len(scales) == 4, self, f"FP8 quant_scales has 4 tensors, got {len(scales)}")
        for t, shape in zip(scales, ((E,), (), (E,), ())):
            _need(self, call, "quant_scales", torch.float32, shape, value=t)


@register("moe", "flashinfer_cutlass", "fp8_block")
class CutlassFp8Block(_CutlassAdapter):
    """``cutlass_fused_moe(use_deepseek_fp8_block_scale=True)`` (sm_90 only): FP8 weights, GEMM1 ``[up; gate]``,
    float32 128x128 block scales as ``quant_scales`` [fc1, fc2] (prepare.py:prepare_cutlass_fp8_block_weights,
    CutlassFp8BlockRunner), BF16 input (the kernel quantises it per 1x128 group)."""

    name = "flashinfer_cutlass_fp8_block"

    def prepare(self, args: MoEArgs) -> dict[str, torch.Tensor]:
        return {
            "fc1": _up_gate(args.w13, args.I),
            "fc2": args.w2.contiguous(),
            "fc1_scale": _up_gate(args.w13_scale.to(torch.float32), args.I // 128),
            "fc2_scale": args.w2_scale.to(torch.float32).contiguous(),
        }

    def call(self, args: MoEArgs, prepared: dict[str, torch.Tensor], launch: Launch) -> Call:
        self._plain(args)
        require(tuple(args.block_shape or ()) == (128, 128), self, "block_shape must be [128, 128]")
        p = prepared
        ids, weights = _routing(args)
        x = args.hidden_states.to(torch.bfloat16)
        return Call(
            self.function,
            (x, ids, weights, p["fc1"], p["fc2"]),
            self._kwargs(
                args,
                launch,
                torch.bfloat16,
                quant_scales=[p["fc1_scale"], p["fc2_scale"]],
                use_deepseek_fp8_block_scale=True,
            ),
            _finish(args),
        )

    def check(self, call: Call) -> None:
        T, H, E, k = self._check_common(call)
        _need(self, call, "input", torch.bfloat16)
        inter = _need(self, call, "fc2_expert_weights", FP8).shape[2]
        _need(self, call, "fc1_expert_weights", FP8, (E, 2 * inter, H))
        s1, s2 = _arg(call, "quant_scales")
        _need(self, call, "quant_scales[0]", torch.float32, (E, -(-2 * inter // 128), -(-H // 128)), value=s1)
        _need(self, call, "quant_scales[1]", torch.float32, (E, -(-H // 128), -(-inter // 128)), value=s2)
        require(_arg(call, "use_deepseek_fp8_block_scale") is True, self, "use_deepseek_fp8_block_scale must be set")


@register("moe", "flashinfer_cutlass", "nvfp4")
class CutlassNvfp4(_CutlassAdapter):
    """``cutlass_fused_moe`` NVFP4 x NVFP4: packed weights viewed as int64 (the flat ABI selects the NVFP4
    kernel from that dtype), GEMM1 ``[up; gate]``, e4m3 block scales 128x4-swizzled per expert [E,
    round_up(rows, 128), round_up(K/16, 4)] viewed as int32, and ``quant_scales`` = [fc1 activation global
    scale = 1 / a13_scale, fc1 block scales, fc1 dequant [E] = a13_scale * w13_scale_2, fc2 activation global
    scale = 1 / a2_scale, fc2 block scales, fc2 dequant [E] = a2_scale * w2_scale_2] (prepare.py:
    prepare_cutlass_nvfp4_weights, CutlassNvfp4Runner._quant_scales). Activations quantised in ``call`` with
    ``fp4_quantize``, linear scales (``swizzled_input_sf=False``). Needs static activation scales."""

    name = "flashinfer_cutlass_nvfp4"
    static_scales = True

    def prepare(self, args: MoEArgs) -> dict[str, torch.Tensor]:
        s13_2, s2_2 = self._scale_2(args)
        a13, a2 = self._act_scales(args)
        return {
            "fc1": _up_gate(args.w13, args.I).view(torch.int64),
            "fc2": args.w2.contiguous().view(torch.int64),
            "fc1_act_gs": (1.0 / a13).contiguous(),
            "fc1_sf": _swizzle_128x4(_up_gate(args.w13_scale.view(torch.uint8), args.I)).view(torch.int32),
            "fc1_dequant": (a13 * s13_2).contiguous(),
            "fc2_act_gs": (1.0 / a2).contiguous(),
            "fc2_sf": _swizzle_128x4(args.w2_scale.contiguous().view(torch.uint8)).view(torch.int32),
            "fc2_dequant": (a2 * s2_2).contiguous(),
        }

    def call(self, args: MoEArgs, prepared: dict[str, torch.Tensor], launch: Launch) -> Call:
        self._plain(args)
        p = prepared
        x, x_sf = _nvfp4_act(args.hidden_states, p["fc1_act_gs"].reshape(1))
        ids, weights = _routing(args)
        scales = [p[n] for n in ("fc1_act_gs", "fc1_sf", "fc1_dequant", "fc2_act_gs", "fc2_sf", "fc2_dequant")]
        return Call(
            self.function,
            (x, ids, weights, p["fc1"], p["fc2"]),
            self._kwargs(args, launch, torch.bfloat16, quant_scales=scales, input_sf=x_sf, swizzled_input_sf=False),
            _finish(args),
        )

    def check(self, call: Call) -> None:
        T, H, E, k = self._check_common(call, x_cols_per_h=2)
        _need(self, call, "input", torch.uint8)
        _need(self, call, "input_sf", FP8, (T, H // 16))
        require(_arg(call, "swizzled_input_sf") is False, self, "input_sf is linear: swizzled_input_sf must be False")
        inter = _need(self, call, "fc2_expert_weights", torch.int64).shape[2] * 16  # int64 holds 16 e2m1 values
        require(H % 64 == 0, self, f"hidden size must be a multiple of 64 (prepare_cutlass_nvfp4_weights), got {H}")
        _need(self, call, "fc1_expert_weights", torch.int64, (E, 2 * inter, H // 16))
        g1, sf1, d1, g2, sf2, d2 = _arg(call, "quant_scales")
        r = lambda n, m: -(-n // m) * m  # noqa: E731
        _need(self, call, "quant_scales[1]", torch.int32, (E, r(2 * inter, 128), r(H // 16, 4) // 4), value=sf1)
        _need(self, call, "quant_scales[4]", torch.int32, (E, r(H, 128), r(inter // 16, 4) // 4), value=sf2)
        for name, t, shape in (("[0]", g1, ()), ("[2]", d1, (E,)), ("[3]", g2, ()), ("[5]", d2, (E,))):
            _need(self, call, f"quant_scales{name}", torch.float32, shape, value=t)


# ------------------------------------------------------------------------------------------------
# MXFP4 (GPT-OSS): trtllm-gen MxE2m1 x BF16, CUTLASS W4A16 (sm_90) / MXFP4 x MXFP8 (sm_100+), CuTe-DSL w4a8
# ------------------------------------------------------------------------------------------------

MXFP4_ACTIVATIONS = ("silu", "swigluoai", "swigluoai_uninterleave")


def _mxfp4_activation(activation: str) -> tuple[bool, Optional[tuple[float, float, float]]]:
    """``(interleaved, (alpha, beta, limit))`` of a rubin activation these adapters map to FlashInfer's SwiGLU
    (fused_moe/api.py:SwiGLU: ``gate * sigmoid(alpha * gate) * (linear + beta)``, gate clamped to
    ``(-inf, limit]``, linear to ``[-limit, limit]``): ``"silu"`` is the plain Swiglu (constants ``None``);
    GPT-OSS's ``"swigluoai[:<alpha>:<limit>]"`` (even rows gate, odd rows up) and ``"swigluoai_uninterleave"``
    (halves) are it with ``beta = 1`` (ops/moe.py: ``(up + 1) * (gate * sigmoid(alpha * gate))``)."""
    act, values = activation_info(activation)
    if act.kind == "silu":
        return False, None
    if act.kind in ("swigluoai", "swigluoai_uninterleave"):
        alpha, limit = values
        return act.interleaved, (float(alpha), 1.0, float(limit))
    raise ValueError(f"activation {activation!r} is not mapped (one of {MXFP4_ACTIVATIONS})")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad_to(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``t`` zero-padded along ``dim`` to ``size``. Zero e2m1 codes are 0.0 and zero E8M0 bytes 2^-127, so padded
    weight rows / columns contribute nothing (and padded bias entries are zero)."""
    extra = size - t.shape[dim]
    if extra == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, extra]
    if t.dtype == torch.uint8:
        return torch.nn.functional.pad(t, pad)
    return torch.nn.functional.pad(t.to(torch.float32), pad).to(t.dtype)


def _mxfp4_up_gate(args: MoEArgs, Hp: int, Ip: int, interleaved: bool) -> dict[str, Optional[torch.Tensor]]:
    """rubin's MXFP4 weights, scales and biases in FlashInfer's canonical order: GEMM1 ``[up; gate]`` rows (from
    rubin's halves, or from even / odd rows for swigluoai), each half zero-padded from I to ``Ip`` rows and the
    hidden dim from H to ``Hp`` (packed: ``Hp / 2`` bytes, ``Hp / 32`` scales); GEMM2 padded likewise. Weights,
    scales (uint8) and biases move row for row."""
    inter = args.I

    def halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (gate, up) along dim 1
        return (t[:, 0::2], t[:, 1::2]) if interleaved else (t[:, :inter], t[:, inter:])

    def gemm1(t: torch.Tensor, cols: Optional[int]) -> torch.Tensor:
        gate, up = halves(t)
        up, gate = _pad_to(up, 1, Ip), _pad_to(gate, 1, Ip)
        out = torch.cat((up, gate), dim=1)
        return (_pad_to(out, 2, cols) if cols is not None else out).contiguous()

    out: dict[str, Optional[torch.Tensor]] = {
        "w1": gemm1(args.w13, Hp // 2),
        "s1": gemm1(args.w13_scale.view(torch.uint8), Hp // 32),
        "w2": _pad_to(_pad_to(args.w2, 1, Hp), 2, Ip // 2).contiguous(),
        "s2": _pad_to(_pad_to(args.w2_scale.view(torch.uint8), 1, Hp), 2, Ip // 32).contiguous(),
        "b1": None,
        "b2": None,
    }
    if args.w13_bias is not None:
        out["b1"] = gemm1(args.w13_bias, None)
    if args.w2_bias is not None:
        out["b2"] = _pad_to(args.w2_bias, 1, Hp).contiguous()
    return out


def _padded_input(x: torch.Tensor, Hp: int) -> torch.Tensor:
    """The hidden states as BF16 [T, Hp] (zero columns where the weights were padded; a copy only then)."""
    x = x.to(torch.bfloat16)
    return _pad_to(x, 1, Hp).contiguous() if x.shape[1] != Hp else x.contiguous()


def _finish_sliced(args: MoEArgs, H: int, Hp: int):
    dtype = args.hidden_states.dtype
    if H == Hp:
        return lambda out: _first(out).to(dtype)
    return lambda out: _first(out)[:, :H].to(dtype)


def _mxfp8_act(x: torch.Tensor, swizzled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16 ``x`` [T, H] -> MXFP8 (e4m3 [T, H], E8M0 scales per 32) with FlashInfer's ``mxfp8_quantize`` (a CUDA
    kernel, no host synchronisation): linear scales as uint8 [T, H/32] (fused_moe/prepare.py:
    prepare_trtllm_fp4_activations' MXFP4 x MXFP8 branch), or ``swizzled``: the flat 128x4-swizzled buffer
    [round_up(T, 128) * H/32] of prepare.py:prepare_cutlass_mxfp8_activations (H % 128 here, so the scale
    columns need no padding). On meta tensors, tensors of those shapes."""
    T, H = x.shape
    if x.is_meta:
        sf = torch.empty(_round_up(T, 128) * (H // 32), dtype=torch.uint8, device="meta") if swizzled else None
        if sf is None:
            sf = torch.empty(T, H // 32, dtype=torch.uint8, device="meta")
        return torch.empty(T, H, dtype=FP8, device="meta"), sf
    if swizzled:
        from flashinfer.fused_moe.prepare import prepare_cutlass_mxfp8_activations

        q, sf = prepare_cutlass_mxfp8_activations(x)
        return q, sf.view(torch.uint8).reshape(-1)
    from flashinfer import mxfp8_quantize

    q, sf = mxfp8_quantize(x, is_sf_swizzled_layout=False)
    return q, sf.view(torch.uint8).reshape(T, -1)


class _Mxfp4Adapter(_MoEAdapter):
    """What the MXFP4 adapters share: the activations they map (silu, GPT-OSS's swigluoai), the biases the
    entry point takes (GPT-OSS has both), and the padding of H and I to ``align`` (FlashInfer's MXFP4
    preparations and the CUTLASS binding require 128: GPT-OSS's H = I = 2880 is not)."""

    align = 128
    takes_biases = True

    def supports(self, target: Target, spec: KernelSpec) -> Optional[str]:
        reason = super().supports(target, spec)
        if reason:
            return reason
        kind = (spec.activation or "silu").split(":")[0]
        if kind not in MXFP4_ACTIVATIONS:
            return f"{self.name} maps activations {', '.join(MXFP4_ACTIVATIONS)} only, not {spec.activation}"
        return None

    def sources(self, args: MoEArgs):
        return tuple(super().sources(args)) + tuple(t for t in (args.w13_bias, args.w2_bias) if t is not None)

    def _padded(self, args: MoEArgs) -> tuple[int, int]:
        return _round_up(args.H, self.align), _round_up(args.I, self.align)

    def _plain_mxfp4(self, args: MoEArgs) -> tuple[bool, Optional[tuple[float, float, float]]]:
        require(not args.weight_layout.cpu_packed, self, "weights must be in the plain layout")
        require(not args.apply_router_weight_on_input, self, "apply_router_weight_on_input is not implemented")
        require(args.activation_constants is None, self, "run-time activation constants are not implemented")
        require(
            self.takes_biases or (args.w13_bias is None and args.w2_bias is None),
            self,
            "expert biases are not passed to this kernel",
        )
        require(args.fp4 == "mxfp4", self, "needs MXFP4 weights (uint8 E8M0 scales per 32)")
        try:
            return _mxfp4_activation(args.activation)
        except ValueError as exc:
            require(False, self, str(exc))
            raise

    def _per_expert_constants(self, args: MoEArgs, constants) -> dict[str, torch.Tensor]:
        if constants is None:
            return {}
        dev = args.w13.device
        return {
            name: torch.full((args.E,), value, dtype=torch.float32, device=dev)
            for name, value in zip(("alpha", "beta", "limit"), constants)
        }


@register("moe", "flashinfer_trtllm", "mxfp4")
class TrtllmMxfp4Bf16(_Mxfp4Adapter, _TrtllmAdapter):
    """``trtllm_fp4_block_scale_routed_moe`` with MxE2m1 weights and BF16 activations (TensorRT-LLM's W4A16 for
    GPT-OSS; the activations are not quantised, so no static scales are needed). Prepared as
    prepare.py:prepare_trtllm_fp4_weights does for MXFP4 after its quantisation: ``[up; gate]`` rows, then per
    expert the gated-act reorder + ``shuffle_matrix_a`` rows (epilogue tile 128) of the packed weights, the same
    with ``num_elts_per_sf=16`` on the E8M0 scale rows (prepare_trtllm_fp4_weights passes 16 for MXFP4 too),
    which are then 128x4-swizzled (``_swizzle_128x4``, its ``block_scale_interleave``) and typed float8 ("the FP4
    launcher requires float8 tensor metadata for both E4M3 and UE8M0 scale bytes"); GEMM2 the shuffle only.
    Biases float32, permuted with their rows (the permutations of a [rows, 1] tensor, as vLLM's GPT-OSS
    preparation computes them). Epilogue scalars ones (the MXFP4 preparation's). H and I are zero-padded to 128;
    the output is sliced back to H. swigluoai -> ``gemm1_alpha`` / ``gemm1_beta`` / ``gemm1_clamp_limit`` [E].

    sm_103 is rejected: TrtllmFp4RoutedRunner._check_support (fused_moe/runners.py) lists MXFP4 x BF16 for
    sm_100 / sm_107 only ("W4A16 ... retains the upstream SM103 xfail"). Tolerance: MXFP4 weights, BF16
    activations."""

    name = "flashinfer_trtllm_fp4_routed_mxfp4_bf16"
    function = "flashinfer.fused_moe.trtllm_fp4_block_scale_routed_moe"

    def supports(self, target: Target, spec: KernelSpec) -> Optional[str]:
        if target.cc == 103:
            return (
                f"{self.name}: trtllm-gen MXFP4 x BF16 is not supported on sm_103 "
                "(fused_moe/runners.py:TrtllmFp4RoutedRunner._check_support)"
            )
        return super().supports(target, spec)

    def prepare(self, args: MoEArgs) -> dict[str, torch.Tensor]:
        E = args.E
        Hp, Ip = self._padded(args)
        interleaved, constants = _mxfp4_activation(args.activation)
        c = _mxfp4_up_gate(args, Hp, Ip, interleaved)
        p1, p2 = _trtllm_permutes(c["w1"][0], c["w2"][0])
        q1, q2 = _trtllm_permutes(c["s1"][0], c["s2"][0], sf=16)
        ones = torch.ones(E, dtype=torch.float32, device=args.w13.device)
        out = {
            "gemm1_weights": c["w1"][:, p1].contiguous(),
            "gemm1_weights_scale": _swizzle_128x4(c["s1"][:, q1]).view(FP8).reshape(E, 2 * Ip, Hp // 32),
            "gemm2_weights": c["w2"][:, p2].contiguous(),
            "gemm2_weights_scale": _swizzle_128x4(c["s2"][:, q2]).view(FP8).reshape(E, Hp, Ip // 32),
            "output1_scale_scalar": ones,
            "output1_scale_gate_scalar": ones.clone(),
            "output2_scale_scalar": ones.clone(),
        }
        if c["b1"] is not None or c["b2"] is not None:
            b1 = c["b1"] if c["b1"] is not None else torch.zeros(E, 2 * Ip, device=args.w13.device)
            b2 = c["b2"] if c["b2"] is not None else torch.zeros(E, Hp, device=args.w13.device)
            b1, b2 = b1.to(torch.float32), b2.to(torch.float32)
            r1, r2 = _trtllm_permutes(b1[0].reshape(-1, 1), b2[0].reshape(-1, 1))
            out["gemm1_bias"] = b1[:, r1].contiguous()
            out["gemm2_bias"] = b2[:, r2].contiguous()
        for name, t in self._per_expert_constants(args, constants).items():
            out[{"alpha": "gemm1_alpha", "beta": "gemm1_beta", "limit": "gemm1_clamp_limit"}[name]] = t
        return out

    def call(self, args: MoEArgs, prepared: dict[str, torch.Tensor], launch: Launch) -> Call:
        self._plain_mxfp4(args)
        p = prepared
        Hp, Ip = self._padded(args)
        common = _trtllm_common(args, launch)
        common["intermediate_size"] = Ip
        return Call(
            self.function,
            (
                _routing(args),
                None,
                _padded_input(args.hidden_states, Hp),
                None,
                p["gemm1_weights"],
                p["gemm1_weights_scale"],
                p.get("gemm1_bias"),
                p.get("gemm1_alpha"),
                p.get("gemm1_beta"),
                p.get("gemm1_clamp_limit"),
                p["gemm2_weights"],
                p["gemm2_weights_scale"],
                p.get("gemm2_bias"),
                p["output1_scale_scalar"],
                p["output1_scale_gate_scalar"],
                p["output2_scale_scalar"],
            ),
            dict(common, hidden_states_scale_layout=SF_LAYOUT_LINEAR),
            _finish_sliced(args, args.H, Hp),
        )

    def check(self, call: Call) -> None:
        self._check_trtllm(call)
        b = call.bound().arguments
        x = _need(self, call, "hidden_states", torch.bfloat16)
        T, H = x.shape
        E, k, inter = b["num_experts"], b["top_k"], b["intermediate_size"]
        self._check_routing(call, "topk_ids", "topk_ids", T, k)
        require(b["hidden_states_scale"] is None, self, "BF16 activations take no hidden_states_scale")
        require(H % 128 == 0, self, f"hidden size must be padded to a multiple of 128, got {H}")
        _need(self, call, "gemm1_weights", torch.uint8, (E, 2 * inter, H // 2))
        _need(self, call, "gemm2_weights", torch.uint8, (E, H, inter // 2))
        # E8M0 bytes typed float8, one per 32: the launcher infers MxE2m1 from the scale count
        _need(self, call, "gemm1_weights_scale", FP8, (E, 2 * inter, H // 32))
        _need(self, call, "gemm2_weights_scale", FP8, (E, H, inter // 32))
        if b["gemm1_bias"] is not None or b["gemm2_bias"] is not None:
            _need(self, call, "gemm1_bias", torch.float32, (E, 2 * inter))
            _need(self, call, "gemm2_bias", torch.float32, (E, H))
        for name in ("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit"):
            if b[name] is not None:
                _need(self, call, name, torch.float32, (E,))
        for name in ("output1_scale_scalar", "output1_scale_gate_scalar", "output2_scale_scalar"):
            _need(self, call, name, torch.float32, (E,))


# the bit moves of interleave_fp4_weights_for_sm90_mixed_gemm_kernel (data/csrc/nv_internal/tensorrt_llm/kernels/
# cutlass_kernels/moe_gemm/moe_gemm_mixed_utils.cu) inside each 32-bit word of four gathered bytes: (mask, shift),
# shift > 0 left
_SM90_FP4_BITS = (
    (0x00000080, 24), (0x00000070, 18), (0x00000008, 12), (0x00000007, 6),
    (0x00008000, 13), (0x00007000, 7), (0x00000800, 1), (0x00000700, -5),
    (0x00800000, 2), (0x00700000, -4), (0x00080000, -10), (0x00070000, -16),
    (0x80000000, -1), (0x10000000, 1), (0x60000000, -3), (0x08000000, -13),
    (0x01000000, -11), (0x06000000, -15),
)  # fmt: skip


def _sm90_fp4_interleave_indices(n: int, k: int, device) -> tuple[torch.Tensor, ...]:
    """Source (row, byte) of the four bytes each word of the kernel reads and destination (row, first byte) it
    writes, over (block_id < n / 2, partition_id < k / 64, lane_id < 16), as the kernel's loops index them."""
    blk = torch.arange(n // 2, device=device)[:, None, None]
    part = torch.arange(k // 64, device=device)[None, :, None]
    lane = torch.arange(16, device=device)[None, None, :]
    row = blk // 8 * 16 + blk % 8
    mma = lane // 4
    dst_row = row + (mma % 2) * 8
    col = part * 32 + mma * 8 + lane % 4
    dst_col = part * 32 + lane // 8 * 16 + (lane % 4) * 4
    shape = (n // 2, k // 64, 16)
    return tuple(t.expand(shape).reshape(-1) for t in (row, col, dst_row, dst_col))


def _interleave_fp4_sm90(w: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 weights [E, n, k / 2] (uint8) -> the layout FlashInfer's
    ``interleave_moe_weights_for_sm90_mixed_gemm(w, "fp4")`` (fused_moe/prepare.py; a CUDA kernel) writes for the
    SM90 W4A16 mixed-input GEMM, built with torch indexing and integer ops so that it runs on meta tensors too:
    per word, the bytes at (row, c), (row + 8, c), (row, c + 4), (row + 8, c + 4) are joined little-endian,
    their bits moved by ``_SM90_FP4_BITS``, and written to 4 consecutive bytes of the destination row.
    tests/gpu/test_flashinfer_moe.py compares it with FlashInfer's kernel on sm_90."""
    E, n, half_k = w.shape
    k = 2 * half_k
    if n % 16 or k % 64:
        raise ValueError(f"the SM90 FP4 interleave needs n % 16 == 0 and k % 64 == 0, got n={n}, k={k}")
    row, col, dst_row, dst_col = _sm90_fp4_interleave_indices(n, k, w.device)
    out = torch.empty_like(w)
    step = E if w.is_meta else 8  # bound the int64 temporaries on real tensors
    for e0 in range(0, E, step):
        src = w[e0 : e0 + step].to(torch.int64)
        raw = src[:, row, col] | src[:, row + 8, col] << 8 | src[:, row, col + 4] << 16 | src[:, row + 8, col + 4] << 24
        moved = torch.zeros_like(raw)
        for mask, shift in _SM90_FP4_BITS:
            bits = raw & mask
            moved |= bits << shift if shift > 0 else bits >> -shift
        for j in range(4):
            out[e0 : e0 + step, dst_row, dst_col + j] = ((moved >> (8 * j)) & 0xFF).to(torch.uint8)
    return out


class _CutlassMxfp4(_Mxfp4Adapter, _CutlassAdapter):
    def _cutlass_kwargs(self, args: MoEArgs, p: dict[str, torch.Tensor], launch: Launch, **extra) -> dict[str, Any]:
        return self._kwargs(
            args,
            launch,
            torch.bfloat16,
            fc1_expert_biases=p.get("fc1_bias"),
            fc2_expert_biases=p.get("fc2_bias"),
            swiglu_alpha=p.get("swiglu_alpha"),
            swiglu_beta=p.get("swiglu_beta"),
            swiglu_limit=p.get("swiglu_limit"),
            **extra,
        )

    def _common_prepared(self, args: MoEArgs, c: dict, constants) -> dict[str, torch.Tensor]:
        """Biases in the output dtype (the binding's CHECK_INPUT_TYPE(bias, mOutputDtype): BF16), zeros for a
        missing one (the binding takes both or neither), and swiglu_alpha / beta / limit [E] float32."""
        out: dict[str, torch.Tensor] = {}
        if c["b1"] is not None or c["b2"] is not None:
            E, dev = args.E, args.w13.device
            b1 = c["b1"] if c["b1"] is not None else torch.zeros(E, c["w1"].shape[1], device=dev)
            b2 = c["b2"] if c["b2"] is not None else torch.zeros(E, c["w2"].shape[1], device=dev)
            out["fc1_bias"], out["fc2_bias"] = b1.to(torch.bfloat16), b2.to(torch.bfloat16)
        for name, t in self._per_expert_constants(args, constants).items():
            out[f"swiglu_{name}"] = t
        return out

    def _check_mxfp4_common(self, call: Call, x_dtype) -> tuple[int, int, int, int]:
        T, H, E, k = self._check_common(call)
        b = call.bound().arguments
        _need(self, call, "input", x_dtype)
        require(b["output_dtype"] == torch.bfloat16, self, "output_dtype must be bfloat16")
        require(H % 128 == 0, self, f"hidden size must be padded to a multiple of 128, got {H}")
        if b["fc1_expert_biases"] is not None or b["fc2_expert_biases"] is not None:
            _need(self, call, "fc1_expert_biases", torch.bfloat16)
            _need(self, call, "fc2_expert_biases", torch.bfloat16, (E, H))
        for name in ("swiglu_alpha", "swiglu_beta", "swiglu_limit"):
            if b[name] is not None:
                _need(self, call, name, torch.float32, (E,))
        return T, H, E, k


@register("moe", "flashinfer_cutlass", "mxfp4")
class CutlassMxfp4W4A16Sm90(_CutlassMxfp4):
    """``cutlass_fused_moe(use_w4_group_scaling=True)`` on sm_90: MXFP4 weights x BF16 activations (the binding's
    isWFP4A16Quant, "SM90 MXFP4 W4A16 supports BF16 activations only"). Prepared as prepare.py:
    prepare_cutlass_w4a16_weights does after its quantisation: ``[up; gate]`` rows; packed weights through the
    SM90 mixed-GEMM interleave (``_interleave_fp4_sm90``, a torch rebuild of FlashInfer's CUDA
    ``interleave_moe_weights_for_sm90_mixed_gemm``), E8M0 scales through FlashInfer's own (torch)
    ``interleave_moe_scales_for_sm90_mixed_gemm`` [E, rows / 64, K / 128, 16, 16], passed viewed as int32 as
    CutlassW4A16Runner._quant_scales does. H and I zero-padded to 128 (the preparation's "divisible by 128"),
    output sliced back. Biases BF16, swigluoai as swiglu_alpha / beta / limit [E] (the binding then selects its
    SwigluBias kernel), as vLLM's GPT-OSS CUTLASS path passes them.

    One adapter, one layout: the sm_100+ form (MXFP4 x MXFP8, isWMxfp4AMxfp8Quant) needs other weights (int64
    views, 128x4-swizzled scales) and quantised activations, and nothing in ``args`` says which GPU the call is
    for (prepare runs on meta tensors too, where no capability is readable); ``supports`` therefore keeps this
    adapter to sm_90 and the sm_100+ form stays a plan (see the table's entry)."""

    name = "flashinfer_cutlass_mxfp4_w4a16_sm90"

    def supports(self, target: Target, spec: KernelSpec) -> Optional[str]:
        if target.cc != 90:
            return (
                f"{self.name} builds the sm_90 W4A16 layout (isWFP4A16Quant); MXFP4 x MXFP8 for sm_100+ "
                "(isWMxfp4AMxfp8Quant) has no adapter yet"
            )
        return super().supports(target, spec)

    def prepare(self, args: MoEArgs) -> dict[str, torch.Tensor]:
        from flashinfer.fused_moe.prepare import interleave_moe_scales_for_sm90_mixed_gemm

        Hp, Ip = self._padded(args)
        interleaved, constants = _mxfp4_activation(args.activation)
        c = _mxfp4_up_gate(args, Hp, Ip, interleaved)
        out = {
            "fc1": _interleave_fp4_sm90(c["w1"]),
            "fc2": _interleave_fp4_sm90(c["w2"]),
            "fc1_sf": interleave_moe_scales_for_sm90_mixed_gemm(c["s1"]).view(torch.int32),
            "fc2_sf": interleave_moe_scales_for_sm90_mixed_gemm(c["s2"]).view(torch.int32),
        }
        out.update(self._common_prepared(args, c, constants))
        return out

    def call(self, args: MoEArgs, prepared: dict[str, torch.Tensor], launch: Launch) -> Call:
        self._plain_mxfp4(args)
        p = prepared
        Hp, _ = self._padded(args)
        ids, weights = _routing(args)
        return Call(
            self.function,
            (_padded_input(args.hidden_states, Hp), ids, weights, p["fc1"], p["fc2"]),
            self._cutlass_kwargs(args, p, launch, quant_scales=[p["fc1_sf"], p["fc2_sf"]], use_w4_group_scaling=True),
            _finish_sliced(args, args.H, Hp),
        )

    def check(self, call: Call) -> None:
        T, H, E, k = self._check_mxfp4_common(call, torch.bfloat16)
        b = call.bound().arguments
        inter = _need(self, call, "fc2_expert_weights", torch.uint8).shape[2] * 2
        require(inter % 128 == 0, self, f"intermediate size must be padded to a multiple of 128, got {inter}")
        _need(self, call, "fc1_expert_weights", torch.uint8, (E, 2 * inter, H // 2))
        require(b["use_w4_group_scaling"] is True, self, "use_w4_group_scaling must be set (W4A16)")
        require(not b["use_mxfp8_act_scaling"] and not b["use_packed_weights"], self, "W4A16 takes plain uint8")
        require(not b["use_wfp4afp8_humming"], self, "use_wfp4afp8_humming selects another path")
        s1, s2 = _arg(call, "quant_scales")
        # CutlassW4A16Runner._pack_weight_inputs: [E, rows / 64, K / 128, 16, 16] bytes
        _need(self, call, "quant_scales[0]", torch.int32, (E, 2 * inter // 64, H // 128, 16, 4), value=s1)
        _need(self, call, "quant_scales[1]", torch.int32, (E, H // 64, inter // 128, 16, 4), value=s2)
        if b["fc1_expert_biases"] is not None:
            _need(self, call, "fc1_expert_biases", torch.bfloat16, (E, 2 * inter))


@register("moe", "flashinfer_cutedsl", "mxfp4")
class CuteDslMxfp8Mxfp4(_Mxfp4Adapter):
    """``cute_dsl_fused_moe_mxfp8_mxfp4`` (sm_100 / 103): MXFP4 weights, MXFP8 activations quantised per call
    (``mxfp8_quantize``, linear E8M0 scales [T, H/32] uint8: fused_moe/cute_dsl/fused_moe.py:
    validate_w4a8_inputs). Prepared as prepare.py:prepare_cute_dsl_weights does for MXFP4 x MXFP8 after its
    quantisation: ``[up; gate]`` rows interleaved in groups of 64 (``_interleave_linear_and_gate``), weights and
    scale rows alike; E8M0 scales 128x4-swizzled (``_swizzle_128x4``) and viewed in the CuTe MMA layout by
    ``convert_sf_to_mma_layout(sf_vec_size=32)``; ``w1_alpha`` / ``w2_alpha`` ones. swigluoai -> its scalar
    ``swiglu_alpha`` / ``swiglu_beta`` / ``swiglu_limit``. The kernel takes no biases, so GPT-OSS (which has them)
    cannot run here (``call`` refuses them). H and I must be multiples of 128 (the preparation's check; not padded
    here: that would need the biases this kernel lacks for GPT-OSS anyway). Tolerance: MXFP8 activations."""

    name = "flashinfer_cutedsl_mxfp8_mxfp4"
    function = "flashinfer.fused_moe.cute_dsl_fused_moe_mxfp8_mxfp4"
    takes_biases = False

    def supports(self, target: Target, spec: KernelSpec) -> Optional[str]:
        H, inter = spec.dim("H"), spec.dim("I")
        for name, n in (("H", H), ("I", inter)):
            if n is not None and n % 128:
                return f"shape limit: {name}={n} must be a multiple of 128 (prepare.py:prepare_cute_dsl_weights)"
        return super().supports(target, spec)

    def prepare(self, args: MoEArgs) -> dict[str, torch.Tensor]:
        from flashinfer.cute_dsl.utils import convert_sf_to_mma_layout
        from flashinfer.fused_moe.prepare import _interleave_linear_and_gate

        E, H, inter = args.E, args.H, args.I
        interleaved, _ = _mxfp4_activation(args.activation)
        c = _mxfp4_up_gate(args, H, inter, interleaved)
        w1 = _interleave_linear_and_gate(c["w1"], group_size=64, dim=1)
        sf1 = _interleave_linear_and_gate(c["s1"], group_size=64, dim=1)
        mma1 = convert_sf_to_mma_layout(_swizzle_128x4(sf1), m=2 * inter, k=H, num_groups=E, sf_vec_size=32)
        mma2 = convert_sf_to_mma_layout(_swizzle_128x4(c["s2"]), m=H, k=inter, num_groups=E, sf_vec_size=32)
        ones = torch.ones(E, dtype=torch.float32, device=args.w13.device)
        return {"w1_weight": w1, "w1_weight_sf": mma1, "w1_alpha": ones, "w2_weight": c["w2"], "w2_weight_sf": mma2,
                "w2_alpha": ones.clone()}  # fmt: skip

    def call(self, args: MoEArgs, prepared: dict[str, torch.Tensor], launch: Launch) -> Call:
        _, constants = self._plain_mxfp4(args)
        p = prepared
        x, x_sf = _mxfp8_act(args.hidden_states.to(torch.bfloat16).contiguous(), swizzled=False)
        ids, weights = _routing(args)
        act = {}
        if constants is not None:
            act = dict(zip(("swiglu_alpha", "swiglu_beta", "swiglu_limit"), constants))
        return Call(
            self.function,
            (
                x,
                x_sf,
                ids,
                weights,
                p["w1_weight"],
                p["w1_weight_sf"],
                p["w1_alpha"],
                p["w2_weight"],
                p["w2_weight_sf"],
                p["w2_alpha"],
                args.E,
                args.k,
            ),  # fmt: skip
            dict(enable_pdl=launch.pdl, activation_type=SWIGLU, **act),
            _finish(args),
        )

    def check(self, call: Call) -> None:
        b = call.bound().arguments
        x = _need(self, call, "x", FP8)
        T, H = x.shape
        E, k = b["num_experts"], b["top_k"]
        self._check_routing(call, "token_selected_experts", "token_final_scales", T, k)
        _need(self, call, "token_final_scales", torch.float32, (T, k))
        _need(self, call, "x_sf", torch.uint8, (T, H // 32))
        w1 = _need(self, call, "w1_weight", torch.uint8)
        require(tuple(w1.shape[::2]) == (E, H // 2), self, f"w1_weight must be [E={E}, 2I, H/2], got {tuple(w1.shape)}")
        two_i = w1.shape[1]
        _need(self, call, "w2_weight", torch.uint8, (E, H, two_i // 4))
        # validate_w4a8_inputs: (32, 4, m_tiles, 4, k_tiles, E) with k_tiles = ceil(columns / 128)
        for name, rows, cols in (("w1_weight_sf", two_i, H), ("w2_weight_sf", H, two_i // 2)):
            m_tiles, k_tiles = -(-rows // 128), -(-cols // 128)
            sf = _need(self, call, name, torch.uint8, (32, 4, m_tiles, 4, k_tiles, E))
            strides = (16, 4, k_tiles * 512, 1, 512, m_tiles * k_tiles * 512)
            require(tuple(sf.stride()) == strides, self, f"{name} must have the MMA strides {strides}")
        for name in ("w1_alpha", "w2_alpha"):
            _need(self, call, name, torch.float32, (E,))
        require(int(b["activation_type"]) == SWIGLU, self, "activation_type must be Swiglu")


# MXFP4 x MXFP8 on CUTLASS for sm_100+ (isWMxfp4AMxfp8Quant: int64-viewed weights, 128x4-swizzled E8M0 scales
# as int32 [E, rows, K/128], ones as fc1 / fc2 globals, MXFP8 activations with swizzled input_sf, as vLLM's
# test_flashinfer_cutlass_mxfp4_mxfp8_fused_moe and CutlassMxfp8Mxfp4Runner build them) has no adapter: the
# (moe, flashinfer_cutlass, mxfp4) key holds the sm_90 W4A16 adapter above, one adapter per key, and its
# layout cannot be chosen from the arguments (see CutlassMxfp4W4A16Sm90).
