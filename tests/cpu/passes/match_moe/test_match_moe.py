"""match_moe (the pass, match_moe/__init__.py): the router fallback that gives a reason for every MoE block no matcher
took, and the routing reports of transformers' families whose routers routing.py learnt to read.

Each family is built from its tiny configuration as docs/models.md builds it (tests/cpu/passes/match_moe/families.py),
its first MoE block compiled with rubin on the CPU and run against eager; the report must say what the test says.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.conftest import assert_close_to_eager

GRAPH_BREAK = "its expert ids leave this graph (a graph break)"
UNKNOWN_FORM = "the experts its ids select are in a form no matcher recognises"
ROUTER = "MoE router (top-k)"


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def compile_family_block(rubin_run, model_type: str):
    """Compile the family's first MoE block on [2, 8, H] hidden states, check it against eager; the block's config."""
    pytest.importorskip("transformers")
    from tests.cpu.passes.match_moe.families import hidden_size, moe_block

    block, config = moe_block(model_type)
    x = torch.randn(2, 8, hidden_size(config), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = _first(rubin_run.compile(block)(x)), _first(block(x))
    assert_close_to_eager(got, want)
    return block, config


def moe_rewrites(rubin_run) -> list[dict]:
    return [r for r in rubin_run.rewrites() if r["canonical_op"] == "rubin.moe"]


# --- blocks no matcher rewrites: the reason the router gives ------------------------------------------------------


def assert_graph_break_reported_at_the_router(rubin_run) -> None:
    assert moe_rewrites(rubin_run) == []
    routers = [u for u in rubin_run.unchanged() if u["idiom"] == ROUTER]
    assert routers and all(GRAPH_BREAK in u["reason"] for u in routers), rubin_run.unchanged()
    # one reason per router: NLLB-MoE's second argmax belongs to the block of its first (the same projection)
    graphs = [rep for rep in rubin_run.reports() if any(p["unchanged"] for p in rep["passes"])]
    assert len(routers) == len(graphs)


@pytest.mark.parametrize(
    "model_type",
    [
        "switch_transformers",  # argmax (top-1) with expert capacity, a one-hot dispatch mask leaves the graph
        "nllb-moe",  # two argmaxes (top-2) with expert capacity, the same
    ],
)
def test_graph_breaking_experts_reported_at_the_router(rubin_run, model_type):
    """The experts are a loop over ``nonzero()`` written by the model itself (no experts interface to switch): the
    graph breaks there, and the router's graph says so: its ids (or the dispatch mask made of them) are an output."""
    compile_family_block(rubin_run, model_type)
    assert_graph_break_reported_at_the_router(rubin_run)


@pytest.mark.parametrize(
    "model_type",
    [
        "longcat_flash",  # ids >= n_routed_experts are identity ("zero") experts
        "step3p7",  # one_hot over E + 1, the last skipped
    ],
)
def test_own_expert_loops_until_transformers_decorates_them(rubin_run, model_type):
    """LongCat-Flash's and Step-3.7's experts were loops of their own over the experts hit (transformers up to 5.24:
    the graph breaks there, the router says so). transformers 5.25 decorates them with ``use_experts_implementation``
    (LongCat-Flash's identity experts moved into the block: their slots get an expert id in range and weight 0), and
    the grouped-mm block is rewritten, all its experts in one ``rubin.moe``; the output matches eager either way."""
    block, config = compile_family_block(rubin_run, model_type)
    if not hasattr(type(block.experts).forward, "__wrapped__"):  # the model's own loop
        assert_graph_break_reported_at_the_router(rubin_run)
        return
    (rewrite,) = moe_rewrites(rubin_run)
    assert rewrite["details"]["form"] == "transformers.grouped_mm_fallback", rewrite
    assert rewrite["details"]["E"] == block.experts.num_experts, rewrite
    assert rubin_run.unchanged() == []


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_post_expert_norm_left_unchanged(rubin_run, impl):
    """transformers 5.25's experts interface may normalise each expert's output before it is weighted
    (``has_post_expert_norm``, Muse Spark): rubin.moe has no such step, so the block stays as written, with the
    reason, and runs as eager does."""
    pytest.importorskip("transformers")
    from tests.cpu.passes.match_moe.families import moe_block, require

    require("muse_spark")
    block, config = moe_block("muse_spark")
    assert block.experts.has_post_expert_norm
    block.experts.config._experts_implementation = impl
    x = torch.randn(2, 8, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close_to_eager(_first(rubin_run.compile(block)(x)), _first(block(x)))
    assert moe_rewrites(rubin_run) == []
    left = [u for u in rubin_run.unchanged() if u["idiom"].startswith(f"hf {impl}")]
    assert left and "down projection output is not multiplied by the" in left[0]["reason"], rubin_run.unchanged()


def test_doge_product_key_experts_reported_at_the_router(rubin_run):
    """Doge's CDMoE: product-key routing (two top-ks over halves of the router's outputs) and single-neuron experts
    (embeddings combined by matmul) in one graph, a form no matcher takes: reported at the first top-k, the one over
    the linear projection's outputs."""
    compile_family_block(rubin_run, "doge")
    assert moe_rewrites(rubin_run) == []
    (left,) = rubin_run.unchanged()
    assert left["idiom"] == ROUTER and UNKNOWN_FORM in left["reason"], left


def test_one_expert_block_says_so(rubin_run):
    """E = 1 at T = 1 (the router's mm decomposed by Inductor): no matcher groups one expert; the reason says it."""
    router = nn.Linear(8, 1, bias=False)
    expert = nn.Sequential(nn.Linear(8, 8, bias=False), nn.SiLU(), nn.Linear(8, 8, bias=False))

    def block(x):
        w, ids = torch.topk(torch.sigmoid(router(x)), 1, dim=-1)
        return (w * (ids == 0)).sum(-1, keepdim=True) * expert(x)

    x = torch.randn(1, 8)
    with torch.no_grad():
        assert_close_to_eager(rubin_run.compile(block)(x), block(x))
    (left,) = rubin_run.unchanged()
    assert left["idiom"] == ROUTER and "one expert (E = 1)" in left["reason"], left


def test_argmax_that_is_no_dispatch_not_reported(rubin_run):
    """A greedy decode's argmax over a linear projection (the next token) is no router: nothing reported."""
    head = nn.Linear(16, 32, bias=False)

    def next_token(x):
        return head(x).argmax(-1)

    with torch.no_grad():
        rubin_run.compile(next_token)(torch.randn(4, 16))
    assert rubin_run.unchanged() == []


# --- routings read in families whose blocks are rewritten ---------------------------------------------------------


@pytest.mark.parametrize("model_type", ["ernie4_5_moe", "ernie4_5_vl_moe"])
def test_ernie_routing(rubin_run, model_type):
    block, _ = compile_family_block(rubin_run, model_type)
    (rewrite,) = moe_rewrites(rubin_run)
    routing, gate = rewrite["details"]["routing"], block.gate
    want = dict(recognised=True, order="softmax_then_topk", score_correction_bias=True, renormalize=True)
    assert {key: routing[key] for key in want} == want, routing
    assert routing["renormalize_eps"] == f"max(sum, {gate.norm_min:g})", routing
    assert (routing["num_experts"], routing["top_k"]) == (gate.num_experts, gate.top_k), routing


def test_mistral4_routing(rubin_run):
    _, config = compile_family_block(rubin_run, "mistral4")
    (rewrite,) = moe_rewrites(rubin_run)
    routing = rewrite["details"]["routing"]
    # the router (5.17 on: Mistral4TopkRouter; before, the block's route_tokens_to_experts) masks the groups it did not
    # choose with 0.0 whatever n_group (one group: a mask of ones)
    want = dict(recognised=True, order="softmax_then_topk", renormalize=config.norm_topk_prob)
    want.update(group_limited=True, group_fill="0")
    assert {key: routing.get(key) for key in want} == want, routing
    scale = config.routed_scaling_factor  # a scale of 1.0 may be folded away (torch 2.15 removes the * 1)
    assert routing["scale"] == scale or (scale == 1.0 and routing["scale"] is None), routing
    assert (routing["num_experts"], routing["top_k"]) == (config.n_routed_experts, config.num_experts_per_tok), routing


def test_zaya_routing(rubin_run):
    block, _ = compile_family_block(rubin_run, "zaya")
    (rewrite,) = moe_rewrites(rubin_run)
    routing, gate = rewrite["details"]["routing"], block.gate
    want = dict(recognised=True, order="softmax_then_topk", score_correction_bias=True, skip_expert=gate.num_experts)
    assert {key: routing.get(key) for key in want} == want, routing
    assert (routing["num_experts"], routing["top_k"]) == (gate.num_router_classes, gate.top_k), routing


@pytest.mark.parametrize(
    "model_type, why",
    [
        # softmax over logsigmoid of the chosen and the shared experts' logits, times a learned global scale
        ("inkling_text", "are no form read from the top-k"),
        # SparseMixer: each of the two choices is the max of its own jitter-masked scores
        ("phimoe", "is not the indices output of aten.topk"),
    ],
)
def test_routings_not_described_say_why(rubin_run, model_type, why):
    """Rewritten blocks whose routing routing.py does not read: "not recognised", with the reason."""
    compile_family_block(rubin_run, model_type)
    (rewrite,) = moe_rewrites(rubin_run)
    routing = rewrite["details"]["routing"]
    assert not routing["recognised"] and why in routing["why"], routing
