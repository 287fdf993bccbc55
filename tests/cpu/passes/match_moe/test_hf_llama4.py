"""Matcher (e): Llama 4's dense experts (every expert on every token, the routing weight on its input) into
``rubin.moe(..., apply_router_weight_on_input=True)`` over the top-k.

transformers' own ``Llama4TextMoe`` (and the whole ``Llama4ForCausalLM`` text model) from tiny configs with random
weights go through ``torch.compile(backend="rubin")``: fp32 against eager at 1e-4 of the output's scale, bf16
against Inductor's compile of the same block on the same input (same routing; see test_hf_grouped_mm.py on why
whole bf16 models are compared with every token routed to every expert). Near misses (the unrouted scores not
exactly 0, an expert bias) stay as written with the reason and still compute what eager does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import assert_close_to_eager, assert_moe_blocks_close, block_inputs, count_ops

transformers = pytest.importorskip("transformers")
from transformers.models.llama4 import modeling_llama4  # noqa: E402

HIDDEN, VOCAB, E = 64, 128, 8
IDIOM = "hf llama4 dense experts"


def config(**kw) -> "transformers.Llama4TextConfig":
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=32,  # the experts'
        intermediate_size_mlp=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=E,
        num_experts_per_tok=1,  # Llama 4's own setting
        interleave_moe_layer_step=1,  # every layer MoE
        max_position_embeddings=128,
        initializer_range=0.1,
        use_cache=False,
    )
    return transformers.Llama4TextConfig(**{**cfg, **kw})


def model(**kw) -> torch.nn.Module:
    return transformers.Llama4ForCausalLM(config(**kw)).eval()


def block(cls=None, **kw) -> torch.nn.Module:
    """A ``Llama4TextMoe`` (or a subclass) with random weights: its experts' parameters are created as zeros /
    uninitialised, and ``post_init`` runs only for a whole model."""
    moe = (cls or modeling_llama4.Llama4TextMoe)(config(**kw)).eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.1)
    return moe


def rewrites(rubin_run) -> list[dict]:
    return [r for r in rubin_run.rewrites() if r["source_idiom"].startswith(IDIOM)]


def run_block(rubin_run, moe: torch.nn.Module, dtype: torch.dtype = torch.float32, tokens: int = 14, **options):
    moe = moe.to(dtype)
    x = torch.randn(2, tokens // 2, HIDDEN, dtype=dtype)
    with torch.no_grad():
        got, want = rubin_run.compile(moe, **options)(x), moe(x)
    return got[0], want[0]  # (out, router_logits)


# --- rewritten ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2], ids=["top1", "top2"])
def test_llama4_text_moe_rewritten_exactly(rubin_run, k):
    """fp32 against eager; one rubin.moe with the top-k ids, weights on the input, no bmm over the experts left;
    the shared expert and the router stay in the graph."""
    got, want = run_block(rubin_run, block(num_experts_per_tok=k))
    assert_close_to_eager(got, want)
    (r,) = rewrites(rubin_run)
    assert rubin_run.unchanged() == []  # nor is the router reported
    d = r["details"]
    assert (d["E"], d["k"], d["H"], d["I"], d["activation"], d["bias"]) == (E, k, HIDDEN, 32, "silu", False)
    assert "on the expert input" in d["router_weight"] and "permute(0, 2, 1) view" in d["weights"]
    routing = d["routing"]
    assert routing["recognised"] and routing["order"] == "topk_then_sigmoid" and routing["router"] == "linear"
    assert routing["top_k"] == k and routing["num_experts"] == E
    code = rubin_run.matched_code()
    assert count_ops(code, "rubin.moe") == 1 and "apply_router_weight_on_input = True" in code
    assert count_ops(code, "aten.bmm") == 0 and count_ops(code, "aten.repeat") == 0  # no dense expert work left
    assert count_ops(code, "aten.scatter") == 0 and count_ops(code, "aten.topk") == 1


@pytest.mark.parametrize("k", [1, 2], ids=["top1", "top2"])
def test_bf16_block_against_inductor(k):
    """bf16: the block compiled with rubin against Inductor's compile of it, on the same input (same routing); the
    weights are replayed as the router computes them (float32 sigmoid, cast to bf16) and applied in bf16 on the
    input, as the dense form's product is."""
    moe = block(num_experts_per_tok=k).to(torch.bfloat16)
    assert_moe_blocks_close([moe], [torch.randn(14, HIDDEN, dtype=torch.bfloat16)], torch.bfloat16)


def test_gelu_tanh_experts(rubin_run):
    got, want = run_block(rubin_run, block(hidden_act="gelu_pytorch_tanh", num_experts_per_tok=2))
    assert_close_to_eager(got, want)
    (r,) = rewrites(rubin_run)
    assert r["details"]["activation"] == "gelu_tanh"


def test_whole_text_model_fp32(rubin_run):
    """Llama4ForCausalLM (attention, the shared expert, both MoE layers): logits against eager, every MoE layer
    rewritten, nothing left unexplained."""
    llama = model()
    ids = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        assert_close_to_eager(rubin_run.compile(llama)(ids).logits, llama(ids).logits)
    assert len(rewrites(rubin_run)) == llama.config.num_hidden_layers
    assert rubin_run.unchanged() == []
    assert count_ops(rubin_run.matched_code(), "aten.bmm") == 0


def test_whole_text_model_bf16(rubin_run):
    """bf16: the whole model with every token routed to every expert (no routing near-tie can differ) against
    Inductor's compile, then each MoE block with Llama 4's top-1 against Inductor on the hidden states it sees."""
    dense = model(num_experts_per_tok=E).to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        got = rubin_run.compile(dense)(ids).logits
        torch._dynamo.reset()
        want = torch.compile(dense, backend="inductor")(ids).logits
    assert_close_to_eager(got, want, torch.bfloat16)
    assert len(rewrites(rubin_run)) == dense.config.num_hidden_layers
    top1 = model().to(torch.bfloat16)
    blocks = [layer.feed_forward for layer in top1.model.layers]
    assert_moe_blocks_close(blocks, block_inputs(top1, blocks, ids), torch.bfloat16)


def test_two_shapes_and_dynamic_shapes(tmp_path):
    from tests.conftest import check_two_shapes_and_dynamic

    check_two_shapes_and_dynamic(
        tmp_path, model(), lambda s: (torch.randint(0, VOCAB, (2, s)),), (8, 13), "match_moe", "rubin.moe"
    )


def test_fp32_on_a_gpu_target_rewritten_bf16_left_to_inductor(rubin_run):
    """Planned for sm90: no GPU kernel implements the router weight on the input (the Triton MoE would take a silu
    block), so in bf16 only the reference could run the rewrite, a loop over the experts: the block stays, with
    that reason. In fp32 the reference runs every rubin.moe on sm90 anyway: rewritten as before (exactly)."""
    moe = block(num_experts_per_tok=1)
    got, want = run_block(rubin_run, moe, torch.bfloat16, target="sm90")
    assert_close_to_eager(got, want, torch.bfloat16)
    assert rewrites(rubin_run) == []
    (left,) = rubin_run.unchanged()
    assert left["idiom"] == IDIOM and "only the reference implements router_weight_on_input" in left["reason"]
    assert "triton does not implement router_weight_on_input" in left["reason"]
    # (only match_moe: sm90's GEMM kernels would not run here; the MoE's reference does)
    got, want = run_block(rubin_run, moe, torch.float32, target="sm90", passes=["match_moe"])
    assert_close_to_eager(got, want)
    assert len(rewrites(rubin_run)) == 1


# --- near misses: left as written, with the reason ---------------------------------------------------------


def router_with(fill: float = float("-inf"), score=torch.sigmoid):
    """Llama4Router's forward with another fill or score function (everything else as transformers writes it)."""

    class Router(modeling_llama4.Llama4Router):
        def forward(self, hidden_states):
            router_logits = F.linear(hidden_states, self.weight, self.bias)
            top, ids = torch.topk(router_logits, self.top_k, dim=1)
            scores = torch.full_like(router_logits, fill).scatter_(1, ids, top)
            return score(scores.float()).to(scores.dtype), router_logits

    return Router


class BiasedExperts(modeling_llama4.Llama4TextExperts):
    """Llama4TextExperts with a bias on each projection (``which``: "gate_up" or "down")."""

    which = "gate_up"

    def __init__(self, config):
        super().__init__(config)
        self.bias = torch.nn.Parameter(
            torch.zeros(self.num_experts, 1, 2 * self.expert_dim if self.which == "gate_up" else self.hidden_size)
        )

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size)
        gate_up = torch.bmm(hidden_states, self.gate_up_proj)
        if self.which == "gate_up":
            gate_up = gate_up + self.bias
        gate, up = gate_up.chunk(2, dim=-1)
        out = torch.bmm(up * self.act_fn(gate), self.down_proj)
        if self.which == "down":
            out = out + self.bias
        return out.view(-1, self.hidden_size)


class DownBiasedExperts(BiasedExperts):
    which = "down"


def with_parts(router=None, experts=None):
    """A Llama4TextMoe whose router / experts are the given classes."""

    class Moe(modeling_llama4.Llama4TextMoe):
        def __init__(self, config):
            super().__init__(config)
            if router is not None:
                self.router = router(config)
            if experts is not None:
                self.experts = experts(config)

    return Moe


@pytest.mark.parametrize(
    "parts, k, reason",
    [
        (dict(router=router_with(fill=-1.0)), 1, "scattered into a fill of -1.0, not -inf"),
        (dict(router=router_with(fill=-1e4)), 2, "rounds to 0 in float32, but only -inf"),
        (dict(router=router_with(score=lambda s: torch.softmax(s, dim=-1))), 2, "go through softmax, not"),
        (dict(router=router_with(score=lambda s: torch.sigmoid(torch.sigmoid(s)))), 1, "2 sigmoids between"),
        (dict(router=router_with(score=torch.exp)), 2, "go through aten.exp.default before"),
        (dict(experts=BiasedExperts), 1, "gate_up bmm output is added to"),
        (dict(experts=DownBiasedExperts), 2, "down bmm output is added to"),
    ],
    ids=["fill-minus-one", "fill-minus-1e4", "softmax", "two-sigmoids", "exp", "gate-up-bias", "down-bias"],
)
def test_near_misses_left_unchanged_with_reason(rubin_run, parts, k, reason):
    moe = block(with_parts(**parts), num_experts_per_tok=k)
    got, want = run_block(rubin_run, moe)
    assert_close_to_eager(got, want)
    assert rewrites(rubin_run) == []
    (left,) = rubin_run.unchanged()  # the block, with its reason; not the router as well
    assert left["idiom"] == IDIOM and reason in left["reason"], left
    code = rubin_run.matched_code()
    assert count_ops(code, "rubin.moe") == 0 and count_ops(code, "aten.bmm") == 2


def test_bias_reason_says_why(rubin_run):
    """The reason names the problem (an unrouted expert's output on a zero input is not zero with a bias)."""
    moe = block(with_parts(experts=BiasedExperts))
    with torch.no_grad():
        moe.experts.bias.normal_(0, 1.0)
    got, want = run_block(rubin_run, moe)
    assert_close_to_eager(got, want)
    (left,) = rubin_run.unchanged()
    assert "zero input, whose output is zero only without biases" in left["reason"]
