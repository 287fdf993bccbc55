"""match_moe/vllm_layer.py on real vLLM MoE layers in the form vLLM uses on GPUs: the runner calls the opaque
``vllm.moe_forward`` / ``vllm.moe_forward_shared`` op (as ``MoERunner._select_forward`` picks on CUDA),
whose weights and routing live on the layer. Built and run on the CPU with vLLM's CPU experts and router.

What only a GPU can check is listed in docs/vllm.md ("Checked only on a GPU").
"""

from __future__ import annotations

import pytest
import torch

from rubin_compile.ops.moe import moe_reference
from rubin_compile.integrations.vllm.layer_ops import layer_expert_weights
from tests.vllm.harness import assert_close, assert_close_to_reference, compile_layer, run_eager

VLLM_MOE = "vllm::moe_forward"
VLLM_MOE_SHARED = "vllm::moe_forward_shared"
RUBIN_LAYER = "rubin::vllm_moe_layer"
RUBIN_LAYER_SHARED = "rubin::vllm_moe_layer_shared"
DTYPES = [torch.float32, torch.bfloat16]

ROUTINGS = {
    "softmax-renormalize": dict(),
    "softmax-no-renormalize": dict(renormalize=False),
    "sigmoid-grouped-bias-scaled": dict(
        use_grouped_topk=True,
        num_expert_group=4,
        topk_group=2,
        scoring_func="sigmoid",
        routed_scaling_factor=2.5,
        e_score_correction_bias="random",
    ),
    "softmax-grouped": dict(use_grouped_topk=True, num_expert_group=2, topk_group=1),
}


def routing_kwargs(name):
    kw = dict(ROUTINGS[name])
    if kw.get("e_score_correction_bias") == "random":
        kw["e_score_correction_bias"] = torch.randn(8) * 0.1
    return kw


def fresh_inputs(layer, dtype, tokens=7):
    return (
        torch.randn(tokens, layer.moe_config.hidden_dim, dtype=dtype),
        torch.randn(tokens, layer.moe_config.num_experts, dtype=dtype),
    )


def check(layer, vllm_config, dtype, shared=False, af_v2=False):
    x, logits = fresh_inputs(layer, dtype)
    run, rec = compile_layer(layer, vllm_config, x, logits, af_v2=af_v2)
    before, after = (VLLM_MOE_SHARED, RUBIN_LAYER_SHARED) if shared else (VLLM_MOE, RUBIN_LAYER)
    assert rec.before[before] == 1 and rec.before[after] == 0
    assert rec.after[before] == 0 and rec.after[after] == 1, dict(rec.after)
    assert rec.match_moe()["unchanged"] == []
    assert_close_to_reference(layer, vllm_config, run, dtype, lambda: fresh_inputs(layer, dtype))
    (rewrite,) = rec.match_moe()["rewrites"]
    return rewrite["details"], run


@pytest.mark.parametrize("af_v2", [False, True], ids=["auto_functionalized", "auto_functionalized_v2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_moe_forward(make_layer, vllm_config, dtype, af_v2):
    layer = make_layer(dtype=dtype, op_form=True, intermediate_size=40)
    d, _ = check(layer, vllm_config, dtype, af_v2=af_v2)
    assert (d["E"], d["H"], d["I"], d["I_unpadded"], d["k"]) == (8, 64, 64, 40, 2)
    assert d["layer"] == layer.layer_name and d["op"] == VLLM_MOE
    assert d["auto_functionalized"] == ("v2" if af_v2 else "v1")
    assert d["routing"]["scoring_func"] == "softmax" and d["routing"]["renormalize"] is True


@pytest.mark.parametrize("shared", [False, True], ids=["moe_forward", "moe_forward_shared"])
def test_whole_pipeline_runs_vllm_cpu_kernel_on_the_layer_weights(make_layer, vllm_config, shared):
    """Every pass on: select_kernels reads E / H / I / k / activation / weight layout the matcher took off
    the layer, and binds vLLM's own CPU kernel to its prepacked weights (no copy per call); the result
    equals the block compiled without rubin."""
    from rubin_compile.passes import PASS_NAMES

    dtype = torch.bfloat16
    layer = make_layer(dtype=dtype, op_form=True, intermediate_size=40, shared=shared)
    x, logits = fresh_inputs(layer, dtype)
    run, rec = compile_layer(layer, vllm_config, x, logits, options={"passes": list(PASS_NAMES)})
    (plan,) = [pl for p in rec.report["passes"] if p["name"] == "select_kernels" for pl in p["plans"]]
    assert plan["impl"] == "vllm_cpu@cpu", plan
    # vllm_cpu:vec, or vllm_cpu:amx:vnni (bf16 on a CPU with AMX): the layout of the layer's weights as stored
    assert plan["spec"]["weight_layout"] == layer_expert_weights(layer)[4]
    assert plan["spec"]["shape"]["I"] == 64  # vLLM padded 40
    inputs = [fresh_inputs(layer, dtype) for _ in range(2)]
    got = [run(*i) for i in inputs]
    plain, _ = compile_layer(layer, vllm_config, x, logits, options={"passes": []})
    for i, g in zip(inputs, got):
        assert torch.equal(g, plain(*i))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_routing_settings(make_layer, vllm_config, dtype, routing):
    """Routing is computed from the layer's settings at run time; the report records them, and a plain
    PyTorch routing written from the report alone reproduces the rewritten layer's output."""
    layer = make_layer(dtype=dtype, op_form=True, **routing_kwargs(routing))
    d, run = check(layer, vllm_config, dtype)
    r, router = d["routing"], layer.router
    assert (r["scoring_func"], r["renormalize"], r["use_grouped_topk"]) == (
        router.scoring_func,
        router.renormalize,
        router.use_grouped_topk,
    )
    assert (r["num_expert_group"], r["topk_group"], r["routed_scaling_factor"]) == (
        router.num_expert_group,
        router.topk_group,
        router.routed_scaling_factor,
    )
    assert (r["e_score_correction_bias"] is not None) == (router.e_score_correction_bias is not None)

    x, logits = fresh_inputs(layer, dtype)
    normed = torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=1e-6)  # what Block hands the layer
    weights, ids = reference_routing(d, logits, router.e_score_correction_bias)
    w13, w2, _, _, layout = layer_expert_weights(layer)  # as stored: vLLM's CPU build prepacks them
    assert layout == d["weight_layout"] and layout.startswith("vllm_cpu:")
    assert_close(run(x, logits), moe_reference(normed, w13, w2, weights, ids, d["activation"], weight_layout=layout))


def reference_routing(details, logits, correction_bias):
    """Plain PyTorch routing from the reported settings (vLLM's semantics, written out)."""
    r, k = details["routing"], details["k"]
    logits = logits.float()
    scores = torch.softmax(logits, -1) if r["scoring_func"] == "softmax" else torch.sigmoid(logits)
    if r["use_grouped_topk"]:
        T, E = scores.shape
        select = scores + correction_bias if r["e_score_correction_bias"] is not None else scores
        grouped = select.view(T, r["num_expert_group"], -1)
        group_score = (
            grouped.topk(2, -1).values.sum(-1) if r["e_score_correction_bias"] is not None else grouped.max(-1).values
        )
        keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(r["topk_group"], -1).indices, 1)
        masked = select.masked_fill(~keep.repeat_interleave(E // r["num_expert_group"], 1).bool(), float("-inf"))
        ids = masked.topk(k, -1).indices
        weights = scores.gather(1, ids)
        if r["renormalize"]:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights * r["routed_scaling_factor"]
    else:
        weights, ids = scores.topk(k, -1)
        if r["renormalize"]:
            weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_moe_forward_shared(make_layer, vllm_config, dtype):
    """Shared experts stay correct: the shared output comes from the layer's own shared-expert module."""
    layer = make_layer(dtype=dtype, op_form=True, shared=True)
    d, _ = check(layer, vllm_config, dtype, shared=True)
    assert d["shared_experts"] and d["op"] == VLLM_MOE_SHARED


@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu", "swigluoai"])
def test_biases_and_activations(make_layer, vllm_config, activation):
    """Biased experts with each gated activation vLLM and rubin.moe share; swigluoai (GPT-OSS: interleaved gate /
    up rows, clamped at 7) with weights large enough that the clamps bite."""
    layer = make_layer(
        op_form=True, has_bias=True, activation=activation, weight_std=0.1 if activation != "swigluoai" else 1.0
    )
    d, _ = check(layer, vllm_config, torch.float32)
    assert d["biases"] and d["activation"] == activation


def test_op_matches_vllm_op(make_layer, vllm_config):
    """rubin.vllm_moe_layer called directly returns what vllm.moe_forward returns (fresh inputs)."""
    from vllm.forward_context import set_forward_context

    layer = make_layer(op_form=True, shared=True)
    name = layer._encode_layer_name()
    x, logits = fresh_inputs(layer, torch.float32)
    with torch.no_grad(), set_forward_context(None, vllm_config):
        ours = torch.ops.rubin.vllm_moe_layer_shared(x, logits, x, None, name)
        theirs = torch.ops.vllm.moe_forward_shared(x.clone(), logits, x, None, name, 0)
    for a, b in zip(ours, theirs):
        assert_close(a, b)


@pytest.mark.parametrize("shared", [False, True], ids=["moe_forward", "moe_forward_shared"])
def test_triton_bound_layer_runs_vllms_own_fused_moe_at_prefill_sizes(make_layer, vllm_config, shared):
    """Bound to our Triton kernels (a GPU plan), a call of more tokens than moe_choice gives ours against vLLM's fused
    MoE runs vLLM's own path, the layer's _forward_impl: here on the CPU that is vLLM's CPU experts, so the result
    equals vllm.moe_forward's, and the input is left as it was (vLLM's path gets a copy). A decode-sized call goes
    to our kernels, which this machine cannot run: the error names them."""
    from vllm.forward_context import set_forward_context

    from rubin_compile.kernels.triton.moe_choice import VLLM_RULE_MAX_T
    from rubin_compile.ops.registry import KernelUnavailableError

    layer = make_layer(op_form=True, shared=shared)
    name = layer._encode_layer_name()
    x, logits = fresh_inputs(layer, torch.float32, tokens=VLLM_RULE_MAX_T + 1)
    x_before = x.clone()
    ours_op = torch.ops.rubin.vllm_moe_layer_shared if shared else torch.ops.rubin.vllm_moe_layer
    theirs_op = torch.ops.vllm.moe_forward_shared if shared else torch.ops.vllm.moe_forward
    with torch.no_grad(), set_forward_context(None, vllm_config):
        args = (x, logits, x if shared else None, None, name)
        ours = ours_op(*args, "triton@sm90")
        theirs = theirs_op(x.clone(), *args[1:], 0)
        assert torch.equal(x, x_before)
        for a, b in zip(ours if shared else [ours], theirs if shared else [theirs]):
            assert_close(a, b)
        with pytest.raises(KernelUnavailableError, match="'triton'"):
            ours_op(
                x[:VLLM_RULE_MAX_T],
                logits[:VLLM_RULE_MAX_T],
                x[:VLLM_RULE_MAX_T] if shared else None,
                None,
                name,
                "triton@sm90",
            )


def llama4_layer(make_layer, dtype, **kw):
    """Llama 4's MoE layer as vllm/model_executor/models/llama4.py builds it: top-1 of the logits then sigmoid (its
    custom routing function), no renormalisation, the router weight on the expert input."""
    from vllm.model_executor.models.llama4 import Llama4MoE

    return make_layer(
        dtype=dtype,
        op_form=True,
        top_k=1,
        custom_routing_function=Llama4MoE.custom_routing_function,
        renormalize=False,
        apply_router_weight_on_input=True,
        **kw,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_router_weight_on_input(make_layer, vllm_config, dtype):
    """Llama 4's layer: rubin.vllm_moe_layer runs rubin.moe with apply_router_weight_on_input (the product in the
    input's dtype, as vLLM's prepare() computes it); against vLLM eager (fp32) and Inductor alone (bf16), and a
    plain restatement from the layer's own routing: FFN(w * x), which is not w * FFN(x)."""
    layer = llama4_layer(make_layer, dtype)
    d, run = check(layer, vllm_config, dtype)
    assert d["apply_router_weight_on_input"] is True and d["k"] == 1 and d["routing"]["custom_routing_function"]
    x, logits = fresh_inputs(layer, dtype)
    normed = torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=1e-6)
    weights = torch.sigmoid(logits.float().topk(1, -1).values)
    ids = logits.float().topk(1, -1).indices
    w13, w2, _, _, layout = layer_expert_weights(layer)
    on_input = moe_reference(normed, w13, w2, weights, ids, weight_layout=layout, apply_router_weight_on_input=True)
    assert_close(run(x, logits), on_input)
    on_output = moe_reference(normed, w13, w2, weights, ids, weight_layout=layout)
    assert (on_input.float() - on_output.float()).abs().max() > 0.05 * on_input.float().abs().max()


def test_router_weight_on_input_whole_pipeline_binds_vllm_cpu_kernel(make_layer, vllm_config):
    """Every pass on: the layer's spec carries the feature, vLLM's CPU kernel declares it for top-1 (scaling the
    input as vLLM's prepare() does) and is chosen; the result equals the block compiled without rubin, bit for bit."""
    from rubin_compile.passes import PASS_NAMES

    dtype = torch.bfloat16
    layer = llama4_layer(make_layer, dtype)
    x, logits = fresh_inputs(layer, dtype)
    run, rec = compile_layer(layer, vllm_config, x, logits, options={"passes": list(PASS_NAMES)})
    (plan,) = [pl for p in rec.report["passes"] if p["name"] == "select_kernels" for pl in p["plans"]]
    assert plan["impl"] == "vllm_cpu@cpu", plan
    assert list(plan["spec"]["features"]) == ["router_weight_on_input"], plan["spec"]
    inputs = [fresh_inputs(layer, dtype) for _ in range(2)]
    got = [run(*i) for i in inputs]
    plain, _ = compile_layer(layer, vllm_config, x, logits, options={"passes": []})
    for i, g in zip(inputs, got):
        assert torch.equal(g, plain(*i))


def test_router_weight_on_input_left_to_vllm_on_a_gpu_target(make_layer, vllm_config):
    """Planned for sm90 in bf16: no GPU kernel of rubin.moe declares the router weight on the input, so only the
    reference (a loop over the experts) would run the layer; vLLM's fused MoE keeps it, with the reason."""
    layer = llama4_layer(make_layer, torch.bfloat16)
    x, logits = fresh_inputs(layer, torch.bfloat16)
    _, rec = compile_layer(layer, vllm_config, x, logits, options={"target": "sm90"}, stop=True)
    assert rec.after[VLLM_MOE] == 1 and rec.after[RUBIN_LAYER] == 0
    (u,) = rec.match_moe()["unchanged"]
    assert "only the reference implements router_weight_on_input" in u["reason"], u


# ---- near-misses --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, experts_attrs, reason",
    [
        # vLLM's CPU experts call cpu_fused_moe(act="silu") and pass no clamp: the layer runs unclamped in vLLM
        (
            dict(swiglu_limit=2.0, weight_std=1.0),
            {},
            "swiglu_limit=2.0 set on a layer whose activation 'silu' vLLM's CPU",
        ),
        (dict(swiglu_alpha=1.5, activation="gelu"), {}, "swiglu_alpha=1.5 set on a layer whose activation 'gelu'"),
        # vLLM 0.33 replaces some experts of a model whose config asks it (approximate_experts / expert_substitution)
        # by constant outputs: its SubstitutedRoutedExperts stores only the retained experts' weights and remaps the
        # router's ids in its forward, so the layer op would hand logical ids to compact weights. vLLM 0.32
        # (installed here) has no substitution: the experts are marked the way 0.33's class marks them (its
        # ``expert_substitution`` attribute, what the check reads)
        (dict(), {"expert_substitution": object()}, "expert substitution"),
    ],
    ids=["silu-swiglu-limit-on-cpu", "gelu-alpha", "vllm-0.33-expert-substitution"],
)
def test_unsupported_layer_left_unchanged(make_layer, vllm_config, kwargs, experts_attrs, reason):
    layer = make_layer(op_form=True, **kwargs)
    for name, value in experts_attrs.items():
        setattr(layer.routed_experts, name, value)
    x, logits = fresh_inputs(layer, torch.float32)
    run, rec = compile_layer(layer, vllm_config, x, logits)
    assert rec.after[VLLM_MOE] == 1 and rec.after[RUBIN_LAYER] == 0
    (u,) = rec.match_moe()["unchanged"]
    assert reason in u["reason"], u
    x, logits = fresh_inputs(layer, torch.float32)
    assert_close(run(x, logits), run_eager(layer, vllm_config, x, logits))


def test_vllm_cpu_runs_swiglu_limit_unclamped(make_layer, vllm_config):
    """The fact the first near-miss rests on: vLLM 0.32's CPU experts compute a swiglu_limit layer's SiLU without
    the clamp (what the layer's config asks for, silu_clamp, differs from what vLLM computes)."""
    from vllm.forward_context import set_forward_context

    layer = make_layer(swiglu_limit=2.0, weight_std=1.0)
    x, logits = fresh_inputs(layer, torch.float32)
    with torch.no_grad(), set_forward_context(None, vllm_config):
        out = layer(x.clone(), logits)
        weights, ids = layer.router.select_experts(hidden_states=x, router_logits=logits)
    w13, w2, _, _, layout = layer_expert_weights(layer)
    assert_close(out, moe_reference(x, w13, w2, weights, ids, "silu", weight_layout=layout))
    clamped = moe_reference(x, w13, w2, weights, ids, "silu_clamp:2.0", weight_layout=layout)
    assert (out - clamped).abs().max() > 0.1 * out.abs().max()


def test_router_weight_on_input_top2_left_unchanged(make_layer, vllm_config):
    """vLLM applies the router weight on the input for top-1 only (prepare() asserts): a top-2 layer does not run in
    vLLM, and rubin does not make it run something else."""
    layer = make_layer(op_form=True, top_k=2, apply_router_weight_on_input=True)
    x, logits = fresh_inputs(layer, torch.float32)
    _, rec = compile_layer(layer, vllm_config, x, logits, stop=True)
    (u,) = rec.match_moe()["unchanged"]
    assert "apply_router_weight_on_input with top-k 2" in u["reason"] and "top-1 only" in u["reason"]


def test_mutated_input_read_after_call_left_unchanged(make_layer, vllm_config):
    """The layer handed a graph input: ``moe_forward``'s declared mutation of hidden_states is copied back
    to the caller's tensor (an extra user of the mutated value), which a functional op cannot do."""
    layer = make_layer(op_form=True)
    x, logits = fresh_inputs(layer, torch.float32)
    _, rec = compile_layer(layer, vllm_config, x, logits, norm=False)
    assert rec.after[VLLM_MOE] == 1 and rec.after[RUBIN_LAYER] == 0
    (u,) = rec.match_moe()["unchanged"]
    assert "extra user of the mutated hidden_states" in u["reason"]


def test_layer_not_found_left_unchanged(make_layer, vllm_config):
    layer = make_layer(op_form=True)
    x, logits = fresh_inputs(layer, torch.float32)
    _, rec = compile_layer(layer, vllm_config, x, logits, forward_context=False, stop=True)
    (u,) = rec.match_moe()["unchanged"]
    assert layer.layer_name in u["reason"] and "forward context" in u["reason"]


def test_strict_mode_fails_clearly(make_layer, vllm_config):
    from rubin_compile.passes.base import RubinStrictError
    from tests.vllm.harness import _caused_by

    layer = make_layer(op_form=True, swiglu_limit=2.0)
    x, logits = fresh_inputs(layer, torch.float32)
    with pytest.raises(Exception) as info:
        compile_layer(layer, vllm_config, x, logits, options={"strict": True})
    assert _caused_by(info.value, RubinStrictError)
    assert "swiglu_limit=2.0" in str(info.value) and "strict" in str(info.value)


# ---- the activation a layer's experts compute, in rubin.moe's terms ------------------------------------------------
#
# vLLM's CPU build constructs no layer with swigluoai_uninterleave, swiglustep or a _no_mul activation ("No
# Unquantized MoE backend supports the deployment configuration"; "is_act_and_mul=False is supported only for CUDA,
# XPU and ROCm"), and its CPU experts ignore swiglu_limit: what the Triton experts compute for them is checked here
# activation by activation, against vLLM's own implementations of what its fused MoE calls (the torch paths of
# apply_moe_activation where it has them, else the CustomOps' forward_native of the same functions), on
# pre-activations large enough that every clamp bites.


def vllm_triton_activation(activation, limit=None, alpha=1.0, beta=0.0):
    """What vLLM's Triton experts' activation step computes on a gate-up product (experts/triton_moe.py
    TritonExperts.activation -> activation.py apply_moe_activation), written with vLLM's own functions."""
    from vllm.model_executor.layers.activation import SiluAndMulWithClamp, SwigluOAIAndMul, SwigluStepAndMul
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation, apply_moe_activation
    from vllm.model_executor.layers.fused_moe.utils import _swiglu_limit_torch

    def run(x):
        act = MoEActivation.from_str(activation)
        out = torch.empty(x.shape[0], x.shape[1] // 2 if act.is_gated else x.shape[1], dtype=x.dtype)
        if act == MoEActivation.SILU and limit is not None:
            _swiglu_limit_torch(out, x, limit)  # swiglu_limit_func off CUDA; silu_and_mul_with_clamp(limit, 1, 0) on it
            return out
        if act == MoEActivation.SWIGLUOAI_UNINTERLEAVE:  # torch.ops._C.silu_and_mul_with_clamp(limit, alpha, beta)
            return SiluAndMulWithClamp(limit, alpha, beta).forward_native(x)
        if act == MoEActivation.SWIGLUSTEP:  # swiglustep_and_mul_triton(output, input): its default limit
            return SwigluStepAndMul(7.0).forward_native(x)
        if act == MoEActivation.SWIGLUOAI:  # torch.ops._C.swigluoai_and_mul(output, input): 1.702 / 7.0
            return SwigluOAIAndMul().forward_native(x)
        return apply_moe_activation(act, out, x.clone())  # silu / gelu / gelu_tanh (_C ops), the _no_mul ones (torch)

    return run


@pytest.mark.parametrize(
    "vllm, constants, rubin",
    [
        ("silu", dict(), "silu"),
        ("gelu", dict(), "gelu"),
        ("gelu_tanh", dict(), "gelu_tanh"),
        ("swigluoai", dict(), "swigluoai"),
        ("silu", dict(limit=3.0), "silu_clamp:3.0"),
        ("swigluoai_uninterleave", dict(limit=5.0, alpha=1.5, beta=1.0), "swigluoai_uninterleave:1.5:5.0"),
        ("swigluoai_uninterleave", dict(limit=7.0, alpha=1.702, beta=1.0), "swigluoai_uninterleave"),
        ("swiglustep", dict(), "swiglustep"),
        ("swiglustep", dict(limit=7.0), "swiglustep"),
        ("silu_no_mul", dict(), "silu_no_mul"),
        ("gelu_no_mul", dict(), "gelu_no_mul"),
        ("gelu_tanh_no_mul", dict(), "gelu_tanh_no_mul"),
        ("relu2_no_mul", dict(), "relu2_no_mul"),
    ],
)
def test_triton_experts_activation_is_rubin_moe_s(vllm_config, vllm, constants, rubin):
    from vllm.config import set_current_vllm_config

    from rubin_compile.integrations.vllm.layer_ops import experts_activation
    from rubin_compile.ops.moe import apply_activation

    name, reason = experts_activation(vllm, cpu=False, **constants)
    assert (name, reason) == (rubin, None)
    x = torch.randn(33, 96) * 6.0  # |x| > 7 for a quarter of the entries: the clamps bite
    with set_current_vllm_config(vllm_config):
        want = vllm_triton_activation(vllm, **constants)(x)
    assert_close(apply_activation(x, name), want)


@pytest.mark.parametrize(
    "vllm, cpu, constants, reason",
    [
        ("silu", True, dict(limit=2.0), "swiglu_limit=2.0 set on a layer whose activation 'silu' vLLM's CPU experts"),
        ("swigluoai", True, dict(limit=5.0), "swiglu_limit=5.0"),
        ("gelu", False, dict(limit=3.0), "swiglu_limit=3.0 set on a layer whose activation 'gelu' vLLM's fused MoE"),
        ("silu", False, dict(limit=3.0, alpha=2.0), "swiglu_alpha=2.0"),
        ("swiglustep", False, dict(limit=5.0), "it runs swiglustep at {'limit': 7.0}"),
        ("swigluoai", False, dict(limit=7.0, alpha=1.25), "swiglu_alpha=1.25"),
        ("swigluoai_uninterleave", False, dict(limit=7.0, alpha=1.702, beta=0.0), "swiglu_beta=0.0"),
        ("swigluoai_uninterleave", False, dict(), "without a swiglu_limit"),
        ("silu", False, dict(limit=-1.0), "limit > 0"),
        ("situ", False, dict(), "activation 'situ' (rubin.moe implements"),
        ("relu2", False, dict(), "activation 'relu2' (rubin.moe implements"),
        ("swiglustep", True, dict(), "activation 'swiglustep' (vLLM's CPU experts build"),
    ],
)
def test_activations_left_to_vllm_say_why(vllm, cpu, constants, reason):
    from rubin_compile.integrations.vllm.layer_ops import experts_activation

    name, why = experts_activation(vllm, cpu=cpu, **constants)
    assert name is None and reason in why, why


def test_a_gpt_oss_layer_with_its_own_constants_stated_keeps_swigluoai():
    """swigluoai with GPT-OSS's constants stated (1.702, 7.0, up + 1) is what vLLM's kernel runs anyway."""
    from rubin_compile.integrations.vllm.layer_ops import experts_activation

    assert experts_activation("swigluoai", cpu=False, limit=7.0, alpha=1.702, beta=1.0) == ("swigluoai", None)
