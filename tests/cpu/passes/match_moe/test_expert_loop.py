"""Matcher (d): a plain PyTorch loop over experts (the dense-mask form Dynamo unrolls)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.conftest import assert_close_to_eager, count_ops

# tanh: no form rubin.moe knows (the report says where each known form's pattern stops)
ACTS = {
    "silu": F.silu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "relu": F.relu,
    "gelu": F.gelu,
    "tanh": torch.tanh,
}


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, inter, bias=False)
        self.up = nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)
        self.act = ACTS[act]

    def forward(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x))


class LoopMoE(nn.Module):
    """Routing variants: softmax then top-k or top-k then softmax, renormalised or not, router bias."""

    def __init__(
        self,
        hidden=32,
        inter=24,
        experts=6,
        k=2,
        act="silu",
        order="softmax_topk",
        renorm=True,
        router_bias=False,
        cast_weights=True,
        leak=False,
        skip_expert=None,
    ):
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=router_bias)
        self.experts = nn.ModuleList(Expert(hidden, inter, act) for _ in range(experts))
        self.k, self.order, self.renorm, self.cast, self.leak, self.skip = (
            k,
            order,
            renorm,
            cast_weights,
            leak,
            skip_expert,
        )

    def forward(self, x):
        logits = self.router(x)
        if self.order == "softmax_topk":
            w, ids = torch.topk(logits.softmax(-1, dtype=torch.float32), self.k, dim=-1)
            if self.renorm:
                w = w / w.sum(-1, keepdim=True)
        else:
            w, ids = torch.topk(logits, self.k, dim=-1)
            w = w.softmax(-1, dtype=torch.float32)
        if self.cast:
            w = w.to(x.dtype)
        out = torch.zeros_like(x)
        extra = None
        for e, expert in enumerate(self.experts):
            if e == self.skip:
                continue
            w_e = (w * (ids == e)).sum(-1, keepdim=True)
            if self.leak and e == 0:
                extra = expert.gate(x)  # an intermediate the caller also sees
                out = out + w_e * expert.down(expert.act(extra) * expert.up(x))
            else:
                out = out + w_e * expert(x)
        return (out, extra) if self.leak else out


def _run(rubin_run, model, dtype, tokens=7):
    model = model.to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
        compiled = rubin_run.compile(model)
        x = torch.randn(tokens, 32, dtype=dtype)
        return compiled(x), model(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "variant",
    [
        dict(act="silu", order="softmax_topk", renorm=True),
        dict(act="silu", order="softmax_topk", renorm=False, router_bias=True),
        dict(act="gelu_tanh", order="topk_softmax"),
        dict(act="gelu", order="topk_softmax"),  # exact (erf) GELU
        dict(act="silu", experts=5, k=1),  # E not a power of two, k = 1
    ],
)
def test_loop_rewritten_and_numerics(rubin_run, dtype, variant):
    got, want = _run(rubin_run, LoopMoE(**variant), dtype)
    assert_close_to_eager(got, want)
    rewrites = rubin_run.rewrites()
    assert len(rewrites) == 1 and rewrites[0]["source_idiom"] == "expert loop"
    assert rewrites[0]["details"]["activation"] == variant["act"]
    assert rewrites[0]["details"]["E"] == variant.get("experts", 6)
    routing = rewrites[0]["details"]["routing"]
    topk_first = variant.get("order") == "topk_softmax"
    assert routing["order"] == ("topk_then_softmax" if topk_first else "softmax_then_topk")
    assert routing["renormalize"] == (variant.get("renorm", True) and not topk_first)
    assert routing["router_bias"] == variant.get("router_bias", False)
    code = rubin_run.matched_code()
    assert count_ops(code, "rubin.moe") == 1

    # before: three mm per expert plus the router's mm / addmm; after: only the router's is left
    def matmuls(c):
        return count_ops(c, "aten.mm") + count_ops(c, "aten.addmm")

    assert matmuls(code) == 1
    first = sorted(rubin_run.dump_dir.glob("*/00-input.py"))[0].read_text()
    assert matmuls(first) == 1 + 3 * variant.get("experts", 6)


@pytest.mark.parametrize(
    "variant, reason",
    [
        (dict(act="relu"), "activation relu"),
        (
            dict(act="tanh"),
            "(every form stops at tanh = aten.tanh.default(mm_1: aten.mm.default) (function_mismatch))",
        ),
        (dict(leak=True), "another user"),
        (dict(cast_weights=False), "mixed dtypes"),
        (dict(skip_expert=3), "covers experts"),
    ],
)
def test_near_misses_left_unchanged_with_reason(rubin_run, variant, reason):
    dtype = torch.bfloat16 if variant.get("cast_weights") is False else torch.float32
    got, want = _run(rubin_run, LoopMoE(**variant), dtype)
    if isinstance(got, tuple):
        got, want = got[0], want[0]
    assert_close_to_eager(got, want, dtype)  # computed in `dtype` even where the result is fp32
    assert rubin_run.rewrites() == []
    unchanged = rubin_run.unchanged()
    assert len(unchanged) == 1 and unchanged[0]["idiom"] == "expert loop"
    assert reason in unchanged[0]["reason"], unchanged[0]["reason"]
    assert count_ops(rubin_run.matched_code(), "rubin.moe") == 0


def test_strict_mode_turns_a_near_miss_into_an_error(rubin_run):
    model = LoopMoE(act="relu").eval()
    compiled = rubin_run.compile(model, strict=True)
    with pytest.raises(Exception, match=r"(?s)rubin \(strict\).*activation relu"):
        with torch.no_grad():
            compiled(torch.randn(4, 32))


def test_expert_weights_stacked_once_and_restacked_after_an_update(rubin_run):
    """The rewrite concatenates the experts' weights once (rubin.stacked_weights), not on every call; an
    in-place change of a weight is seen on the next call."""
    from rubin_compile.ops import weights

    model = LoopMoE().eval()
    compiled = rubin_run.compile(model)
    x = torch.randn(7, 32)
    weights.clear_cache()
    with torch.no_grad():
        compiled(x)
        misses = weights.cache_info()["misses"]
        for _ in range(2):
            assert_close_to_eager(compiled(x), model(x), torch.float32)
        assert weights.cache_info()["misses"] == misses and weights.cache_info()["hits"] >= 4
        model.experts[2].down.weight.mul_(-1.0)
        assert_close_to_eager(compiled(x), model(x), torch.float32)
    (r,) = rubin_run.rewrites()
    assert "stacked into w13 / w2 once" in r["details"]["weights"]
    code = rubin_run.matched_code()
    assert count_ops(code, "rubin.stacked_weights") == 2 and count_ops(code, "aten.cat") == 0


def test_two_shapes_and_dynamic_shapes(tmp_path):
    """The token count changes (a recompile with a symbolic T) and dynamic=True: rewritten and exact each time.
    Before, the symbolic T in the report details failed the compile (deep-copied into the report)."""
    from tests.conftest import check_two_shapes_and_dynamic

    model = LoopMoE().eval()
    check_two_shapes_and_dynamic(tmp_path, model, lambda t: (torch.randn(t, 32),), (5, 9), "match_moe", "rubin.moe")


def test_training_graph_says_why_each_loop_is_left_alone(rubin_run):
    """A graph that computes gradients: every expert loop is left unchanged with that reason (before: a wrong one,
    'the expert mask ... is not used only to mask the top-k weights'); strict mode raises it."""
    from rubin_compile import RubinStrictError
    from rubin_compile.passes.base import GRADIENTS_REASON

    model = LoopMoE().train()
    out = rubin_run.compile(model)(torch.randn(5, 32))
    out.sum().backward()  # the compiled model trains as eager does
    unchanged = rubin_run.unchanged()
    assert [u["reason"] for u in unchanged] == [GRADIENTS_REASON] and unchanged[0]["idiom"] == "expert loop"
    assert rubin_run.rewrites() == []
    with pytest.raises(RubinStrictError, match="the graph computes gradients"):
        rubin_run.compile(model, strict=True)(torch.randn(5, 32))
    with torch.no_grad():
        rubin_run.compile(model)(torch.randn(5, 32))
    assert len(rubin_run.rewrites()) == 1  # the same model under no_grad is rewritten
