"""vLLM MoE layers as canonical ops: ``rubin.vllm_moe_layer`` and ``rubin.vllm_moe_layer_shared``.

vLLM's GPU graphs call one opaque op per MoE layer, ``vllm.moe_forward`` (or ``vllm.moe_forward_shared``
when the layer has shared experts). Its weights and routing settings are not graph inputs: they live on
the layer that ``layer_name`` names, found at run time in the forward context. The ops below take the
same arguments and return the same values, but run the routed experts through ``rubin.moe``'s kernel
registry (the ``impl`` argument, chosen by select_kernels), so a rewritten graph keeps referring to the
layer by name and never captures its weights (they would otherwise be pickled into compile caches).

Schema (``LayerName`` is vLLM's hoisted opaque layer-name type on torch >= 2.11, else ``str``)::

    rubin::vllm_moe_layer(Tensor hidden_states, Tensor router_logits, Tensor? shared_experts_input,
                          Tensor? input_ids, LayerName layer_name, str impl="reference",
                          bool pdl=False, str placement="") -> Tensor
    rubin::vllm_moe_layer_shared(...same...) -> (Tensor shared_out, Tensor fused_out)

Semantics, for the ``MoERunner`` ``layer`` named ``layer_name`` (exactly what its ``_forward_impl`` computes
in a single-rank run)::

    router_logits = layer.gate(hidden_states)              if the layer owns its gate
    topk_weights, topk_ids = layer.router.select_experts(hidden_states, router_logits, ...)
                                                           # vLLM's own routing: top-k, renormalise,
                                                           # softmax / sigmoid, grouped top-k,
                                                           # correction bias, routed scaling
    fused_out  = rubin.moe(hidden_states, W13, W2, topk_weights, topk_ids, act, b13, b2, impl=impl,
                           pdl=pdl, placement=placement,
                           apply_router_weight_on_input=<the layer's>)   # vLLM's prepare() scales the input
    shared_out = layer.shared_experts' module(shared_experts_input)   (``_shared`` only)

where ``W13``/``W2`` are the layer's expert weights as stored, with their ``rubin.moe`` weight layout
(vLLM's CPU build stores them prepacked: layout ``"vllm_cpu:<isa>[:vnni]"``), and ``act`` is what the layer's experts
compute, in rubin.moe's terms (``experts_activation``: the activation with the constants its vLLM kernel reads). Whatever vLLM applies outside its op
(the runner-level routed scaling factor, the shared + routed add, all-reduces) stays in the graph.

``layer_unsupported_reason`` says, at compile time, when a layer is one these ops cannot reproduce
(quantised, expert/data parallel, LoRA, an activation ``rubin.moe`` lacks or constants vLLM ignores, the
router weight on the input with top-k > 1, ...); the matcher then leaves
the vLLM op alone. The ops are defined only once vLLM is imported (their schema names vLLM's type); they
are registered as forms of ``rubin.moe`` (``MOE.add_form``), so selection binds them to rubin.moe's kernels
with a spec read off the layer they name.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from rubin_compile.integrations import after_import
from rubin_compile.kernels.triton import moe_choice
from rubin_compile.ops.moe import (
    MOE,
    SWIGLUOAI_ALPHA,
    SWIGLUOAI_LIMIT,
    MoEArgs,
    MoEArgumentError,
    WeightLayout,
    activation_info,
    activation_string,
    call_features,
    pack_cpu_weight,
)
from rubin_compile.ops.nodes import bound_arguments, dtype_name, static_size, val_dtype
from rubin_compile.ops.registry import KernelSpec, Launch, parse_impl

PLAIN_CPU, VNNI_CPU = WeightLayout("vllm_cpu", "<isa>"), WeightLayout("vllm_cpu", "<isa>", vnni=True)

# What vLLM 0.32's unquantized experts compute for a layer's ``MoEActivation``, as rubin.moe's activation. The
# layer's swiglu_limit / swiglu_alpha / swiglu_beta reach the kernel through ``ApplyMoEActivationConfig`` (None, 1.0
# and 0.0 when unset), and only some kernels read them:
#
# * Triton experts (GPUs; experts/triton_moe.py ``TritonExperts.activation`` -> activation.py
#   ``apply_moe_activation``): "silu" with a limit runs ``silu_and_mul_with_clamp(limit, 1.0, 0.0)``
#   = rubin's "silu_clamp:<limit>"; "swigluoai_uninterleave" runs ``silu_and_mul_with_clamp(limit, alpha, beta)``
#   = gate * sigmoid(alpha * gate) * (up + beta) with both clamped, rubin's "swigluoai_uninterleave:<alpha>:<limit>"
#   when beta is 1; "swiglustep" runs ``swiglustep_and_mul_triton`` at its default limit 7.0 (rubin's "swiglustep");
#   "swigluoai" runs ``swigluoai_and_mul`` at 1.702 / 7.0 (rubin's "swigluoai", interleaved rows); the ``_no_mul``
#   ones are plain PyTorch (relu2_no_mul = relu(x) ** 2). gelu is erf GELU.
# * vLLM's CPU experts (experts/cpu_moe.py) build only silu / swigluoai / gelu / gelu_tanh layers and call
#   ``cpu_fused_moe(act=activation.value)``: no constant reaches the kernel.
#
# A constant the layer sets but its kernel does not read leaves the layer to vLLM: rubin would have to choose between
# what the config asks for and what vLLM computes (vLLM's CPU experts run a swiglu_limit layer's SiLU unclamped).
VLLM_ACTIVATIONS = (
    "silu",
    "gelu",
    "gelu_tanh",
    "swigluoai",
    "swigluoai_uninterleave",
    "swiglustep",
    "silu_no_mul",
    "gelu_no_mul",
    "gelu_tanh_no_mul",
    "relu2_no_mul",
)
CPU_EXPERTS_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai")
# the constants a kernel applies whatever the layer says (None: the layer's value is read)
_FIXED = {"swigluoai": {"alpha": SWIGLUOAI_ALPHA, "limit": SWIGLUOAI_LIMIT, "beta": 1.0}, "swiglustep": {"limit": 7.0}}
_NEUTRAL = {"limit": None, "alpha": 1.0, "beta": 0.0}  # ApplyMoEActivationConfig's values when unset


def experts_activation(
    activation: str, cpu: bool, limit: Optional[float] = None, alpha: float = 1.0, beta: float = 0.0
) -> tuple[Optional[str], Optional[str]]:
    """(rubin.moe's activation string for what vLLM's unquantized experts compute, None), or (None, why there is
    none): ``activation`` is the layer's ``MoEActivation`` value, ``cpu`` whether its experts are vLLM's CPU
    experts (else the Triton experts), ``limit`` / ``alpha`` / ``beta`` its ``ApplyMoEActivationConfig``."""
    given = {"limit": limit, "alpha": alpha, "beta": beta}
    read: tuple[str, ...] = ()
    if activation not in VLLM_ACTIVATIONS or (cpu and activation not in CPU_EXPERTS_ACTIVATIONS):
        if cpu and activation in VLLM_ACTIVATIONS:
            return None, f"activation {activation!r} (vLLM's CPU experts build {list(CPU_EXPERTS_ACTIVATIONS)})"
        return None, f"activation {activation!r} (rubin.moe implements vLLM's {list(VLLM_ACTIVATIONS)})"
    if activation == "silu" and limit is not None and not cpu:
        name, read = activation_string("silu_clamp", (limit,)), ("limit",)
    elif activation == "swigluoai_uninterleave":
        if limit is None:
            return None, "swigluoai_uninterleave without a swiglu_limit (vLLM's fused MoE asserts one)"
        if beta != 1.0:
            return None, (
                f"swigluoai_uninterleave with swiglu_beta={beta}: vLLM computes gate * sigmoid(alpha * gate) * "
                "(up + beta), rubin.moe's swigluoai_uninterleave (up + 1) * ... (beta 1 only)"
            )
        name, read = activation_string("swigluoai_uninterleave", (alpha, limit)), ("limit", "alpha", "beta")
    else:
        name = activation
    fixed = _FIXED.get(activation, {})
    ignored = [
        f"swiglu_{n}={v}"
        for n, v in given.items()
        if n not in read and v != _NEUTRAL[n] and (n not in fixed or float(v) != fixed[n])
    ]
    if ignored:
        kernel = "vLLM's CPU experts (cpu_fused_moe(act=...) takes no constants)" if cpu else "vLLM's fused MoE"
        return None, (
            f"{', '.join(ignored)} set on a layer whose activation {activation!r} {kernel} runs without it"
            + (f" (it runs {activation} at {fixed})" if fixed else "")
            + ": rubin would have to choose between what the config asks for and what vLLM computes, so the layer "
            "stays with vLLM"
        )
    try:
        activation_info(name)
    except MoEArgumentError as exc:  # a limit rubin.moe refuses (<= 0)
        return None, f"vLLM's {activation} with {given}: {exc}"
    return name, None


def layer_activation(layer: Any) -> tuple[Optional[str], Optional[str]]:
    """``experts_activation`` for a vLLM ``MoERunner``: its activation, its experts (CPU or not) and the constants
    vLLM's modular kernel hands the activation (``ApplyMoEActivationConfig.from_configs``, as modular_kernel.py
    builds it)."""
    from vllm.model_executor.layers.fused_moe.activation import ApplyMoEActivationConfig
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    method = layer.routed_experts.quant_method
    quant = getattr(method, "moe_quant_config", None) or FusedMoEQuantConfig.make()
    config = ApplyMoEActivationConfig.from_configs(layer.moe_config, quant)
    cpu = getattr(method, "unquantized_backend", None) == UnquantizedMoeBackend.CPU
    return experts_activation(layer.activation.value, cpu, config.clamp_limit, config.alpha, config.beta)


# vLLM's CPU MoE kernels (csrc/cpu, ``prepack_moe_weight``) store each [N, K] expert matrix as [N / 16, K, 16]
# (16 output rows interleaved along K) or, for isa "amx" with bf16 / fp16 weights on a CPU with AMX, as
# [N / 16, K / 2, 16, 2] (K in pairs): rubin.moe's "vllm_cpu:<isa>" and "vllm_cpu:<isa>:vnni" layouts
# (ops/moe.py:pack_cpu_weight). Which one depends on the machine, so ``cpu_weight_layout`` runs vLLM's packing
# once per (isa, dtype, shape) and says which it wrote. vLLM's packing asserts N % 32 == 0 (and, for amx,
# K % 32 == 0) and aborts the process otherwise, so those shapes are never packed here.
_PACK_ALIGN = 32


@functools.lru_cache(maxsize=None)
def cpu_weight_layout(isa: str, dtype: torch.dtype, n: int, k: int) -> tuple[Optional[str], Optional[str]]:
    """(the ``rubin.moe`` weight layout vLLM's ``prepack_moe_weight(isa)`` writes for an ``[n, k]`` ``dtype``
    matrix on this machine, None), found by packing random data once; or (None, why it is no layout rubin
    knows)."""
    if n % _PACK_ALIGN or (isa == "amx" and k % _PACK_ALIGN):
        what = "N and K" if isa == "amx" else "N"
        return None, (
            f"vLLM's CPU MoE packing for isa={isa!r} needs {what} multiples of {_PACK_ALIGN} (it aborts "
            f"the process otherwise); got N={n}, K={k}"
        )
    prepack = getattr(getattr(torch.ops, "_C", None), "prepack_moe_weight", None)
    if prepack is None:
        return None, "vLLM's _C.prepack_moe_weight is not available to check the weight layout"
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(1, n, k, generator=gen).to(dtype)
        packed = torch.empty_like(w)
        try:
            prepack(w, packed, isa)
        except RuntimeError as exc:
            return None, f"prepack_moe_weight(isa={isa!r}) failed on this machine: {exc}"
        for layout in (WeightLayout("vllm_cpu", isa), WeightLayout("vllm_cpu", isa, vnni=True)):
            if torch.equal(pack_cpu_weight(w, layout.vnni), packed):
                return layout.encode(), None
    return None, (
        f"weights prepacked for isa={isa!r} ({dtype}) are in neither layout rubin knows how to unpack "
        f"({PLAIN_CPU.describe()}; {VNNI_CPU.describe()})"
    )


def cpu_pack_unsupported_reason(isa: str, dtype: torch.dtype, n: int, k: int) -> Optional[str]:
    """None if rubin knows the layout vLLM packs an ``[n, k]`` ``dtype`` matrix in for ``isa``; else why not."""
    return cpu_weight_layout(isa, dtype, n, k)[1]


def packed_weights_layout(isa: str, w13: Any, w2: Any) -> tuple[Optional[str], Optional[str]]:
    """(the layout of a layer's prepacked ``w13`` and ``w2`` (fake tensors will do), None), or (None, why)."""
    layouts = []
    for name, w in (("w13", w13), ("w2", w2)):
        layout, reason = cpu_weight_layout(isa, w.dtype, int(w.shape[1]), int(w.shape[2]))
        if reason is not None:
            return None, f"{name}: {reason}"
        layouts.append(layout)
    if layouts[0] != layouts[1]:
        return None, f"w13 and w2 are packed in different layouts ({layouts[0]}, {layouts[1]})"
    return layouts[0], None


# --------------------------------------------------------------------------------------------------
# What a vLLM MoE layer is, seen from rubin
# --------------------------------------------------------------------------------------------------


def layer_unsupported_reason(layer: Any, shared: bool) -> Optional[str]:
    """None if the ops above reproduce ``layer`` (a vLLM ``MoERunner``) exactly; else the reason."""
    from vllm.model_executor.layers.fused_moe.router.zero_expert_router import ZeroExpertRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    if not isinstance(layer, MoERunner):
        return f"layer is a {type(layer).__name__}, not vLLM's MoERunner"
    for method in ("_forward_impl", "_apply_quant_method"):
        if getattr(type(layer), method) is not getattr(MoERunner, method):
            return f"{type(layer).__name__} overrides MoERunner.{method}"
    experts = layer.routed_experts
    method = experts.quant_method
    if type(method) is not UnquantizedFusedMoEMethod:
        return f"quantised MoE method {type(method).__name__} (rubin.moe has no matching weight format yet)"
    cfg = layer.moe_config
    if cfg.is_lora_enabled:
        return "LoRA adapters on the experts"
    if cfg.use_ep or cfg.dp_size > 1 or cfg.pcp_size > 1 or cfg.is_sequence_parallel:
        return "expert / data / context parallel MoE (dispatch and combine stay with vLLM)"
    if getattr(layer, "expert_map", None) is not None:
        return "an expert map (expert parallelism)"
    if cfg.tp_size > 1 and layer._fused_output_is_reduced:
        return "the vLLM kernel all-reduces its own output under tensor parallelism"
    if getattr(experts, "apply_router_weight_on_input", False) and layer.router.top_k != 1:
        return (
            f"apply_router_weight_on_input with top-k {layer.router.top_k}: vLLM applies the router weight on the "
            "input for top-1 only (its prepare() asserts top_k == 1), so this layer does not run in vLLM either"
        )
    if isinstance(layer.router, ZeroExpertRouter):
        return "zero-expert routing"
    if getattr(experts, "expert_substitution", None) is not None:
        # vLLM 0.33's SubstitutedRoutedExperts (a config's approximate_experts / expert_substitution): the router
        # picks among all logical experts, the weights hold only the retained ones, and the experts' forward remaps
        # the routes and adds the substituted experts' constant outputs, which run_layer would skip
        return "expert substitution (some experts replaced by constant outputs; their routes are remapped by vLLM)"
    if getattr(layer.router, "eplb_state", None) is not None:
        return "EPLB (redundant experts)"
    if layer._fse_fuse_gate:
        return "router and shared-expert gates fused into one GEMM"
    if shared != (layer.shared_experts is not None):
        return "the op kind (moe_forward vs moe_forward_shared) does not match the layer's shared experts"
    reason = layer_activation(layer)[1]
    if reason is not None:
        return reason
    return _weights_unsupported_reason(experts)


def _weights_unsupported_reason(experts: Any) -> Optional[str]:
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    method = experts.quant_method
    backend = method.unquantized_backend
    w13 = experts.w13_weight
    if w13.dim() != 3 or experts.w2_weight.dim() != 3:
        return f"expert weights are not [E, N, K] (w13 {tuple(w13.shape)})"
    if backend == UnquantizedMoeBackend.TRITON:
        return None  # vLLM keeps the checkpoint layout: w13 [E, 2I, H] (gate rows, then up), w2 [E, H, I]
    if backend == UnquantizedMoeBackend.CPU:
        fused = method.moe_kernel.fused_experts if method.moe_kernel is not None else None
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        if not isinstance(fused, CPUUnquantizedExperts):
            return f"CPU experts {type(fused).__name__}"
        if getattr(fused, "_use_zentorch", False):
            return "zentorch MoE (its weight layout is zentorch's)"
        return packed_weights_layout(fused.isa, experts.w13_weight, experts.w2_weight)[1]
    return f"vLLM MoE backend {backend.value} re-lays out the expert weights in a way rubin does not undo"


def layer_expert_weights(
    layer: Any,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], str]:
    """The layer's (w13, w2, w13_bias, w2_bias, weight_layout) as stored, no copy: ``"plain"``, or
    ``"vllm_cpu:<isa>[:vnni]"`` where vLLM's CPU build prepacked them (rubin.moe's layouts)."""
    experts = layer.routed_experts
    return (
        experts.w13_weight,
        experts.w2_weight,
        getattr(experts, "w13_bias", None),
        getattr(experts, "w2_bias", None),
        layer_weight_layout(layer),
    )


def layer_weight_layout(layer: Any) -> str:
    """``rubin.moe``'s name for how ``layer`` stores its expert weights."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    experts = layer.routed_experts
    method = experts.quant_method
    if method.unquantized_backend == UnquantizedMoeBackend.CPU:
        layout, reason = packed_weights_layout(
            method.moe_kernel.fused_experts.isa, experts.w13_weight, experts.w2_weight
        )
        if layout is None:  # layer_unsupported_reason rejects such a layer before it is rewritten
            raise ValueError(f"rubin: vLLM layer {layer.layer_name}: {reason}")
        return layout
    return "plain"


def layer_on_input(layer: Any) -> bool:
    """Whether vLLM applies ``layer``'s router weights to the expert input (``apply_router_weight_on_input``: its
    prepare() multiplies the input by them and the experts do not weight their outputs)."""
    return bool(getattr(layer.routed_experts, "apply_router_weight_on_input", False))


def layer_details(layer: Any) -> dict[str, Any]:
    """Shapes and routing settings of a layer, for the rewrite report. ``activation`` is rubin.moe's (what the layer's
    experts compute; vLLM's name and constants are ``vllm_activation``)."""
    experts, router, cfg = layer.routed_experts, layer.router, layer.moe_config
    E, n13, H = experts.w13_weight.shape
    bias = getattr(router, "e_score_correction_bias", None)
    act = layer.activation
    activation = layer_activation(layer)[0]
    return {
        "layer": layer.layer_name,
        "E": int(E),
        "H": int(H),
        "I": int(n13) // 2 if act.is_gated else int(n13),
        "I_unpadded": cfg.intermediate_size_per_partition_unpadded,
        "k": router.top_k,
        "dtype": dtype_name(experts.w13_weight.dtype),
        "weight_layout": layer_weight_layout(layer),
        "activation": activation if activation is not None else act.value,
        "vllm_activation": {
            "activation": act.value,
            "swiglu_limit": cfg.swiglu_limit,
            "swiglu_alpha": cfg.swiglu_alpha,
            "swiglu_beta": cfg.swiglu_beta,
        },
        "apply_router_weight_on_input": layer_on_input(layer),
        "routing": {
            "scoring_func": getattr(router, "scoring_func", None),
            "renormalize": getattr(router, "renormalize", None),
            "use_grouped_topk": getattr(router, "use_grouped_topk", False),
            "num_expert_group": getattr(router, "num_expert_group", None),
            "topk_group": getattr(router, "topk_group", None),
            "e_score_correction_bias": None if bias is None else list(bias.shape),
            "routed_scaling_factor": getattr(router, "routed_scaling_factor", 1.0),
            "custom_routing_function": getattr(router, "custom_routing_function", None) is not None,
            "router": type(router).__name__,
        },
        "runner_routed_scaling_factor": layer.routed_scaling_factor,  # applied by vLLM outside the op
        "gate_in_layer": layer.gate is not None,
        "shared_experts": layer.shared_experts is not None,
        "biases": getattr(experts, "w13_bias", None) is not None,
        "vllm_backend": experts.quant_method.unquantized_backend.value,
        "tp_size": cfg.tp_size,
    }


def run_layer(
    layer: Any,
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    shared_experts_input: Optional[torch.Tensor],
    input_ids: Optional[torch.Tensor],
    impl: str,
    pdl: bool = False,
    placement: str = "",
) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """(shared_out or None, fused_out) of ``layer``, as the module docstring defines them. Bound to our Triton
    kernels, a call of a size at which vLLM's own fused MoE is the faster (kernels/triton/moe_choice.py: measured on
    this GPU, else by the rule) runs vLLM's own path instead (``vllm_forward``)."""
    if parse_impl(impl)[0] == "triton" and _vllm_is_faster(layer, hidden_states):
        return vllm_forward(layer, hidden_states, router_logits, shared_experts_input, input_ids)
    if layer.gate is not None:
        router_logits, _ = layer.gate(hidden_states)
    shared_out = None
    if layer.shared_experts is not None:
        assert shared_experts_input is not None
        shared_out = layer.shared_experts._layer(shared_experts_input)
    topk_weights, topk_ids = layer.router.select_experts(
        hidden_states=hidden_states,
        router_logits=router_logits,
        topk_indices_dtype=layer._quant_method.topk_indices_dtype,
        input_ids=input_ids,
    )
    w13, w2, b13, b2, layout = layer_expert_weights(layer)
    activation, reason = layer_activation(layer)
    if activation is None:  # layer_unsupported_reason keeps such a layer from being rewritten
        raise ValueError(f"rubin: vLLM layer {layer.layer_name}: {reason}")
    args = MoEArgs(
        hidden_states,
        w13,
        w2,
        topk_weights,
        topk_ids,
        activation,
        b13,
        b2,
        weight_layout=WeightLayout.decode(layout),
        apply_router_weight_on_input=layer_on_input(layer),
    )
    return shared_out, MOE.run(impl, args, Launch.decode(pdl, placement))


def _vllm_is_faster(layer: Any, hidden_states: torch.Tensor) -> bool:
    """Whether, for this call's number of tokens, vLLM's own fused MoE measured faster than our Triton kernels
    on this GPU (or, off the measured table, the rule says so: moe_choice.choose)."""
    experts = layer.routed_experts
    E, n13, H = experts.w13_weight.shape
    I = n13 // 2 if layer.activation.is_gated else n13
    name = moe_choice.device_name(hidden_states.device)
    wfmt = moe_choice.weight_format(experts.w13_weight.dtype, False)  # the matcher rewrites unquantised layers only
    T = hidden_states.shape[0]
    return moe_choice.choose(T, int(E), int(H), int(I), layer.router.top_k, wfmt, name, "vllm").kernel == "vllm"


def vllm_forward(
    layer: Any,
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    shared_experts_input: Optional[torch.Tensor],
    input_ids: Optional[torch.Tensor],
) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """(shared_out or None, fused_out) as vLLM's own ``moe_forward`` / ``moe_forward_shared`` compute them: the
    layer's ``_forward_impl``, which those ops call (vllm/model_executor/layers/fused_moe/runner/moe_runner.py). vLLM
    declares ``hidden_states`` mutated by that path (its fused experts may write their output in place); the ops
    here mutate nothing, so it gets a copy (T x H elements, against the MoE's own 6 T k H I FLOPs)."""
    result = layer._forward_impl(hidden_states.clone(), router_logits, shared_experts_input, input_ids)
    if layer.shared_experts is not None:
        shared_out, fused_out = result
        return shared_out, fused_out
    return None, result


def find_layer(name: str) -> Any:
    """The MoE layer named ``name``, as vLLM's ``moe_forward`` finds it at run time (the forward context)."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import get_layer_from_name

    return get_layer_from_name(name)


def compile_time_layer(name: str) -> tuple[Any, Optional[str]]:
    """(the layer called ``name``, None) from vLLM's forward context or, outside a forward (a graph compiled
    ahead of its first run), vLLM's current config; (None, why) when it is in neither."""
    layer = None
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if is_forward_context_available():
            layer = get_forward_context().no_compile_layers.get(name)
        if layer is None:
            from vllm.config import get_current_vllm_config

            layer = get_current_vllm_config().compilation_config.static_forward_context.get(name)
    except (ImportError, AssertionError, AttributeError):
        layer = None
    if layer is None:
        return None, (
            f"layer {name!r} is not in vLLM's forward context at compile time, so its settings cannot be checked"
        )
    return layer, None


def layer_name_value(layer_name: Any) -> str:
    """The string inside a vLLM ``LayerName`` (real or fake script object) or a plain ``str``."""
    real = getattr(layer_name, "real_obj", layer_name)
    return getattr(real, "value", real)


# --------------------------------------------------------------------------------------------------
# The ops (defined once vLLM's LayerName type exists)
# --------------------------------------------------------------------------------------------------

_defined = False


def define_ops() -> None:
    """Define ``rubin::vllm_moe_layer`` and ``rubin::vllm_moe_layer_shared``; needs vLLM; idempotent."""
    global _defined
    if _defined:
        return
    # vLLM's LayerName (a hoisted opaque type) on torch >= 2.11 with VLLM_USE_LAYERNAME=1, else str: the
    # type vllm.moe_forward's layer_name has, so a rewrite passes the very same graph input on.
    from vllm.utils.torch_utils import LayerNameType as LayerNameT

    def vllm_moe_layer(
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        shared_experts_input: Optional[torch.Tensor],
        input_ids: Optional[torch.Tensor],
        layer_name: Any,
        impl: str = "reference",
        pdl: bool = False,
        placement: str = "",
    ) -> torch.Tensor:
        layer = find_layer(layer_name_value(layer_name))
        return run_layer(layer, hidden_states, router_logits, shared_experts_input, input_ids, impl, pdl, placement)[1]

    def vllm_moe_layer_fake(
        hidden_states,
        router_logits,
        shared_experts_input,
        input_ids,
        layer_name,
        impl="reference",
        pdl=False,
        placement="",
    ):
        return torch.empty_like(hidden_states)

    def vllm_moe_layer_shared(
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        shared_experts_input: Optional[torch.Tensor],
        input_ids: Optional[torch.Tensor],
        layer_name: Any,
        impl: str = "reference",
        pdl: bool = False,
        placement: str = "",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = find_layer(layer_name_value(layer_name))
        shared, fused = run_layer(
            layer, hidden_states, router_logits, shared_experts_input, input_ids, impl, pdl, placement
        )
        return shared, fused

    def vllm_moe_layer_shared_fake(
        hidden_states,
        router_logits,
        shared_experts_input,
        input_ids,
        layer_name,
        impl="reference",
        pdl=False,
        placement="",
    ):
        shared_like = shared_experts_input if shared_experts_input is not None else hidden_states
        return torch.empty_like(shared_like), torch.empty_like(hidden_states)

    # This module uses postponed annotations; custom_op infers the schema from real types.
    args = {
        "hidden_states": torch.Tensor,
        "router_logits": torch.Tensor,
        "shared_experts_input": Optional[torch.Tensor],
        "input_ids": Optional[torch.Tensor],
        "layer_name": LayerNameT,
        "impl": str,
        "pdl": bool,
        "placement": str,
    }
    vllm_moe_layer.__annotations__ = {**args, "return": torch.Tensor}
    vllm_moe_layer_shared.__annotations__ = {**args, "return": tuple[torch.Tensor, torch.Tensor]}
    op = torch.library.custom_op("rubin::vllm_moe_layer", mutates_args=())(vllm_moe_layer)
    op.register_fake(vllm_moe_layer_fake)
    op_shared = torch.library.custom_op("rubin::vllm_moe_layer_shared", mutates_args=())(vllm_moe_layer_shared)
    op_shared.register_fake(vllm_moe_layer_shared_fake)
    _defined = True


def layer_spec(node: torch.fx.Node) -> KernelSpec:
    """The ``KernelSpec`` of a ``rubin.vllm_moe_layer*`` node, for selection: its weights live on the vLLM layer,
    not in the graph, and the matcher only rewrites unquantised layers (``layer_unsupported_reason``), so the
    weights have the activations' dtype. E, I, k, the activation and the weight layout are read off the layer
    the node names (absent when it cannot be found, as on a graph built by hand)."""
    args = bound_arguments(node)
    hidden = args["hidden_states"].meta.get("val") if isinstance(args["hidden_states"], torch.fx.Node) else None
    dtype = val_dtype(args["hidden_states"])
    ln = args["layer_name"]
    value = ln.meta.get("val") if isinstance(ln, torch.fx.Node) else ln
    name = layer_name_value(value) if value is not None else None
    layer = compile_time_layer(name)[0] if isinstance(name, str) else None
    details = layer_details(layer) if layer is not None else {}
    sizes = {
        "T": static_size(hidden, 0),
        "E": details.get("E"),
        "H": static_size(hidden, 1),
        "I": details.get("I"),
        "k": details.get("k"),
    }
    return KernelSpec(
        op="moe",
        quant="none",
        act_dtype=dtype,
        weight_dtype=dtype,
        shape=tuple((k, v) for k, v in sizes.items() if v is not None),
        node=node.name,
        activation=details.get("activation"),
        weight_layout=details.get("weight_layout", "plain"),
        features=call_features(bool(details.get("apply_router_weight_on_input")), False),
        baseline="vllm",
    )


# rubin.moe's kernels run these ops (selection binds their impl argument); their specs come from the layer.
MOE.add_form("rubin::vllm_moe_layer", layer_spec)
MOE.add_form("rubin::vllm_moe_layer_shared", layer_spec)
# vllm.utils.torch_utils defines and registers LayerName, the only vLLM name the schema needs.
after_import("vllm.utils.torch_utils", define_ops)
