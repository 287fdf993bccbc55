"""Matcher (d): Hugging Face transformers 5.x experts in their batched_mm form (what ``generate()`` switches a
GPU model's experts to for its decode steps), and the reason given for an experts block no matcher takes.
(batched_mm has no mixed-dtype case: transformers' bmm refuses one, eager included.)

Tiny configs with random weights go through ``torch.compile(backend="rubin")`` with
``model.set_experts_implementation("batched_mm")``; every experts block must become one ``rubin.moe`` and the
outputs must equal eager transformers (tolerances as in test_hf_grouped_mm.py). Near misses stay unchanged with
a reason, and still compute what eager does.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_close_to_eager, assert_moe_blocks_close, block_inputs, count_ops

transformers = pytest.importorskip("transformers")
from tests.cpu.passes.match_moe.test_hf_grouped_mm import (  # noqa: E402
    HIDDEN,
    VOCAB,
    _expert_parallel_block,
    gpt_oss,
    gpt_oss_block,
    mixtral,
    moe_block,
    qwen3_moe,
    run_block,
    synthetic_block,
)


def batched(model):
    model.set_experts_implementation("batched_mm")
    return model


def rewrites(rubin_run) -> list[dict]:
    return [r for r in rubin_run.rewrites() if r["source_idiom"].startswith("hf batched_mm")]


def unchanged(rubin_run, idiom: str = "hf batched_mm") -> list[dict]:
    return [u for u in rubin_run.unchanged() if u["idiom"] == idiom]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", [qwen3_moe, mixtral], ids=["qwen3_moe", "mixtral"])
def test_every_block_of_the_model_rewritten_and_logits_match(rubin_run, family, dtype):
    """As the grouped_mm test: fp32 against eager; bf16 with every token routed to every expert against Inductor,
    and each block with the family's own top-k against Inductor on the same inputs (same routing)."""
    model = batched(family() if dtype == torch.float32 else family(num_experts_per_tok=8)).to(dtype).eval()
    layers = model.config.num_hidden_layers
    batches = [torch.randint(0, VOCAB, (2, 8)) for _ in range(2)]
    with torch.no_grad():
        compiled = rubin_run.compile(model)
        got = [compiled(ids).logits for ids in batches]
        if dtype == torch.float32:
            want = [model(ids).logits for ids in batches]
        else:
            torch._dynamo.reset()
            inductor = torch.compile(model, backend="inductor")
            want = [inductor(ids).logits for ids in batches]
    for g, w in zip(got, want):
        assert_close_to_eager(g, w, dtype)
    if dtype == torch.bfloat16:
        routed = batched(family()).to(dtype).eval()
        blocks = [layer.mlp for layer in routed.model.layers]
        assert_moe_blocks_close(blocks, block_inputs(routed, blocks, batches[0]), dtype)

    found = rewrites(rubin_run)
    assert len(found) == layers, rubin_run.unchanged()
    assert rubin_run.unchanged() == []
    k = model.config.num_experts_per_tok
    for r in found:
        d = r["details"]
        assert (d["form"], d["activation"], d["k"], d["E"], d["H"], d["bias"]) == (
            "aten.bmm",
            "silu",
            k,
            8,
            HIDDEN,
            False,
        )
        assert d["weights"] == "as stored, no copy"
        assert d["routing"]["recognised"] and d["routing"]["order"] == "softmax_then_topk"
    code = rubin_run.matched_code()
    assert count_ops(code, "aten.bmm") == 0 and count_ops(code, "rubin.moe") == layers
    assert count_ops(code, "aten.index.Tensor") == 0  # no expert weight gathered per token
    assert count_ops(code, "aten.topk") == layers  # routing stays as ATen ops


def test_top1_gelu_and_gpt_oss(rubin_run):
    for build, activation in (
        (lambda: moe_block(batched(qwen3_moe(num_experts_per_tok=1))), "silu"),
        (lambda: moe_block(batched(qwen3_moe(hidden_act="gelu_pytorch_tanh"))), "gelu_tanh"),
        (lambda: moe_block(batched(qwen3_moe(hidden_act="gelu"))), "gelu"),
        (lambda: gpt_oss_block(batched(gpt_oss())), "swigluoai"),  # clamped SwiGLU, interleaved gate / up
    ):
        torch._dynamo.reset()
        run_before = len(rewrites(rubin_run))
        got, want = run_block(rubin_run, build(), torch.float32)
        assert_close_to_eager(got, want)
        assert rewrites(rubin_run)[run_before:][0]["details"]["activation"] == activation


@pytest.mark.parametrize("is_transposed, has_bias", [(False, True), (True, False), (True, True)])
def test_transposed_and_biased_experts(rubin_run, is_transposed, has_bias):
    block = synthetic_block(is_transposed, has_bias)
    block.experts.config._experts_implementation = "batched_mm"
    got, want = run_block(rubin_run, block, torch.float32)
    assert_close_to_eager(got, want)
    (rewrite,) = rewrites(rubin_run)
    assert rewrite["details"]["bias"] is has_bias
    assert ("view" in rewrite["details"]["weights"]) is is_transposed  # a permute view, never a copy
    code = rubin_run.matched_code()
    assert count_ops(code, "rubin.moe") == 1 and count_ops(code, "aten.bmm") == 0
    assert count_ops(code, "aten.clone") == 0


@pytest.mark.parametrize(
    "build, reason",
    [
        (lambda: moe_block(batched(qwen3_moe(hidden_act="relu"))), "activation is relu(gate) * up"),
        (lambda: batched_ep(_expert_parallel_block()), "expert-parallel"),
    ],
    ids=["relu", "expert_parallel"],
)
def test_near_misses_left_unchanged_with_reason(rubin_run, build, reason):
    block = build()
    got, want = run_block(rubin_run, block, torch.float32, cast=False)
    assert_close_to_eager(got, want)
    assert rewrites(rubin_run) == []
    (left,) = unchanged(rubin_run)
    assert reason in left["reason"], left
    code = rubin_run.matched_code()
    assert count_ops(code, "rubin.moe") == 0 and count_ops(code, "aten.bmm") == 2


def batched_ep(block):
    """``block`` with batched_mm experts, for the expert-parallel tests: transformers 5.0's batched_mm has no
    sentinel handling (it gathers ``gate_up_proj[E]``, out of range: eager raises, compiled code reads past the
    weights), so there they skip."""
    import inspect

    from transformers.integrations import moe as hf_moe

    if ".clamp" not in inspect.getsource(hf_moe.batched_mm_experts_forward):
        pytest.skip(
            f"transformers {transformers.__version__}'s batched-mm experts have no expert-parallel sentinel handling"
        )
    block.experts.config._experts_implementation = "batched_mm"
    return block


def test_two_shapes_and_dynamic_shapes(tmp_path):
    from tests.conftest import check_two_shapes_and_dynamic

    model = batched(qwen3_moe()).eval()
    check_two_shapes_and_dynamic(
        tmp_path, model, lambda s: (torch.randint(0, VOCAB, (2, s)),), (8, 13), "match_moe", "rubin.moe"
    )


# --- an experts block no matcher takes: the router says why -------------------------------------------


def test_eager_experts_loop_says_why_at_the_router(rubin_run):
    """transformers' experts_implementation="eager" loops over the experts hit (nonzero()): the graph breaks
    there, so no graph holds a whole block. Each router's top-k is reported with the reason and the fix; strict
    mode raises it; the model still computes what eager does."""
    from rubin_compile import RubinStrictError

    model = qwen3_moe().eval()
    model.set_experts_implementation("eager")
    ids = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        assert_close_to_eager(rubin_run.compile(model)(ids).logits, model(ids).logits)
    routers = unchanged(rubin_run, "MoE router (top-k)")
    assert routers, rubin_run.unchanged()  # one per compiled router graph (the layers share one compile)
    assert all("graph break" in u["reason"] and "batched_mm" in u["reason"] for u in routers)
    assert rubin_run.rewrites() == []
    torch._dynamo.reset()
    with pytest.raises(RubinStrictError, match="graph break"), torch.no_grad():
        rubin_run.compile(model, strict=True)(ids)


def test_unknown_experts_form_says_why_at_the_router(rubin_run):
    """A router (softmax over a linear projection, top-k) whose experts are in no known form: reported."""

    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = torch.nn.Linear(HIDDEN, 8, bias=False)
            self.experts = torch.nn.Parameter(torch.randn(8, HIDDEN) * 0.1)

        def forward(self, x):
            w, ids = torch.topk(torch.softmax(self.router(x), dim=-1), 2, dim=-1)
            return x * (self.experts[ids] * w[..., None]).sum(1)  # a per-expert scale, not an FFN

    model = Odd().eval()
    x = torch.randn(6, HIDDEN)
    with torch.no_grad():
        assert_close_to_eager(rubin_run.compile(model)(x), model(x))
    (left,) = unchanged(rubin_run, "MoE router (top-k)")
    assert "no matcher recognises" in left["reason"]


def test_topk_that_is_not_a_router_is_not_reported(rubin_run):
    def top_values(x):
        values, ids = torch.topk(x, 3, dim=-1)
        return values.sum(-1) + ids.sum(-1)

    x = torch.randn(4, 16)
    rubin_run.compile(top_values)(x)
    assert rubin_run.unchanged() == []


def test_expert_parallel_clamp_over_topk_ids_rewritten(rubin_run):
    """transformers' sentinel clamp of the ids (always there in transformers 5.17, with ``_is_expert_parallel``
    later) is the identity when the ids are a top-k over the E experts: the block is rewritten, exactly."""
    block = batched_ep(synthetic_block())
    block.experts._is_expert_parallel = True
    got, want = run_block(rubin_run, block, torch.float32)
    assert_close_to_eager(got, want)
    (rewrite,) = rewrites(rubin_run)
    assert "sentinel clamp dropped" in rewrite["details"]["sentinel_clamp"]
    code = rubin_run.matched_code()
    assert count_ops(code, "rubin.moe") == 1 and count_ops(code, "aten.bmm") == 0
