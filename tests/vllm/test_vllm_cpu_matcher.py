"""match_moe/vllm_cpu.py on the real form: vLLM's CPU MoE layers (router + ``_C.cpu_fused_moe``), compiled
by Inductor with rubin's vLLM pass, against the same layer run eagerly by vLLM."""

from __future__ import annotations

import pytest
import torch

from tests.vllm.harness import assert_close, assert_close_to_reference, compile_layer, set_call_kwarg
from rubin_compile.integrations.vllm.layer_ops import (
    cpu_pack_unsupported_reason,
    cpu_weight_layout,
    layer_expert_weights,
)
from rubin_compile.ops.moe import pack_cpu_weight, unpack_cpu_weight

CPU_MOE = "_C::cpu_fused_moe"
RUBIN_MOE = "rubin::moe"
DTYPES = [torch.float32, torch.bfloat16]


def fresh_inputs(layer, dtype, tokens=7):
    H = layer.moe_config.hidden_dim
    E = layer.moe_config.num_experts
    return torch.randn(tokens, H, dtype=dtype), torch.randn(tokens, E, dtype=dtype)


def check_rewritten_and_close(layer, vllm_config, dtype, af_v2=False):
    x, logits = fresh_inputs(layer, dtype)
    run, rec = compile_layer(layer, vllm_config, x, logits, af_v2=af_v2)
    assert rec.before[CPU_MOE] == 1 and rec.before[RUBIN_MOE] == 0
    assert rec.after[CPU_MOE] == 0 and rec.after[RUBIN_MOE] == 1
    # fresh inputs, not the ones it was compiled with
    assert_close_to_reference(layer, vllm_config, run, dtype, lambda: fresh_inputs(layer, dtype))
    (rewrite,) = rec.match_moe()["rewrites"]
    assert rewrite["source_idiom"] == "vllm _C.cpu_fused_moe"
    assert rec.match_moe()["unchanged"] == []
    return rewrite["details"]


@pytest.mark.parametrize("af_v2", [False, True], ids=["auto_functionalized", "auto_functionalized_v2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax_topk_layer(make_layer, vllm_config, dtype, af_v2):
    # intermediate 40 is padded to 64 by vLLM's CPU experts: the padding must stay inert.
    layer = make_layer(dtype=dtype, intermediate_size=40)
    d = check_rewritten_and_close(layer, vllm_config, dtype, af_v2)
    assert (d["E"], d["H"], d["I"], d["k"], d["activation"]) == (8, 64, 64, 2, "silu")
    assert d["dtype"] == str(dtype).replace("torch.", "")
    assert d["auto_functionalized"] == ("v2" if af_v2 else "v1")
    assert d["routing"]["recognised"] and d["routing"]["order"] == "topk_then_softmax"
    assert d["routing"]["top_k"] == 2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "routing",
    [
        dict(renormalize=False),
        dict(
            use_grouped_topk=True,
            num_expert_group=4,
            topk_group=2,
            scoring_func="sigmoid",
            e_score_correction_bias=torch.randn(8),
            routed_scaling_factor=2.5,
        ),
        dict(use_grouped_topk=True, num_expert_group=2, topk_group=1, scoring_func="softmax"),
    ],
    ids=["softmax-no-renormalize", "sigmoid-grouped-bias-scaled", "softmax-grouped"],
)
def test_other_routing(make_layer, vllm_config, dtype, routing):
    """The routing stays in the graph (only the experts are rewritten); whatever it is, results hold."""
    layer = make_layer(dtype=dtype, **routing)
    check_rewritten_and_close(layer, vllm_config, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_biases_and_gelu_tanh(make_layer, vllm_config, dtype):
    layer = make_layer(dtype=dtype, has_bias=True, activation="gelu_tanh")
    d = check_rewritten_and_close(layer, vllm_config, dtype)
    assert d["biases"] and d["activation"] == "gelu_tanh"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_router_weight_on_input(make_layer, vllm_config, dtype):
    """top-1 with the router weight applied to the input (Llama 4; vLLM's prepare() multiplies the input in the graph,
    the kernel runs with skip_weighted=True): rubin.moe takes that input with weights of one."""
    layer = make_layer(top_k=1, apply_router_weight_on_input=True, dtype=dtype)
    d = check_rewritten_and_close(layer, vllm_config, dtype)
    assert d["skip_weighted"] and d["k"] == 1
    assert "applied by vLLM's prepare() to the input" in d["router_weight_on_input"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swigluoai_layer(make_layer, vllm_config, dtype):
    """GPT-OSS's activation on vLLM's CPU experts (biases; weights large enough that the clamps at 7 bite):
    act='swigluoai' is rubin.moe's swigluoai (interleaved gate / up rows, 1.702 / 7.0)."""
    layer = make_layer(dtype=dtype, has_bias=True, activation="swigluoai", weight_std=1.0)
    d = check_rewritten_and_close(layer, vllm_config, dtype)
    assert d["activation"] == "swigluoai" and d["biases"]


def test_erf_gelu_rewritten(make_layer, vllm_config):
    """vLLM's CPU kernel runs erf GELU for act='gelu', as rubin.moe's "gelu" does."""
    layer = make_layer(activation="gelu")
    d = check_rewritten_and_close(layer, vllm_config, torch.float32)
    assert d["activation"] == "gelu"


# ---- near-misses: recognised, left unchanged, with the reason recorded ---------------------------------


@pytest.mark.parametrize(
    "edit, reason",
    [
        (set_call_kwarg(CPU_MOE, act="swiglustep"), "act='swiglustep'"),
        (set_call_kwarg(CPU_MOE, isa="neon"), "isa='neon'"),
    ],
    ids=["wrong-activation", "unverified-weight-packing"],
)
def test_edited_real_graph_left_unchanged(make_layer, vllm_config, edit, reason):
    layer = make_layer()
    x, logits = fresh_inputs(layer, torch.float32)
    _, rec = compile_layer(layer, vllm_config, x, logits, edit=edit, stop=True)
    assert rec.after[CPU_MOE] == 1 and rec.after[RUBIN_MOE] == 0
    (u,) = rec.match_moe()["unchanged"]
    assert reason in u["reason"]


def test_mixed_dtypes_left_unchanged(make_layer, vllm_config):
    """bf16 activations into fp32 expert weights: rubin.moe wants one dtype, so the call stays."""

    def to_bf16_input(graph):
        from tests.vllm.harness import op_name

        call = next(n for n in graph.nodes if op_name(n) == CPU_MOE)
        key = "input"
        with graph.inserting_before(call):
            cast = graph.call_function(torch.ops.prims.convert_element_type.default, (call.kwargs[key], torch.bfloat16))
            cast.meta["val"] = call.kwargs[key].meta["val"].to(torch.bfloat16)
        call.kwargs = {**call.kwargs, key: cast}

    layer = make_layer()
    x, logits = fresh_inputs(layer, torch.float32)
    _, rec = compile_layer(layer, vllm_config, x, logits, edit=to_bf16_input, stop=True)
    (u,) = rec.match_moe()["unchanged"]
    assert "mixed dtypes" in u["reason"] and "input bfloat16" in u["reason"] and "w13 float32" in u["reason"]


def test_strict_mode_fails_clearly(make_layer, vllm_config):
    from tests.vllm.harness import _caused_by
    from rubin_compile.passes.base import RubinStrictError

    layer = make_layer()
    x, logits = fresh_inputs(layer, torch.float32)
    with pytest.raises(Exception) as info:
        edit = set_call_kwarg(CPU_MOE, isa="neon")  # a weight packing rubin has not verified
        compile_layer(layer, vllm_config, x, logits, edit=edit, options={"strict": True})
    assert _caused_by(info.value, RubinStrictError)
    assert "isa='neon'" in str(info.value) and "strict" in str(info.value)


# ---- the kernel facts the rewrite rests on --------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_fused_moe_semantics(dtype):
    """``_C.cpu_fused_moe`` overwrites ``output`` (whatever it held), takes prepacked weights, and its
    ``silu`` / ``gelu_tanh`` are rubin.moe's; its ``gelu`` is not gelu_tanh."""
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

    from rubin_compile.ops.moe import moe_reference

    T, H, I, E, k = 9, 64, 32, 4, 2
    x = torch.randn(T, H).to(dtype)
    w13, w2 = (torch.randn(E, 2 * I, H) * 0.1).to(dtype), (torch.randn(E, H, I) * 0.1).to(dtype)
    b13, b2 = (torch.randn(E, 2 * I) * 0.1).to(dtype), (torch.randn(E, H) * 0.1).to(dtype)
    top, ids = torch.randn(T, E).topk(k)
    weights, ids = torch.softmax(top, -1), ids.to(torch.int32)
    p13, p2 = cpu_prepack_moe_weight(w13, "vec"), cpu_prepack_moe_weight(w2, "vec")
    for act in ("silu", "gelu_tanh"):
        out = torch.randn(T, H).to(dtype)  # garbage that must not survive
        cpu_fused_moe(out, x, p13, p2, b13, b2, weights, ids, act, "vec")
        assert_close(out, moe_reference(x, w13, w2, weights, ids, act, b13, b2))
    out = torch.empty(T, H, dtype=dtype)
    cpu_fused_moe(out, x, p13, p2, None, None, weights, ids, "gelu", "vec")
    tanh = moe_reference(x, w13, w2, weights, ids, "gelu_tanh")
    assert not torch.equal(out, tanh)
    # swigluoai: GPT-OSS's clamped SwiGLU over interleaved rows; pre-activations of std ~8 so the clamps at 7 bite
    big13, big_b13 = (torch.randn(E, 2 * I, H) * 1.0).to(dtype), (torch.randn(E, 2 * I) * 2.0).to(dtype)
    p13 = cpu_prepack_moe_weight(big13, "vec")
    gate_up = x.float() @ big13[0].float().t() + big_b13[0].float()
    assert (gate_up.abs() > 7).float().mean() > 0.2  # the clamps are exercised
    cpu_fused_moe(out, x, p13, p2, big_b13, b2, weights, ids, "swigluoai", "vec")
    assert_close(out, moe_reference(x, big13, w2, weights, ids, "swigluoai", big_b13, b2))
    halves = moe_reference(x, big13, w2, weights, ids, "swigluoai_uninterleave", big_b13, b2)
    assert (out.float() - halves.float()).abs().max() > 0.1 * out.float().abs().max()  # interleaved, not halves
    # skip_weighted (vLLM's apply_router_weight_on_input, top-1): the kernel weights nothing, and writes 1.0 into
    # topk_weights, which its schema does not declare as mutated (the vllm_cpu kernel hands it a copy)
    w1, ids1 = weights[:, :1].contiguous(), ids[:, :1].contiguous()
    given = w1.clone()
    cpu_fused_moe(out, x, cpu_prepack_moe_weight(w13, "vec"), p2, None, None, w1, ids1, "silu", "vec", True)
    assert_close(out, moe_reference(x, w13, w2, torch.ones_like(w1), ids1, "silu"))
    assert torch.equal(w1, torch.ones_like(w1)) and not torch.equal(given, w1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vllm_cpu_kernel_is_rubin_moe_on_packed_weights(dtype):
    """The ``vllm_cpu`` kernel of rubin.moe, through the op, on weights in vLLM's layout: the reference's
    result (which unpacks a copy), with and without biases, both activations."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    from rubin_compile.ops.moe import moe_reference

    T, H, I, E, k = 7, 64, 96, 6, 3
    x = torch.randn(T, H).to(dtype)
    w13, w2 = (torch.randn(E, 2 * I, H) * 0.1).to(dtype), (torch.randn(E, H, I) * 0.1).to(dtype)
    b13, b2 = (torch.randn(E, 2 * I) * 0.1).to(dtype), (torch.randn(E, H) * 0.1).to(dtype)
    top, ids = torch.randn(T, E).topk(k)
    weights = torch.softmax(top, -1)
    p13, p2 = cpu_prepack_moe_weight(w13, "vec"), cpu_prepack_moe_weight(w2, "vec")
    for act, biases in (("silu", (None, None)), ("gelu_tanh", (b13, b2))):
        got = torch.ops.rubin.moe(
            x, p13, p2, weights, ids, act, *biases, weight_layout="vllm_cpu:vec", impl="vllm_cpu@cpu"
        )
        assert_close(got, moe_reference(x, w13, w2, weights, ids, act, *biases))
        forced_ref = torch.ops.rubin.moe(x, p13, p2, weights, ids, act, *biases, weight_layout="vllm_cpu:vec")
        assert_close(forced_ref, moe_reference(x, w13, w2, weights, ids, act, *biases))
    # swigluoai (interleaved rows, clamps that bite) and the router weight on the input (top-1, as vLLM: the input
    # scaled in its dtype, then skip_weighted), through the op
    big13, big_b13 = (torch.randn(E, 2 * I, H) * 1.0).to(dtype), (torch.randn(E, 2 * I) * 2.0).to(dtype)
    big_p13 = cpu_prepack_moe_weight(big13, "vec")
    got = torch.ops.rubin.moe(
        x, big_p13, p2, weights, ids, "swigluoai", big_b13, b2, weight_layout="vllm_cpu:vec", impl="vllm_cpu@cpu"
    )
    assert_close(got, moe_reference(x, big13, w2, weights, ids, "swigluoai", big_b13, b2))
    w1, ids1 = torch.sigmoid(top[:, :1]), ids[:, :1]
    for act, biases in (("silu", (None, None)), ("gelu_tanh", (b13, b2))):
        got = torch.ops.rubin.moe(
            x,
            p13,
            p2,
            w1,
            ids1,
            act,
            *biases,
            weight_layout="vllm_cpu:vec",
            impl="vllm_cpu@cpu",
            apply_router_weight_on_input=True,
        )
        want = moe_reference(x, w13, w2, w1, ids1, act, *biases, apply_router_weight_on_input=True)
        assert_close(got, want)
        assert torch.equal(w1, torch.sigmoid(top[:, :1]))  # the graph's weights are left as they were
        assert not torch.allclose(want, moe_reference(x, w13, w2, w1, ids1, act, *biases), rtol=1e-2)
    # top-k columns sliced off wider tensors (strided): the kernel gets dense rows
    strided_w, strided_ids = torch.softmax(top, -1)[:, ::2], ids.to(torch.int32)[:, ::2]
    got = torch.ops.rubin.moe(x, p13, p2, strided_w, strided_ids, weight_layout="vllm_cpu:vec", impl="vllm_cpu@cpu")
    assert_close(got, moe_reference(x, w13, w2, strided_w, strided_ids))
    with pytest.raises(ValueError, match="top-1 only"):
        torch.ops.rubin.moe(
            x,
            p13,
            p2,
            weights,
            ids,
            weight_layout="vllm_cpu:vec",
            impl="vllm_cpu@cpu",
            apply_router_weight_on_input=True,
        )
    # a shape the kernel would abort on is refused with the reason (vLLM pads I to 32 when it loads weights)
    p13, p2 = p13[:, :80], p2[:, :, :40]
    with pytest.raises(ValueError, match="multiples of 32; got I=40"):
        torch.ops.rubin.moe(x, p13, p2, weights, ids, weight_layout="vllm_cpu:vec", impl="vllm_cpu@cpu")


def test_vllm_cpu_kernel_declares_the_router_weight_on_input_for_top1_only():
    """Selection on the CPU: the vllm_cpu kernel takes a rubin.moe weighted on the input at top-1 (as vLLM's own
    layer runs it) and is rejected at top-2 with the reason, leaving the reference."""
    from rubin_compile.ops.moe import MOE, ROUTER_WEIGHT_ON_INPUT
    from rubin_compile.ops.registry import KernelSpec
    from rubin_compile.target import resolve

    def select(k):
        spec = KernelSpec(
            op="moe",
            act_dtype="bfloat16",
            weight_dtype="bfloat16",
            shape=(("E", 8), ("H", 64), ("I", 64), ("k", k)),
            activation="silu",
            weight_layout="vllm_cpu:vec",
            features=(ROUTER_WEIGHT_ON_INPUT,),
        )
        return MOE.select(spec, resolve("cpu"))

    assert select(1).chosen.name == "vllm_cpu"
    top2 = select(2)
    assert top2.chosen.name == "reference" and "top-1 only" in dict(top2.rejected)["vllm_cpu"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_whole_pipeline_binds_vllm_kernel_to_weights_as_stored(make_layer, vllm_config, dtype):
    """With every pass on (as vLLM runs rubin), the rewritten call reads the prepacked weights as stored
    (no copy of them in the graph) and select_kernels binds vLLM's own CPU kernel to it: the result equals
    the same block compiled without rubin (same kernel on the same weights)."""
    from rubin_compile.passes import PASS_NAMES

    layer = make_layer(dtype=dtype, intermediate_size=48)
    x, logits = fresh_inputs(layer, dtype)
    run, rec = compile_layer(layer, vllm_config, x, logits, options={"passes": list(PASS_NAMES)})
    (rewrite,) = rec.match_moe()["rewrites"]
    layout = layer_expert_weights(layer)[4]  # vllm_cpu:vec, or vllm_cpu:amx:vnni for bf16 on a CPU with AMX
    assert layout.startswith("vllm_cpu:") and rewrite["details"]["weight_layout"].startswith(layout + " ")
    (plan,) = [pl for p in rec.report["passes"] if p["name"] == "select_kernels" for pl in p["plans"]]
    assert plan["impl"] == "vllm_cpu@cpu", plan
    rejected = {r["kernel"]: r["reason"] for r in plan["rejected"]}
    assert f"layout '{layout}'" in rejected["triton"]
    assert rec.after["aten::clone"] == rec.before["aten::clone"]  # no copy of the weights was added
    from rubin_compile.debug.report import render_markdown

    assert f"weights {layout} | vllm_cpu (cpu)" in render_markdown(rec.report)
    inputs = [fresh_inputs(layer, dtype) for _ in range(2)]
    got = [run(*i) for i in inputs]
    plain, _ = compile_layer(layer, vllm_config, x, logits, options={"passes": []})
    for i, g in zip(inputs, got):
        assert torch.equal(g, plain(*i))


# ---- the weight layout the rewrite undoes ---------------------------------------------------------------


@pytest.mark.parametrize("isa", ["vec", "amx"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cpu_weight_packing_matches_vllm(dtype, isa):
    """vLLM's packing, on this machine, is the layout cpu_weight_layout names, and rubin unpacks it exactly
    (isa "amx" with 16-bit weights keeps K in pairs on a CPU with AMX; 16-row blocks everywhere else)."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    w = torch.randn(3, 96, 64).to(dtype)
    packed = cpu_prepack_moe_weight(w, isa)
    layout, reason = cpu_weight_layout(isa, dtype, 96, 64)
    assert reason is None and layout in (f"vllm_cpu:{isa}", f"vllm_cpu:{isa}:vnni")
    vnni = layout.endswith(":vnni")
    assert torch.equal(packed, pack_cpu_weight(w, vnni))
    assert torch.equal(unpack_cpu_weight(packed, vnni), w)
    if isa == "vec" or dtype == torch.float32:
        assert not vnni  # the 16-row layout whatever the CPU
    assert cpu_pack_unsupported_reason(isa, dtype, 96, 64) is None
    # shapes vLLM's packing would abort the process on are refused before it runs
    assert "needs N" in cpu_pack_unsupported_reason(isa, dtype, 48, 64) and "got N=48" in cpu_pack_unsupported_reason(
        isa, dtype, 48, 64
    )
