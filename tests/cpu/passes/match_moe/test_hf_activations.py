"""The activations of Hugging Face experts beyond ``act(gate) * up`` (match_moe/hf_activation.py), in both experts
forms (``grouped_mm``, the default, and ``batched_mm``): MiniMax-M3's clamped SwiGLU over halves
(``swigluoai_uninterleave``), DeepSeek-V4's / GLM-5-Next's / Hunyuan-V4's clamped SiLU (``silu_clamp:<L>``),
Step-3.7's SwiGLU-step (``swiglustep``), Nemotron-H's non-gated ReLU² and the other non-gated activations
(``<act>_no_mul``), and the constants of the clamped ones as graph inputs under ``dynamic=True``
(``activation_constants``).

Every block is built from transformers' own classes (tiny configs, random weights, nothing downloaded) with weights
large enough that the clamps bite (``assert_clamps_bite``), compiled with rubin and compared with eager in fp32
(1e-4 of the output's scale). Near misses stay unchanged with a reason that names the numbers, and still compute
what eager does.
"""

from __future__ import annotations

import math
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.conftest import RubinRun, assert_close_to_eager, count_ops
from tests.cpu.passes.match_moe.families import require

transformers = pytest.importorskip("transformers")
from transformers.activations import ACT2FN  # noqa: E402
from transformers.integrations import moe as hf_moe  # noqa: E402

H, E, I, K, TOKENS = 32, 8, 16, 2, 14
IMPLS = ["grouped_mm", "batched_mm"]
PROJECTIONS = ("transformers.grouped_mm_fallback", "aten._grouped_mm", "aten.bmm")


# --- blocks ------------------------------------------------------------------------------------------------------


def _init(block: nn.Module, limit: float) -> nn.Module:
    """Matrices N(0, (limit / sqrt(fan_in))^2), so that a gate / up pre-activation on unit inputs has a standard
    deviation of ``limit`` and a third of them lie beyond +-limit; vectors (biases, correction biases) N(0, 0.1^2)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in list(block.named_parameters()) + list(block.named_buffers()):
            if p.is_floating_point():
                std = limit / math.sqrt(p.shape[-1]) if p.dim() >= 2 else 0.1
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return block.eval()


def minimax_m3(impl: str, limit: float = 7.0, alpha: float = 1.702) -> nn.Module:
    require("minimax_m3_vl")
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m

    cfg = transformers.MiniMaxM3VLTextConfig(
        hidden_size=H,
        intermediate_size=I,
        shared_intermediate_size=I,
        num_local_experts=E,
        num_experts_per_tok=K,
        num_hidden_layers=1,
        swiglu_limit=limit,
        swiglu_alpha=alpha,
    )
    cfg._experts_implementation = impl
    return _init(m.MiniMaxM3VLSparseMoeBlock(cfg), limit)


def deepseek_v4(impl: str, limit: float = 3.0) -> nn.Module:
    require("deepseek_v4")
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    cfg = transformers.DeepseekV4Config(
        hidden_size=H,
        moe_intermediate_size=I,
        n_routed_experts=E,
        num_experts_per_tok=K,
        num_hidden_layers=1,
        mlp_layer_types=["moe"],  # a learned top-k router (the first layers' default is hash routing)
        swiglu_limit=limit,
    )
    cfg._experts_implementation = impl
    block = m.DeepseekV4SparseMoeBlock(cfg, 0)
    assert isinstance(block.experts.act_fn, type(ACT2FN["silu"])), block.experts.act_fn  # config.hidden_act: silu
    return _init(block, limit)


def glm5_next(impl: str, limit: float = 3.0) -> nn.Module:
    require("glm5_next")
    from transformers.models.glm5_next import configuration_glm5_next as c
    from transformers.models.glm5_next import modeling_glm5_next as m

    cfg = c.Glm5NextTextConfig(
        hidden_size=H,
        moe_intermediate_size=I,
        n_routed_experts=E,
        num_experts_per_tok=K,
        num_hidden_layers=1,
        swiglu_limit=limit,
    )
    cfg._experts_implementation = impl
    return _init(m.Glm5NextTextMoE(cfg), limit)


def hy_v4(impl: str, limit: float = 3.0) -> nn.Module:
    require("hy_v4")
    from transformers.models.hy_v4 import modeling_hy_v4 as m

    cfg = transformers.HYV4Config(
        hidden_size=H,
        moe_intermediate_size=I,
        n_routed_experts=E,
        num_experts_per_tok=K,
        num_hidden_layers=1,
        swiglu_limit=limit,
    )
    cfg._experts_implementation = impl
    return _init(m.HYV4MoE(cfg), limit)


def step3p7(impl: str, limit: float = 3.0) -> nn.Module:
    """Step-3.7's MoE block with its own experts class decorated by transformers' ``use_experts_implementation``
    (a subclass: transformers 5.19-5.24 leave ``Step3p7Experts`` undecorated, an eager loop over the experts hit,
    which breaks the graph), so that its ``_apply_gate`` (SiLU, then the clamp) runs in the grouped / batched
    forms."""
    require("step3p7")
    from transformers.models.step3p7 import configuration_step3p7 as c
    from transformers.models.step3p7 import modeling_step3p7 as m

    cfg = c.Step3p7TextConfig(
        hidden_size=H,
        moe_intermediate_size=I,
        share_expert_dim=I,
        num_local_experts=E,
        n_routed_experts=E,
        num_experts_per_tok=K,
        num_hidden_layers=1,
        swiglu_limits=[limit],
    )
    cfg._experts_implementation = impl
    block = m.Step3p7SparseMoeBlock(cfg, 0)
    if not hasattr(m.Step3p7Experts.forward, "__wrapped__"):  # not decorated (yet)
        decorated = hf_moe.use_experts_implementation(type("Step3p7GroupedExperts", (m.Step3p7Experts,), {}))
        block.experts = decorated(cfg, swiglu_limit=limit)
    return _init(block, limit)


def nemotron_h(impl: str) -> nn.Module:
    from transformers.models.nemotron_h import modeling_nemotron_h as m

    cfg = transformers.NemotronHConfig(
        hidden_size=H,
        moe_intermediate_size=I,
        moe_shared_expert_intermediate_size=I,
        n_routed_experts=E,
        num_experts_per_tok=K,
        num_hidden_layers=1,
    )
    cfg._experts_implementation = impl
    assert cfg.mlp_hidden_act == "relu2"
    return _init(m.NemotronHMoE(cfg), 1.0)


class RouterExperts(nn.Module):
    """A transformers router followed by an experts module, as transformers' MoE blocks call them."""

    def __init__(self, router: nn.Module, experts: nn.Module) -> None:
        super().__init__()
        self.router, self.experts = router, experts

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        _, weights, ids = self.router(flat)
        return self.experts(flat, ids, weights).reshape(x.shape)


def ungated(impl: str, act: str, has_bias: bool = False, is_transposed: bool = False) -> nn.Module:
    """A non-gated experts class decorated exactly as transformers' own (``has_gate=False``: one ``up_proj``, the
    activation on its whole output, as NemotronHExperts), behind Qwen3-MoE's router."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    @hf_moe.use_experts_implementation(has_gate=False, has_bias=has_bias, is_transposed=is_transposed)
    class UngatedExperts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = E
            self.up_proj = nn.Parameter(torch.empty((E, H, I) if is_transposed else (E, I, H)))
            self.down_proj = nn.Parameter(torch.empty((E, I, H) if is_transposed else (E, H, I)))
            if has_bias:
                self.up_proj_bias = nn.Parameter(torch.empty(E, I))
                self.down_proj_bias = nn.Parameter(torch.empty(E, H))
            self.act_fn = ACT2FN[act]

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise AssertionError("the grouped_mm / batched_mm experts implementation replaces this")

    cfg = transformers.Qwen3MoeConfig(
        hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K, norm_topk_prob=True
    )
    cfg._experts_implementation = impl
    return _init(RouterExperts(Qwen3MoeTopKRouter(cfg), UngatedExperts(cfg)), 1.0)


def gpt_oss(impl: str, limit: float = 7.0, alpha: float = 1.702) -> nn.Module:
    cfg = transformers.GptOssConfig(
        hidden_size=H,
        intermediate_size=I,
        num_local_experts=E,
        num_experts_per_tok=K,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        layer_types=["full_attention"],
        swiglu_limit=limit,
        swiglu_alpha=alpha,
    )
    cfg._experts_implementation = impl
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    block = GptOssMLP(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # gate_up_proj is stored [E, H, 2I]: fan-in H on dim 1
        for p in block.parameters():
            std = limit / math.sqrt(H) if p.dim() >= 2 else 0.1
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return block.eval()


# --- checks ------------------------------------------------------------------------------------------------------


def gate_up_of(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Every expert's first projection of ``x`` (before any bias): [E, T, N]."""
    experts = block.experts
    w = experts.gate_up_proj if getattr(experts, "has_gate", True) else experts.up_proj
    if getattr(experts, "is_transposed", False):
        w = w.transpose(1, 2)
    return torch.einsum("th,enh->etn", x.reshape(-1, H).float(), w.float())


def assert_clamps_bite(block: nn.Module, x: torch.Tensor, limit: float, interleaved: bool = False) -> None:
    """More than 5% of the gate pre-activations lie above ``limit`` and of the up ones beyond +-limit: a rewrite
    that dropped or misplaced a clamp would change the output."""
    with torch.no_grad():
        h = gate_up_of(block, x)
    gate, up = (h[..., 0::2], h[..., 1::2]) if interleaved else h.chunk(2, dim=-1)
    assert (gate > limit).float().mean() > 0.05, (gate > limit).float().mean()
    assert (up.abs() > limit).float().mean() > 0.05, (up.abs() > limit).float().mean()


def _out(y):
    return y[0] if isinstance(y, tuple) else y  # GPT-OSS's block returns (hidden, router scores)


def run(tmp_path, block: nn.Module, dynamic=None, tokens=(TOKENS,), changes=()) -> RubinRun:
    """Compile ``block`` with rubin and call it at each token count (then once per ``changes`` entry, a function
    that changes the block's constants in place), each call against eager in fp32."""
    rubin = RubinRun(tmp_path / "dumps")
    compiled = rubin.compile(block, dynamic=dynamic)
    calls = [(t, None) for t in tokens] + [(tokens[-1], c) for c in changes]
    for t, change in calls:
        if change is not None:
            change(block)
        x = torch.randn(1, t, H)
        with torch.no_grad():
            assert_close_to_eager(_out(compiled(x)), _out(block(x)), torch.float32)
    return rubin


def moe_rewrites(rubin: RubinRun, impl: str) -> list[dict]:
    idiom = "hf grouped_mm" if impl == "grouped_mm" else "hf batched_mm"
    return [r for r in rubin.rewrites() if r["source_idiom"].startswith(idiom)]


def unchanged(rubin: RubinRun, impl: str) -> list[dict]:
    idiom = "hf grouped_mm" if impl == "grouped_mm" else "hf batched_mm"
    return [u for u in rubin.unchanged() if u["idiom"] == idiom]


def assert_rewritten(rubin: RubinRun, impl: str, activation: str, layout: str) -> list[dict]:
    """Every compiled graph rewrote its one experts block into rubin.moe with ``activation`` and the gate / up
    ``layout`` ("halves", "interleaved", "not gated"); no experts block left."""
    found = moe_rewrites(rubin, impl)
    assert len(found) == len(rubin.reports()) and not unchanged(rubin, impl), rubin.unchanged()
    for r in found:
        assert r["details"]["activation"] == activation, r["details"]
        assert r["details"]["gate_up"].startswith(layout), r["details"]
    code = rubin.matched_code()
    assert count_ops(code, "rubin.moe") == len(found)
    assert sum(count_ops(code, op) for op in PROJECTIONS) == 0, "a projection of the experts is left"
    return found


# --- gated activations over halves, constants as numbers ----------------------------------------------------------

GATED = [  # (id, build(impl), rubin activation, the limit the clamps bite at)
    ("minimax_m3", lambda impl: minimax_m3(impl), "swigluoai_uninterleave", 7.0),
    ("minimax_m3_other_constants", lambda impl: minimax_m3(impl, 3.0, 1.25), "swigluoai_uninterleave:1.25:3.0", 3.0),
    ("deepseek_v4", lambda impl: deepseek_v4(impl), "silu_clamp:3.0", 3.0),
    ("glm5_next", lambda impl: glm5_next(impl, 2.5), "silu_clamp:2.5", 2.5),
    ("hy_v4", lambda impl: hy_v4(impl), "silu_clamp:3.0", 3.0),
    ("step3p7_decorated", lambda impl: step3p7(impl), "swiglustep:3.0", 3.0),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("build, activation, limit", [pytest.param(*g[1:], id=g[0]) for g in GATED])
def test_gated_families_rewritten_and_exact(tmp_path, impl, build, activation, limit):
    block = build(impl)
    assert_clamps_bite(block, torch.randn(1, TOKENS, H), limit)
    rubin = run(tmp_path, block)
    (r,) = assert_rewritten(rubin, impl, activation, "halves")
    assert "activation_constants" not in r["details"]  # static: the constants are in the string
    assert r["details"]["weights"] == "as stored, no copy"
    assert "activation_constants" not in rubin.matched_code()


def test_gpt_oss_math_over_halves_is_swigluoai_uninterleave(tmp_path, monkeypatch):
    """GPT-OSS's own block with its ``_apply_gate`` over ``chunk(2)`` halves (MiniMax-M3's form): before, a near miss
    ("swigluoai over halved gate / up"); now vLLM's swigluoai_uninterleave, with GPT-OSS's biases."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    def apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    monkeypatch.setattr(modeling_gpt_oss.GptOssExperts, "_apply_gate", apply_gate)
    (r,) = assert_rewritten(run(tmp_path, gpt_oss("grouped_mm")), "grouped_mm", "swigluoai_uninterleave", "halves")
    assert r["details"]["bias"] is True


# --- not gated (has_gate=False) ------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_nemotron_h_relu2_rewritten_and_exact(tmp_path, impl):
    (r,) = assert_rewritten(run(tmp_path, nemotron_h(impl)), impl, "relu2_no_mul", "not gated")
    assert r["details"]["I"] == I


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "act, activation",
    [
        ("silu", "silu_no_mul"),
        ("gelu", "gelu_no_mul"),
        ("gelu_pytorch_tanh", "gelu_tanh_no_mul"),
        ("relu", "relu_no_mul"),
        ("relu2", "relu2_no_mul"),
    ],
)
def test_ungated_activations_rewritten_and_exact(tmp_path, impl, act, activation):
    assert_rewritten(run(tmp_path, ungated(impl, act)), impl, activation, "not gated")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("has_bias, is_transposed", [(True, False), (False, True), (True, True)])
def test_ungated_biased_and_transposed_experts(tmp_path, impl, has_bias, is_transposed):
    (r,) = assert_rewritten(run(tmp_path, ungated(impl, "silu", has_bias, is_transposed)), impl, "silu_no_mul", "not")
    assert r["details"]["bias"] is has_bias
    assert ("up_proj is stored [E, H, I]" in r["details"]["weights"]) is is_transposed


# --- dynamic=True: the constants are graph inputs -----------------------------------------------------------------


def _set(**values) -> Callable[[nn.Module], None]:
    def change(block: nn.Module) -> None:
        for name, value in values.items():
            setattr(block.experts, name, value)

    return change


DYNAMIC = [  # (id, build(impl), kind, limit, attribute changes between calls)
    ("gpt_oss", lambda impl: gpt_oss(impl, 3.0, 1.25), "swigluoai", 3.0, _set(limit=2.0, alpha=1.5), True),
    (
        "minimax_m3",
        lambda impl: minimax_m3(impl, 3.0, 1.25),
        "swigluoai_uninterleave",
        3.0,
        _set(swiglu_limit=2.0, swiglu_alpha=1.5),
        False,
    ),
    ("deepseek_v4", lambda impl: deepseek_v4(impl), "silu_clamp", 3.0, _set(limit=2.0), False),
    ("glm5_next", lambda impl: glm5_next(impl), "silu_clamp", 3.0, _set(swiglu_limit=2.0), False),
    ("step3p7_decorated", lambda impl: step3p7(impl), "swiglustep", 3.0, _set(limit=2.0), False),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("build, kind, limit, change, interleaved", [pytest.param(*d[1:], id=d[0]) for d in DYNAMIC])
def test_constants_as_graph_inputs(tmp_path, impl, build, kind, limit, change, interleaved):
    """Under dynamic=True Dynamo makes the float attributes graph inputs (torch 2.15: alpha and limit; 2.13: alpha,
    the clamps' limit specialised): rubin.moe gets them as activation_constants, built in the graph, so the same
    compiled graph is exact at two token counts and after the constants change (a graph whose constant was
    specialised recompiles on the change: it must be rewritten too)."""
    block = build(impl)
    assert_clamps_bite(block, torch.randn(1, TOKENS, H), limit, interleaved)
    rubin = run(tmp_path, block, dynamic=True, tokens=(6, 11), changes=(change,))
    found = moe_rewrites(rubin, impl)
    assert found and len(found) == len(rubin.reports()) and not unchanged(rubin, impl), rubin.unchanged()
    names = {"swigluoai": ("alpha", "limit"), "swigluoai_uninterleave": ("alpha", "limit")}.get(kind, ("limit",))
    for r in found:
        d = r["details"]
        assert d["activation"].split(":")[0] == kind, d
        assert d["gate_up"].startswith("interleaved" if interleaved else "halves"), d
        runtime = d.get("activation_constants")
        if runtime is None:  # every constant specialised (a limit on torch 2.13): in the string
            assert ":" in d["activation"], d
            continue
        assert d["activation"] == kind, d  # the kind alone: the values come at run time
        assert set(runtime) - {"passed as"} == set(names), runtime
        assert any("graph input" in runtime[n] for n in names), runtime
    code = rubin.matched_code()
    assert count_ops(code, "rubin.moe") == len(found)
    if any("activation_constants" in r["details"] for r in found):
        assert "activation_constants = " in code
    if kind in ("swigluoai", "swigluoai_uninterleave"):  # alpha is a graph input on every torch here
        assert all("activation_constants" in r["details"] for r in found), [r["details"] for r in found]


# --- bf16 (aten._grouped_mm under torch.compile), and GPU targets -----------------------------------------------


@pytest.mark.parametrize(
    "build, impl",
    [
        pytest.param(lambda impl: minimax_m3(impl, 3.0), "grouped_mm", id="minimax_m3"),
        pytest.param(deepseek_v4, "grouped_mm", id="deepseek_v4"),
        pytest.param(step3p7, "batched_mm", id="step3p7_batched_mm"),
        pytest.param(nemotron_h, "grouped_mm", id="nemotron_h"),
        pytest.param(nemotron_h, "batched_mm", id="nemotron_h_batched_mm"),
    ],
)
def test_bf16_against_inductor(build, impl):
    """bf16 blocks (transformers' F.grouped_mm, upcasts around the clamps) against the same block compiled by
    Inductor alone, on the same input (so the same routing): rewritten, within bf16's tolerance."""
    from tests.conftest import assert_moe_blocks_close
    from tests.cpu.passes.match_moe.test_hf_grouped_mm import skip_if_bf16_grouped_mm_breaks_the_graph

    if impl == "grouped_mm":
        skip_if_bf16_grouped_mm_breaks_the_graph(torch.bfloat16)
    block = build(impl).to(torch.bfloat16)
    x = torch.randn(1, TOKENS, H, dtype=torch.bfloat16)
    assert_moe_blocks_close([block], [x], torch.bfloat16)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_left_to_inductor_on_a_gpu_target(tmp_path, dynamic):
    """Planned for sm90 in bf16, where no GPU kernel implements silu_clamp (nor run-time constants), the block stays
    as written with that reason (only the reference, a loop over the experts, would take it)."""
    block = deepseek_v4("grouped_mm").to(torch.bfloat16)
    rubin = RubinRun(tmp_path / "dumps")
    compiled = rubin.compile(block, dynamic=dynamic, target="sm90")
    x = torch.randn(1, 7, H, dtype=torch.bfloat16)
    with torch.no_grad():
        assert_close_to_eager(compiled(x), block(x), torch.bfloat16)
    assert moe_rewrites(rubin, "grouped_mm") == []
    reasons = [u["reason"] for u in unchanged(rubin, "grouped_mm")]
    assert reasons and all("only the reference implements activation silu_clamp" in r for r in reasons), reasons
    for r in reasons:
        if "silu_clamp and runtime_activation_constants" in r:  # torch 2.15: the limit is a graph input
            assert dynamic and "triton does not implement runtime_activation_constants" in r, r
        else:
            assert "triton: activation silu_clamp:3.0 is not implemented" in r, r


# --- near misses ---------------------------------------------------------------------------------------------------


def _deepseek_v4_gate(monkeypatch, gate_fn) -> nn.Module:
    require("deepseek_v4")
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    monkeypatch.setattr(m.DeepseekV4Experts, "_apply_gate", gate_fn)
    return deepseek_v4("grouped_mm")


def _minimax_gate(monkeypatch, gate_fn) -> nn.Module:
    require("minimax_m3_vl")
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m

    monkeypatch.setattr(m.MiniMaxM3VLExperts, "_apply_gate", gate_fn)
    return minimax_m3("grouped_mm", 3.0)


def _unequal_limits(self, gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return self.act_fn(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit / 2, max=self.limit / 2)


def _offset_half(self, gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=self.swiglu_limit)
    up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
    return (up + 0.5) * (gate * torch.sigmoid(gate * self.swiglu_alpha))


def _alpha_without_offset(alpha):
    def gate_fn(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (gate * torch.sigmoid(gate * alpha)) * up

    return gate_fn


def _silu_clamp_interleaved(self, gate_up):
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    return self.act_fn(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)


def _gate_clamped_both_ways(self, gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(min=-self.limit, max=self.limit)
    return self.act_fn(gate) * up.clamp(min=-self.limit, max=self.limit)


def _computed_limit(self, gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    limit = self.down_proj.detach().abs().amax() * 10  # a value the graph computes
    return self.act_fn(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


@pytest.mark.parametrize(
    "build, reason",
    [
        (
            lambda mp: _deepseek_v4_gate(mp, _unequal_limits),
            "a clamped SiLU (silu(gate.clamp(max=L)) * up.clamp(-L, L)) with different limits for gate and up "
            "(gate clamp_max 3.0, up clamp_min -1.5, clamp_max 1.5)",
        ),
        (lambda mp: _minimax_gate(mp, _offset_half), "whose offset on up is 0.5, not 1"),
        (
            lambda mp: _deepseek_v4_gate(mp, _alpha_without_offset(1.702)),
            "without the + 1 on up (gate * sigmoid(alpha * gate) * up) with alpha 1.702",
        ),
        (
            lambda mp: _deepseek_v4_gate(mp, _silu_clamp_interleaved),
            "the experts' activation is silu_clamp over interleaved gate / up columns",
        ),
        (
            lambda mp: _deepseek_v4_gate(mp, _gate_clamped_both_ways),
            "is not act(gate) * up with a recognised activation",
        ),
        (lambda mp: _deepseek_v4_gate(mp, _computed_limit), "is computed in the graph"),
    ],
    ids=["unequal_limits", "offset_not_one", "alpha_on_silu_clamp", "silu_clamp_interleaved", "gate_min", "computed"],
)
def test_near_misses_left_unchanged_with_reason(tmp_path, monkeypatch, build, reason):
    rubin = run(tmp_path, build(monkeypatch))
    assert moe_rewrites(rubin, "grouped_mm") == []
    (left,) = unchanged(rubin, "grouped_mm")
    assert reason in left["reason"], left["reason"]
    code = rubin.matched_code()
    assert count_ops(code, "rubin.moe") == 0 and count_ops(code, "transformers.grouped_mm_fallback") == 2


# --- the run-time constants themselves, on traced graphs -----------------------------------------------------------


def _traced(fn, *limits):
    from torch._inductor.pattern_matcher import fwd_only

    gm = fwd_only(fn, [torch.randn(6, 2 * I)] + [torch.tensor(v) for v in limits])
    out = gm.graph.output_node().args[0]
    act_out = out[0] if isinstance(out, (tuple, list)) else out
    h = next(n for n in gm.graph.nodes if n.op == "placeholder")
    return h, act_out


def test_one_graph_input_must_feed_every_clamp_of_the_limit():
    """Two graph inputs of equal value at trace time are still two values: the clamps of one limit must read the
    same input (up to conversions; the up's minimum its negation), or the block is left with the reason."""
    from rubin_compile.passes.match_moe import hf_activation

    def one(h, lim):
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate.clamp(max=lim)) * up.clamp(min=-lim, max=lim)

    def two(h, lim, lim_up):
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate.clamp(max=lim)) * up.clamp(min=-lim_up, max=lim_up)

    def not_negated(h, lim):
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate.clamp(max=lim)) * up.clamp(min=lim, max=lim)

    found = hf_activation.match(*_traced(one, 3.0), "down")
    assert (found.activation, found.layout) == ("silu_clamp", hf_activation.HALVES)
    assert len(found.constants) == 1 and found.constants[0].op == "placeholder"
    assert "graph input" in found.constants_report["limit"]
    with pytest.raises(hf_activation.NoMatch, match=r"different limits for gate and up .*lim_up"):
        hf_activation.match(*_traced(two, 3.0, 3.0), "down")
    with pytest.raises(hf_activation.NoMatch, match="different limits for gate and up"):
        hf_activation.match(*_traced(not_negated, 3.0), "down")


def test_numbers_and_graph_inputs_mixed():
    """GPT-OSS's form with alpha a graph input and the limit a number (torch 2.13 under dynamic=True): the kind
    alone, and both constants passed (the number as itself)."""
    from rubin_compile.passes.match_moe import hf_activation

    def alpha_input(h, alpha):
        gate, up = h.chunk(2, dim=-1)
        gate = gate.clamp(max=3.0)
        up = up.clamp(min=-3.0, max=3.0)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    found = hf_activation.match(*_traced(alpha_input, 1.25), "down")
    assert found.activation == "swigluoai_uninterleave"
    assert found.constants[0].op == "placeholder" and found.constants[1] == 3.0
    assert found.constants_report == {"alpha": "alpha_1 (a graph input)", "limit": "3.0"}
