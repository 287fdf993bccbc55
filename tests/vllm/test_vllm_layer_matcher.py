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


# ---- near-misses --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        # (no activation near-miss: vLLM's CPU build has no backend for the activations rubin.moe lacks)
        (dict(top_k=1, apply_router_weight_on_input=True), "apply_router_weight_on_input"),
    ],
    ids=["router-weight-on-input"],
)
def test_unsupported_layer_left_unchanged(make_layer, vllm_config, kwargs, reason):
    layer = make_layer(op_form=True, **kwargs)
    x, logits = fresh_inputs(layer, torch.float32)
    run, rec = compile_layer(layer, vllm_config, x, logits)
    assert rec.after[VLLM_MOE] == 1 and rec.after[RUBIN_LAYER] == 0
    (u,) = rec.match_moe()["unchanged"]
    assert reason in u["reason"]
    x, logits = fresh_inputs(layer, torch.float32)
    assert_close(run(x, logits), run_eager(layer, vllm_config, x, logits))


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

    layer = make_layer(op_form=True, top_k=1, apply_router_weight_on_input=True)
    x, logits = fresh_inputs(layer, torch.float32)
    with pytest.raises(Exception) as info:
        compile_layer(layer, vllm_config, x, logits, options={"strict": True})
    assert _caused_by(info.value, RubinStrictError)
    assert "apply_router_weight_on_input" in str(info.value) and "strict" in str(info.value)
