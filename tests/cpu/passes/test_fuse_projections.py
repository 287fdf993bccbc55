"""fuse_projections: rubin.gemm nodes that read one input (q / k / v; gate / up) become one rubin.gemm over
weights stacked once (rubin.stacked_weights), split back with slices, or, for gate / up meeting in
``act(gate) * up``, one rubin.gemm with the gated epilogue.

The CPU target leaves the pass off under ``"auto"``, so these tests force it with ``fuse_projections="on"``
(or compile for sm90 with the ``torch`` GEMM kernel, which lowers back to ``aten.mm`` and runs here).
Numerics: fp32 against eager at 1e-5; bf16 at the dtype's tolerance (assert_close_to_eager).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from rubin_compile.ops import weights
from rubin_compile.options import RubinOptions, RubinOptionsError
from tests.conftest import assert_close_to_eager, count_ops

FP32, BF16 = pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")
ON = {"fuse_projections": "on"}


def fused(rubin_run) -> list[dict]:
    return rubin_run.rewrites("fuse_projections")


def notes(rubin_run) -> list[str]:
    return [
        n for rep in rubin_run.reports() for p in rep["passes"] if p["name"] == "fuse_projections" for n in p["notes"]
    ]


def assert_tight(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --- q / k / v ------------------------------------------------------------------------------------------------------


class QKV(nn.Module):
    """Attention's input projections (GQA widths: q 32, k 16, v 16), read through head views, plus a flat view
    of q (of a slice, where a view needs a copy: post-grad graphs hold reshapes, which make it)."""

    def __init__(self, hidden=32, bias=False):
        super().__init__()
        self.q_proj = nn.Linear(hidden, 32, bias=bias)
        self.k_proj = nn.Linear(hidden, 16, bias=bias)
        self.v_proj = nn.Linear(hidden, 16, bias=bias)

    def forward(self, x):
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, 4, 8).transpose(-3, -2)
        k = self.k_proj(x).view(*lead, 2, 8).transpose(-3, -2)
        v = self.v_proj(x)
        return q, k, v * 2, self.q_proj(x).view(-1)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("shape", [(7, 32), (2, 5, 32)], ids=["2d", "3d"])
def test_qkv_joined_into_one_gemm(rubin_run, bias, shape):
    model = QKV(bias=bias).eval()
    compiled = rubin_run.compile(model, **ON)
    with torch.no_grad():
        x = torch.randn(*shape)
        for got, want in zip(compiled(x), model(x)):
            assert got.shape == want.shape
            assert_tight(got, want)
    (r,) = fused(rubin_run)
    d = r["details"]
    assert r["canonical_op"] == "rubin.gemm" and r["source_idiom"] == "projections sharing an input (3 linears)"
    assert d["N"] == [32, 16, 16] and d["K"] == 32 and d["epilogue"] == "none" and d["bias"] is bias
    # q_proj(x) is called twice (the head view and the flat view): one part of the stack, one slice for both
    assert len(d["joined"]) == 4 and sorted(r["replaced"]) == sorted(d["joined"])
    assert list(d["same_product"].values()) == [d["joined"][0]]
    assert d["stacked_weight_bytes"] == (64 * 32 + (64 if bias else 0)) * 4
    assert d["M"] == 7 if len(shape) == 2 else d["M"] == 10
    before, after = rubin_run.stage_code("match_gemm"), rubin_run.stage_code("fuse_projections")
    assert count_ops(before, "rubin.gemm") == 4
    assert count_ops(after, "rubin.gemm") == 1 and count_ops(after, "aten.slice") == 3
    assert count_ops(after, "rubin.stacked_weights") == (2 if bias else 1)
    (note,) = [n for n in notes(rubin_run) if "fusion(s)" in n]
    assert f"hold {d['stacked_weight_bytes']} bytes" in note


# --- gate / up with the gated epilogue ----------------------------------------------------------------------------


class LlamaMLP(nn.Module):
    """HF Llama / Qwen's dense MLP: ``down(act(gate(x)) * up(x))``, in either operand order."""

    def __init__(self, hidden=32, inter=48, act="silu", up_first=False, bias=False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act = F.silu if act == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
        self.up_first = up_first

    def forward(self, x):
        g, u = self.act(self.gate_proj(x)), self.up_proj(x)
        return self.down_proj(u * g if self.up_first else g * u)


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize(
    "act,up_first,bias",
    [("silu", False, False), ("silu", True, True), ("gelu_tanh", False, False)],
    ids=["silu", "up_first_bias", "gelu_tanh"],
)
def test_gate_up_become_one_gated_gemm(rubin_run, dtype, act, up_first, bias):
    model = LlamaMLP(act=act, up_first=up_first, bias=bias).to(dtype).eval()
    compiled = rubin_run.compile(model, **ON)
    with torch.no_grad():
        x = torch.randn(2, 5, 32, dtype=dtype)
        got, want = compiled(x), model(x)
    if dtype == torch.float32:
        assert_tight(got, want)
    else:
        assert_close_to_eager(got, want, dtype)
    (r,) = fused(rubin_run)
    d = r["details"]
    epilogue = "silu_and_mul" if act == "silu" else "gelu_tanh_and_mul"
    assert d["epilogue"] == epilogue and d["N"] == [48, 48] and d["bias"] is bias
    assert r["source_idiom"].startswith("gate / up projections sharing an input")
    assert d["joined"] == [d["gate"], d["up"]]
    assert d["weights"][0].startswith("arg") and len(set(d["weights"])) == 2
    after = rubin_run.stage_code("fuse_projections")
    assert count_ops(after, "rubin.gemm") == 2  # gate_up with the epilogue, and down
    assert f"epilogue = '{epilogue}'" in after
    assert count_ops(after, "aten.mul") == 0 and count_ops(after, "aten.slice") == 0
    assert count_ops(after, "aten.exp") == 0 and count_ops(after, "aten.tanh") == 0


def test_gate_up_weights_stacked_gate_first(rubin_run):
    """The stacked weight is [W_gate; W_up] even when up's product comes first in the graph."""

    class UpFirst(LlamaMLP):
        def forward(self, x):
            u = self.up_proj(x)
            return self.down_proj(F.silu(self.gate_proj(x)) * u)

    model = UpFirst().eval()
    x = torch.randn(6, 32)  # 2-D: the products are read directly, with no reshape back
    with torch.no_grad():
        assert_tight(rubin_run.compile(model, **ON)(x), model(x))
    (r,) = fused(rubin_run)
    assert r["details"]["epilogue"] == "silu_and_mul"
    assert r["details"]["joined"] == [r["details"]["gate"], r["details"]["up"]]


def test_gate_up_read_elsewhere_is_plain_fusion(rubin_run):
    """The gate's product is also returned: no gated epilogue (that would lose it), a plain fusion with slices,
    and a note that says why."""

    class Leaky(LlamaMLP):
        def forward(self, x):
            g = self.gate_proj(x)
            return self.down_proj(F.silu(g) * self.up_proj(x)), g

    model = Leaky().eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        for got, want in zip(rubin_run.compile(model, **ON)(x), model(x)):
            assert_tight(got, want)
    (r,) = fused(rubin_run)
    assert r["details"]["epilogue"] == "none" and r["details"]["N"] == [48, 48]
    assert any("plain fusion" in n and "also read by" in n for n in notes(rubin_run)), notes(rubin_run)
    assert count_ops(rubin_run.stage_code("fuse_projections"), "aten.slice") == 2


# --- what is not joined ----------------------------------------------------------------------------------------------


class Mixed(nn.Module):
    """a(x) + x folds into a residual epilogue (not joined); b has a bias, c and d do not (c and d join, b not);
    e reads another input; f reads x in bf16 (another input node and dtype)."""

    def __init__(self, hidden=32):
        super().__init__()
        self.a = nn.Linear(hidden, hidden, bias=False)
        self.b = nn.Linear(hidden, 8, bias=True)
        self.c = nn.Linear(hidden, 8, bias=False)
        self.d = nn.Linear(hidden, 24, bias=False)
        self.e = nn.Linear(hidden, 8, bias=False)
        self.f = nn.Linear(hidden, 8, bias=False).to(torch.bfloat16)

    def forward(self, x, y):
        return self.a(x) + x, self.b(x), self.c(x), self.d(x), self.e(y), self.f(x.to(torch.bfloat16))


def test_only_compatible_products_join(rubin_run):
    model = Mixed().eval()
    compiled = rubin_run.compile(model, **ON)
    with torch.no_grad():
        x, y = torch.randn(6, 32), torch.randn(6, 32)
        for got, want in zip(compiled(x, y), model(x, y)):
            assert_close_to_eager(got, want, want.dtype)
    (r,) = fused(rubin_run)
    assert r["details"]["N"] == [8, 24] and r["details"]["bias"] is False  # c and d
    joined = set(r["details"]["joined"])
    text = " ".join(notes(rubin_run))
    assert "not joined across a bias mismatch" in text
    assert "epilogue residual_add" in text and "no other member to join" in text
    after = rubin_run.stage_code("fuse_projections")
    assert count_ops(after, "rubin.gemm") == 5  # a (residual), b, c+d, e, f
    assert len(joined) == 2


def test_different_inputs_are_not_joined(rubin_run):
    lin1, lin2 = nn.Linear(32, 16), nn.Linear(32, 16)

    def fn(x, y):
        return lin1(x), lin2(y)

    x, y = torch.randn(4, 32), torch.randn(4, 32)
    with torch.no_grad():
        for got, want in zip(rubin_run.compile(fn, **ON)(x, y), fn(x, y)):
            assert_tight(got, want)
    assert fused(rubin_run) == []
    assert rubin_run.stage_code("fuse_projections") == rubin_run.stage_code("match_gemm")


# --- options -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options,joins,why",
    [
        ({"fuse_projections": "off"}, False, "did nothing: fuse_projections='off'"),
        ({"target": "cpu"}, False, "fuse_projections='auto' on target cpu"),
        ({"target": "cpu", "fuse_projections": "on"}, True, "fuse_projections='on'"),
        ({"target": "sm90", "kernels": {"gemm": "torch"}}, True, "fuse_projections='auto' on CUDA target sm90"),
        # under CUDA graphs too: the stacked copy is made outside cudagraph trees' pool (ops/weights.py)
        (
            {"target": "sm90", "kernels": {"gemm": "torch"}, "cudagraphs": True},
            True,
            "fuse_projections='auto' on CUDA target sm90",
        ),
        (
            {"target": "sm90", "kernels": {"gemm": "torch"}, "cudagraphs": "external"},
            True,
            "fuse_projections='auto' on CUDA target sm90",
        ),
    ],
    ids=["off", "auto_cpu", "on_cpu", "auto_sm90", "auto_sm90_cudagraphs", "auto_sm90_external_graphs"],
)
def test_option_and_target(rubin_run, options, joins, why):
    model = QKV().to(torch.bfloat16).eval()
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        for got, want in zip(rubin_run.compile(model, **options)(x), model(x)):
            assert_close_to_eager(got, want, torch.bfloat16)
    assert len(fused(rubin_run)) == (1 if joins else 0)
    assert any(why in n for n in notes(rubin_run)), notes(rubin_run)
    if not joins:
        assert any("1 group(s) of 3 projection(s) could join" in n for n in notes(rubin_run))
        assert rubin_run.stage_code("fuse_projections") == rubin_run.stage_code("match_gemm")


def test_option_values_env_and_key():
    assert RubinOptions.resolve({}, environ={}).fuse_projections == "auto"
    assert RubinOptions.resolve({}, environ={"RUBIN_FUSE_PROJECTIONS": "OFF"}).fuse_projections == "off"
    assert RubinOptions.resolve({"fuse_projections": True}, environ={}).fuse_projections == "on"
    with pytest.raises(RubinOptionsError, match=r"option fuse_projections must be one of \['auto', 'on', 'off'\]"):
        RubinOptions.resolve({"fuse_projections": "always"}, environ={})
    keys = {v: RubinOptions.resolve({"fuse_projections": v}, environ={}).behaviour_key() for v in ("auto", "on")}
    assert keys["auto"]["fuse_projections"] == "auto" and keys["auto"] != keys["on"]


# --- the stacked weights at run time ----------------------------------------------------------------------------


def test_stacked_weights_cached_and_follow_in_place_updates(rubin_run):
    model = QKV(bias=True).eval()
    compiled = rubin_run.compile(model, **ON)
    weights.clear_cache()
    before = weights.cache_info()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        for _ in range(3):
            for got, want in zip(compiled(x), model(x)):
                assert_tight(got, want)
    info = weights.cache_info()
    # weight and bias stacks: made on the first call, reused on the next two
    assert info["misses"] - before["misses"] == 2 and info["hits"] - before["hits"] == 4
    assert info["entries"] == 2 and info["bytes"] == (64 * 32 + 64) * 4
    with torch.no_grad():
        model.k_proj.weight.add_(1)
        model.v_proj.bias.mul_(-3)
        got, want = compiled(x), model(x)
    for g, w in zip(got, want):
        assert_tight(g, w)
    assert weights.cache_info()["misses"] - before["misses"] == 4  # both stacks made again


# --- dynamic shapes and a whole decoder-like block ------------------------------------------------------------


class Decoder(nn.Module):
    """q / k / v into SDPA, o_proj with the residual, then the Llama MLP with the residual."""

    def __init__(self, hidden=32):
        super().__init__()
        self.attn = QKV(hidden, bias=False)
        self.attn.v_proj = nn.Linear(hidden, 32, bias=False)
        self.attn.k_proj = nn.Linear(hidden, 32, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp = LlamaMLP(hidden)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (
            p(x).view(b, s, 4, 8).transpose(1, 2) for p in (self.attn.q_proj, self.attn.k_proj, self.attn.v_proj)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.o_proj(a)
        return x + self.mlp(x)


@pytest.mark.parametrize("dynamic", [None, True], ids=["static", "dynamic"])
def test_decoder_block_dynamic_tokens(rubin_run, dynamic):
    model = Decoder().eval()
    compiled = rubin_run.compile(model, dynamic=dynamic, **ON)
    with torch.no_grad():
        for s in (5, 9):
            x = torch.randn(2, s, 32)
            assert_close_to_eager(compiled(x), model(x), torch.float32)
    rewrites = fused(rubin_run)
    epis = sorted(r["details"]["epilogue"] for r in rewrites)
    graphs = len(rubin_run.reports())
    assert epis == sorted(["none", "silu_and_mul"] * graphs)
    if dynamic:
        assert graphs == 1 and all(isinstance(r["details"]["M"], str) for r in rewrites)  # symbolic M


# --- the pass alone, on a hand-made graph -----------------------------------------------------------------------


def test_pass_on_a_graph_with_views_and_t():
    """rubin.gemm nodes as a graph from elsewhere may hold them (vLLM's graphs keep ``aten.view``): ``t(W)`` is a
    weight too, and a view of a member's output that its slice cannot serve becomes a reshape."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from rubin_compile.passes import fuse_projections
    from rubin_compile.passes.base import PassContext

    aten, gemm = torch.ops.aten, torch.ops.rubin.gemm.default

    def graph(x, w1, w2, w3):
        y1 = gemm(x, aten.t.default(w1))
        y2 = gemm(x, aten.permute.default(w2, [1, 0]))
        y3 = gemm(x, w3)  # b [K, N] as stored: not a transposed weight, left alone
        return aten.view.default(y1, [-1]), aten.view.default(y2, [4, 2, 6]), y3

    args = (torch.randn(4, 8), torch.randn(12, 8), torch.randn(12, 8), torch.randn(8, 5))
    gm = torch.fx.symbolic_trace(graph)
    with torch._subclasses.FakeTensorMode() as mode:
        FakeTensorProp(gm, mode).propagate(*(mode.from_tensor(a) for a in args))
    options = RubinOptions.resolve(ON, environ={})
    result = fuse_projections.run(gm.graph, PassContext(options=options, target=options.resolved_target()))
    gm.recompile()
    (r,) = result.rewrites
    assert r.details["N"] == [12, 12] and r.details["weights"] == ["w1", "w2"]
    assert any("y3" in n or "gemm" in n for n in result.notes if "left out" in n), result.notes
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(gemm) == 2 and targets.count(aten.view.default) == 1  # y1's flat view: a reshape now
    assert aten.reshape.default in targets
    for node in gm.graph.nodes:
        if node.op == "call_function":
            assert "val" in node.meta, node
    for got, want in zip(gm(*args), graph(*args)):
        assert_tight(got, want)
