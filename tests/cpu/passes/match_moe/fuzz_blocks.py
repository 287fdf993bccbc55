"""Strategies and builders for the MoE fuzzer (test_fuzz.py): a ``Case`` says everything about one drawn MoE block
(its form, sizes, routing, activation, biases, shared experts, dtype, token count and shape mode, and the seed of
its weights and inputs), ``build(case)`` makes the block and ``inputs(case, tokens)`` its hidden states.

Two forms of block:

* ``"loop"``: plain PyTorch, a loop over per-expert ``nn.Linear`` modules with the dense mask
  ``(w * (ids == e)).sum(-1, keepdim=True) * expert(x)`` (the idiom of ``match_moe/expert_loop.py``), behind one of
  the routers below, with or without shared experts.
* ``"hf"``: Hugging Face transformers' own classes built from tiny configs (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE,
  DeepSeek-V3 sparse MoE blocks; GPT-OSS's own block, clamped SwiGLU over interleaved gate / up; GPT-OSS's router in
  front of concatenated experts; a top-k-then-sigmoid router in front of Qwen3-MoE's experts; Qwen3-MoE's router in
  front of MiniMax-M3's experts (clamped SwiGLU over halves), DeepSeek-V4's (clamped SiLU) or Nemotron-H's (not
  gated, its activation drawn), with a drawn limit that bites), their experts in the
  ``grouped_mm`` (default) or ``batched_mm`` form; optionally
  with biased and / or transposed experts (an experts class decorated by transformers' own
  ``use_experts_implementation(has_bias=..., is_transposed=...)``, as in test_hf_grouped_mm.py).

``Case`` has a plain ``repr`` so that a failing example hypothesis prints can be pasted into an ``@example``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ACTS = {
    "silu": F.silu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "gelu": F.gelu,  # exact GELU
    "relu": F.relu,  # rubin.moe does not implement it: a near miss, left unchanged with a reason
}
SUPPORTED_ACTS = ("silu", "gelu_tanh", "gelu")  # rubin.moe's gated activations (GPT-OSS's swigluoai aside)
HF_ACTS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu", "relu": "relu", "swigluoai": "silu"}
# Families whose experts class has its own activation: (rubin.moe's kind, or None when drawn (Nemotron-H)).
OWN_ACTIVATION = {
    "gpt_oss": "swigluoai",
    "minimax_m3": "swigluoai_uninterleave",
    "deepseek_v4": "silu_clamp",
    "nemotron_h": None,
}
# Nemotron-H's experts (has_gate=False) with each activation rubin.moe takes non-gated: transformers' ACT2FN names.
UNGATED_ACTS = {
    "relu2_no_mul": "relu2",
    "silu_no_mul": "silu",
    "gelu_no_mul": "gelu",
    "gelu_tanh_no_mul": "gelu_pytorch_tanh",
    "relu_no_mul": "relu",
}
CLAIMED_ACTS = SUPPORTED_ACTS + ("swigluoai", "swigluoai_uninterleave", "silu_clamp") + tuple(UNGATED_ACTS)

# Routers. softmax_topk: softmax (fp32) then top-k, renormalised or not (Mixtral, Qwen2/3-MoE, OLMoE).
# topk_softmax: top-k of the logits then softmax over the k (GPT-OSS; with a router bias there).
# sigmoid_grouped: sigmoid scores, score-correction bias for the choice only, group-limited top-k, weights gathered
# from the unbiased scores, renormalised or not, times a routed scaling factor (DeepSeek-V3).
# topk_sigmoid: top-k of the logits then sigmoid (Llama 4).
LOOP_ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_grouped", "topk_sigmoid")
HF_FAMILIES = (
    "qwen3_moe",
    "mixtral",
    "olmoe",
    "qwen2_moe",
    "deepseek_v3",
    "gpt_oss_router",
    "topk_sigmoid",
    "gpt_oss",
    "minimax_m3",
    "deepseek_v4",
    "nemotron_h",
)
# Qwen3-MoE's router in front of these families' own experts classes.
OWN_EXPERTS_BEHIND_QWEN3_ROUTER = ("minimax_m3", "deepseek_v4", "nemotron_h")
# The transformers model type each family's modules come from (the synthetic routers' blocks: Qwen3-MoE's).
HF_MODEL_TYPE = dict(
    {f: f for f in HF_FAMILIES}, gpt_oss_router="gpt_oss", topk_sigmoid="qwen3_moe", minimax_m3="minimax_m3_vl"
)
# static: dynamic=False; dynamic: dynamic=True; mark_dynamic: torch._dynamo.mark_dynamic on T; automatic: the
# default (dynamic=None), the second token count recompiles with a symbolic T (automatic dynamic shapes)
SHAPE_MODES = ("static", "dynamic", "mark_dynamic", "automatic")


@dataclass(frozen=True)
class Case:
    form: str  # "loop" or "hf"
    family: str  # "loop", or one of HF_FAMILIES
    E: int
    k: int
    H: int
    I: int
    act: str  # a key of ACTS, or rubin.moe's kind of a family's own experts (OWN_ACTIVATION, UNGATED_ACTS)
    routing: str  # one of LOOP_ROUTINGS (for "hf", the family's own; see hf_routing)
    renorm: bool = False  # softmax_topk / sigmoid_grouped: renormalise the top-k weights (norm_topk_prob)
    router_bias: bool = False  # loop form: nn.Linear(bias=True) router
    n_group: int = 1  # sigmoid_grouped
    topk_group: int = 1
    scale: float = 1.0  # routed scaling factor (sigmoid_grouped)
    expert_bias: bool = False
    shared: str = "none"  # "none", "plain" (out + shared(x)), "gated" (out + sigmoid(g(x)) * shared(x))
    impl: str = "grouped_mm"  # hf: the experts implementation ("grouped_mm" or "batched_mm")
    transposed: bool = False  # hf: experts stored [E, H, 2I] / [E, I, H] (Aria's layout)
    limit: Optional[float] = None  # the clamp limit (swiglu_limit) of MiniMax-M3's / DeepSeek-V4's experts
    dtype: str = "fp32"
    T: int = 8
    T2: Optional[int] = None  # a second call at this token count (dynamic shape modes)
    shapes: str = "static"  # one of SHAPE_MODES
    seed: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def token_counts(self) -> tuple[int, ...]:
        return (self.T,) if self.T2 is None else (self.T, self.T2)


# ------------------------------------------------------------------------------------------------
# what rubin claims
# ------------------------------------------------------------------------------------------------


def claimed(case: Case) -> Optional[str]:
    """None if rubin claims to rewrite ``case`` into rubin.moe (README's idiom table, the matchers' docstrings);
    otherwise why it need not (the report must then give a reason of its own, or the rewrite be right)."""
    if case.act not in CLAIMED_ACTS:
        return f"activation {case.act} is not one rubin.moe implements"
    if case.form == "loop":
        if case.expert_bias:
            return "biased nn.Linear experts are not the expert loop idiom (bias-free mm bodies)"
        if case.E < 2:
            return "a loop over one expert is not grouped"
        if case.shared != "none":
            return "expert_loop combines the experts by one sum; a shared expert added to it is another addend"
    return None


# ------------------------------------------------------------------------------------------------
# strategies
# ------------------------------------------------------------------------------------------------

# rubin.moe's activations, and ReLU (a near miss) one time in six
ACT_CHOICES = st.sampled_from(["silu", "gelu_tanh", "silu", "gelu_tanh", "gelu", "relu"])
SMALL_DIMS = st.sampled_from([8, 16, 24, 32, 48, 64])
# T = 0, T = 1, odd, large
TOKENS = st.one_of(st.just(0), st.just(1), st.sampled_from([3, 5, 7, 9, 13, 31]), st.integers(64, 200))


@st.composite
def _common(draw, case: Case, dtypes: tuple) -> Case:
    """Dtype, token counts, shape mode and seed, the same for both forms."""
    shapes = draw(st.sampled_from(SHAPE_MODES))
    T = draw(TOKENS)
    T2 = None
    if shapes != "static":
        T2 = draw(st.integers(2, 200).filter(lambda t: t != T))
    return replace(
        case,
        dtype=draw(st.sampled_from(dtypes)),
        T=T,
        T2=T2,
        shapes=shapes,
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@st.composite
def _sigmoid_grouping(draw, E: int) -> tuple[int, int, int]:
    """(n_group, topk_group, k) for a DeepSeek-style grouped top-k over E experts: groups of at least two (the
    group score is the sum of a group's top two) and k no more than the experts of the chosen groups."""
    n_group = draw(st.sampled_from([g for g in range(1, E // 2 + 1) if E % g == 0]))
    topk_group = draw(st.integers(1, n_group))
    k = draw(st.integers(1, topk_group * (E // n_group)))
    return n_group, topk_group, k


@st.composite
def loop_cases(draw, routing: str, dtypes: tuple) -> Case:
    """Loop-form blocks behind ``routing``: E in 1..8 (the loop unrolls, so E stays small), any k, H / I from 4 to
    64 (odd ones too), any activation, router / expert biases or not, shared experts or not."""
    E = draw(st.integers(2 if routing == "sigmoid_grouped" else 1, 8))
    n_group = topk_group = 1
    if routing == "sigmoid_grouped":
        n_group, topk_group, k = draw(_sigmoid_grouping(E))
    else:
        k = draw(st.integers(1, E))
    case = Case(
        form="loop",
        family="loop",
        E=E,
        k=k,
        H=draw(SMALL_DIMS | st.integers(4, 40)),
        I=draw(SMALL_DIMS | st.integers(4, 40)),
        act=draw(ACT_CHOICES),
        routing=routing,
        renorm=draw(st.booleans()) if routing in ("softmax_topk", "sigmoid_grouped") else False,
        router_bias=True if routing == "topk_softmax" else draw(st.booleans()),
        n_group=n_group,
        topk_group=topk_group,
        scale=draw(st.sampled_from([1.0, 2.5])) if routing == "sigmoid_grouped" else 1.0,
        expert_bias=draw(st.booleans()),
        shared=draw(st.sampled_from(["none", "plain", "gated"])),
    )
    return draw(_common(case, dtypes))


@st.composite
def hf_cases(draw, family: str, dtypes: tuple) -> Case:
    """Blocks of transformers' ``family``: E in 2..16 or 32, 64, 128, any k (any grouping for DeepSeek-V3), H / I
    multiples of 8 (transformers' grouped mm wants 16-byte rows), the family's own routing with its options drawn,
    grouped_mm or batched_mm experts, biased / transposed experts or the family's own."""
    E = draw(st.sampled_from([*range(2, 17), 32, 64, 128]))  # one time in six many experts, most with no token
    n_group = topk_group = 1
    if family == "deepseek_v3":
        n_group, topk_group, k = draw(_sigmoid_grouping(E))
    else:
        k = draw(st.integers(1, E))
    shared = {"qwen2_moe": "gated", "deepseek_v3": "plain"}.get(family, "none")
    if family in ("gpt_oss_router", "topk_sigmoid") + OWN_EXPERTS_BEHIND_QWEN3_ROUTER:
        shared = draw(st.sampled_from(["none", "plain", "gated"]))
    # GPT-OSS's experts are its own (interleaved, clamped, biased); so are MiniMax-M3's, DeepSeek-V4's, Nemotron-H's
    own_experts = family in OWN_ACTIVATION
    renorm = {"mixtral": True, "gpt_oss_router": False, "gpt_oss": False, "topk_sigmoid": False}.get(family)
    H, I = draw(SMALL_DIMS), draw(SMALL_DIMS)  # (drawn in the order they always were)
    if own_experts:
        act = OWN_ACTIVATION[family] or draw(st.sampled_from(sorted(UNGATED_ACTS)))
    else:
        act = draw(ACT_CHOICES)
    # a limit that bites (pre-activations are of order one): drawn for the families added with it only, so that the
    # others' derandomised examples stay what they were
    limit = draw(st.sampled_from([0.5, 1.0, 2.0, 7.0])) if family in ("minimax_m3", "deepseek_v4") else None
    case = Case(
        form="hf",
        family=family,
        E=E,
        k=k,
        H=H,
        I=I,
        act=act,
        limit=limit,
        routing=hf_routing(family),
        renorm=draw(st.booleans()) if renorm is None else renorm,
        n_group=n_group,
        topk_group=topk_group,
        scale=draw(st.sampled_from([1.0, 2.5])) if family == "deepseek_v3" else 1.0,
        expert_bias=family == "gpt_oss" if own_experts else draw(st.booleans()),
        shared=shared,
        impl=draw(st.sampled_from(["grouped_mm", "batched_mm"])),
        transposed=False if own_experts else draw(st.booleans()),
    )
    return draw(_common(case, dtypes))


def hf_routing(family: str) -> str:
    return {
        "deepseek_v3": "sigmoid_grouped",
        "gpt_oss_router": "topk_softmax",
        "gpt_oss": "topk_softmax",
        "topk_sigmoid": "topk_sigmoid",
    }.get(family, "softmax_topk")


# ------------------------------------------------------------------------------------------------
# plain-PyTorch loop blocks
# ------------------------------------------------------------------------------------------------


class Expert(nn.Module):
    """down(act(gate(x)) * up(x)) with per-expert nn.Linear modules (bias or not)."""

    def __init__(self, hidden: int, inter: int, act: str, bias: bool) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, inter, bias=bias)
        self.up = nn.Linear(hidden, inter, bias=bias)
        self.down = nn.Linear(inter, hidden, bias=bias)
        self.act = ACTS[act]

    def forward(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x))


class Router(nn.Module):
    """The routers of LOOP_ROUTINGS, as the model code they come from writes them: (topk_weights, topk_ids)."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        self.case = case
        self.proj = nn.Linear(case.H, case.E, bias=case.router_bias)
        if case.routing == "sigmoid_grouped":
            self.register_buffer("e_score_correction_bias", torch.zeros(case.E))

    def forward(self, x):
        c = self.case
        logits = self.proj(x)
        if c.routing == "softmax_topk":
            w, ids = torch.topk(logits.softmax(-1, dtype=torch.float32), c.k, dim=-1)
            if c.renorm:
                w = w / w.sum(-1, keepdim=True)
        elif c.routing == "topk_softmax":
            top, ids = torch.topk(logits, c.k, dim=-1)
            w = top.softmax(-1, dtype=torch.float32)
        elif c.routing == "topk_sigmoid":
            top, ids = torch.topk(logits, c.k, dim=-1)
            w = torch.sigmoid(top.float())
        else:  # sigmoid_grouped, as DeepseekV3TopkRouter writes it
            scores = logits.float().sigmoid()
            choice = scores + self.e_score_correction_bias
            group_scores = choice.view(-1, c.n_group, c.E // c.n_group).topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=c.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores)
            group_mask.scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(-1, c.n_group, c.E // c.n_group).reshape(-1, c.E)
            choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
            ids = torch.topk(choice, k=c.k, dim=-1, sorted=False)[1]
            w = scores.gather(1, ids)
            if c.renorm:
                w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
            w = w * c.scale
        return w, ids


class SharedExperts(nn.Module):
    """A shared expert added to the routed output: plain (DeepSeek-V3) or scaled by a sigmoid gate (Qwen2-MoE)."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        self.mlp = Expert(case.H, case.I, case.act if case.act in ACTS else "silu", bias=False)
        self.gate = nn.Linear(case.H, 1, bias=False) if case.shared == "gated" else None

    def forward(self, x):
        y = self.mlp(x)
        return torch.sigmoid(self.gate(x)) * y if self.gate is not None else y


class LoopMoE(nn.Module):
    """The expert-loop idiom of match_moe/expert_loop.py behind a Router, plus shared experts."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        self.router = Router(case)
        self.experts = nn.ModuleList(Expert(case.H, case.I, case.act, case.expert_bias) for _ in range(case.E))
        self.shared = SharedExperts(case) if case.shared != "none" else None

    def forward(self, x):
        w, ids = self.router(x)
        w = w.to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + (w * (ids == e)).sum(-1, keepdim=True) * expert(x)
        if self.shared is not None:
            out = out + self.shared(x)
        return out


# ------------------------------------------------------------------------------------------------
# Hugging Face blocks
# ------------------------------------------------------------------------------------------------


def _hf_config(case: Case):
    import transformers

    common = dict(
        hidden_size=case.H,
        hidden_act=HF_ACTS.get(case.act, "silu"),  # a family's own experts set theirs (_own_experts)
        num_experts_per_tok=case.k,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=32,
    )
    f = case.family
    if f in ("qwen3_moe", "topk_sigmoid"):
        cfg = transformers.Qwen3MoeConfig(
            **common, moe_intermediate_size=case.I, num_experts=case.E, norm_topk_prob=case.renorm
        )
    elif f == "mixtral":
        cfg = transformers.MixtralConfig(**common, intermediate_size=case.I, num_local_experts=case.E)
    elif f == "olmoe":
        # tie_word_embeddings in the type OlmoeConfig declares (transformers 5.4.0: int, and its default False fails)
        untied = 0 if transformers.OlmoeConfig.__annotations__.get("tie_word_embeddings") is int else False
        cfg = transformers.OlmoeConfig(
            **common,
            intermediate_size=case.I,
            num_experts=case.E,
            norm_topk_prob=case.renorm,
            tie_word_embeddings=untied,
        )
    elif f == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(
            **common,
            moe_intermediate_size=case.I,
            shared_expert_intermediate_size=case.I,
            num_experts=case.E,
            norm_topk_prob=case.renorm,
        )
    elif f == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(
            **common,
            moe_intermediate_size=case.I,
            n_routed_experts=case.E,
            n_group=case.n_group,
            topk_group=case.topk_group,
            norm_topk_prob=case.renorm,
            routed_scaling_factor=case.scale,
            n_shared_experts=1,
        )
    elif f in ("gpt_oss_router", "gpt_oss"):
        cfg = transformers.GptOssConfig(
            **common, intermediate_size=case.I, num_local_experts=case.E, layer_types=["full_attention"]
        )
        cfg.moe_intermediate_size = case.I
        cfg.num_experts = case.E
    elif f in OWN_EXPERTS_BEHIND_QWEN3_ROUTER:  # the router's; _own_experts builds the experts' own
        cfg = transformers.Qwen3MoeConfig(
            **common, moe_intermediate_size=case.I, num_experts=case.E, norm_topk_prob=case.renorm
        )
    else:
        raise ValueError(f)
    cfg._experts_implementation = case.impl
    return cfg


@functools.lru_cache(maxsize=None)
def synthetic_experts(is_transposed: bool, has_bias: bool) -> type:
    """An experts class decorated exactly as transformers' own (``is_transposed``: Aria's layout; ``has_bias``:
    biased experts), so that its forward is transformers' grouped_mm / batched_mm experts forward."""
    from transformers.activations import ACT2FN
    from transformers.integrations import moe as hf_moe

    @hf_moe.use_experts_implementation(is_transposed=is_transposed, has_bias=has_bias)
    class FuzzExperts(nn.Module):
        def __init__(self, config):
            super().__init__()
            E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
            self.num_experts = E
            up_shape, down_shape = ((E, H, 2 * I), (E, I, H)) if is_transposed else ((E, 2 * I, H), (E, H, I))
            self.gate_up_proj = nn.Parameter(torch.empty(up_shape))
            self.down_proj = nn.Parameter(torch.empty(down_shape))
            if has_bias:
                self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * I))
                self.down_proj_bias = nn.Parameter(torch.empty(E, H))
            self.act_fn = ACT2FN[config.hidden_act]

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise AssertionError("the experts implementation (grouped_mm / batched_mm) replaces this")

    return FuzzExperts


def _own_experts(case: Case) -> nn.Module:
    """MiniMax-M3's, DeepSeek-V4's or Nemotron-H's experts class, from its own tiny config."""
    import importlib

    import transformers

    model_type = HF_MODEL_TYPE[case.family]
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    sizes = dict(hidden_size=case.H, num_experts_per_tok=case.k, num_hidden_layers=1)
    if case.family == "minimax_m3":
        cfg = transformers.MiniMaxM3VLTextConfig(
            **sizes, intermediate_size=case.I, num_local_experts=case.E, swiglu_limit=case.limit
        )
        cls = module.MiniMaxM3VLExperts
    elif case.family == "deepseek_v4":
        cfg = transformers.DeepseekV4Config(
            **sizes,
            moe_intermediate_size=case.I,
            n_routed_experts=case.E,
            mlp_layer_types=["moe"],
            swiglu_limit=case.limit,
        )
        cls = module.DeepseekV4Experts
    else:
        cfg = transformers.NemotronHConfig(
            **sizes, moe_intermediate_size=case.I, n_routed_experts=case.E, mlp_hidden_act=UNGATED_ACTS[case.act]
        )
        cls = module.NemotronHExperts
    cfg._experts_implementation = case.impl
    return cls(cfg)


class TopKSigmoidRouter(nn.Module):
    """Llama 4's routing (top-k of the logits, then sigmoid) in transformers' router interface."""

    def __init__(self, config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))

    def forward(self, x):
        logits = F.linear(x, self.weight)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return logits, torch.sigmoid(top.float()).to(x.dtype), ids


class RouterExperts(nn.Module):
    """A transformers router, then a transformers experts module, then shared experts (or not)."""

    def __init__(self, router: nn.Module, experts: nn.Module, shared: Optional[nn.Module]) -> None:
        super().__init__()
        self.router, self.experts, self.shared = router, experts, shared

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        _, weights, ids = self.router(flat)
        out = self.experts(flat, ids, weights)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.reshape(x.shape)


def _hf_block(case: Case) -> nn.Module:
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek_v3
    from transformers.models.gpt_oss import modeling_gpt_oss as gpt_oss
    from transformers.models.mixtral import modeling_mixtral as mixtral
    from transformers.models.olmoe import modeling_olmoe as olmoe
    from transformers.models.qwen2_moe import modeling_qwen2_moe as qwen2_moe
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3_moe

    cfg = _hf_config(case)
    f = case.family
    if f == "qwen3_moe":
        block = qwen3_moe.Qwen3MoeSparseMoeBlock(cfg)
    elif f == "mixtral":
        block = mixtral.MixtralSparseMoeBlock(cfg)
    elif f == "olmoe":
        block = olmoe.OlmoeSparseMoeBlock(cfg)
    elif f == "qwen2_moe":
        block = qwen2_moe.Qwen2MoeSparseMoeBlock(cfg)
    elif f == "deepseek_v3":
        block = deepseek_v3.DeepseekV3MoE(cfg)
    elif f == "gpt_oss":
        return gpt_oss.GptOssMLP(cfg)
    elif f in OWN_EXPERTS_BEHIND_QWEN3_ROUTER:
        shared = SharedExperts(case) if case.shared != "none" else None
        return RouterExperts(qwen3_moe.Qwen3MoeTopKRouter(cfg), _own_experts(case), shared)
    else:
        router = gpt_oss.GptOssTopKRouter(cfg) if f == "gpt_oss_router" else TopKSigmoidRouter(cfg)
        shared = SharedExperts(case) if case.shared != "none" else None
        block = RouterExperts(router, qwen3_moe.Qwen3MoeExperts(cfg), shared)
    if case.expert_bias or case.transposed:
        if not hasattr(cfg, "num_experts") or cfg.num_experts != case.E:
            cfg.num_experts = case.E
        if getattr(cfg, "moe_intermediate_size", None) != case.I:
            cfg.moe_intermediate_size = case.I
        block.experts = synthetic_experts(case.transposed, case.expert_bias)(cfg)
    return block


# ------------------------------------------------------------------------------------------------
# building a case
# ------------------------------------------------------------------------------------------------


def build(case: Case) -> nn.Module:
    """The block of ``case`` in its dtype, in eval mode, with weights drawn from ``case.seed``: every matrix
    N(0, 1 / fan_in) (outputs of order one), vectors (biases, the score-correction bias) N(0, 0.1^2)."""
    torch.manual_seed(case.seed)
    block = LoopMoE(case) if case.form == "loop" else _hf_block(case)
    g = torch.Generator().manual_seed(case.seed)
    transposed = {"gate_up_proj", "down_proj"} if case.transposed or case.family == "gpt_oss" else set()
    with torch.no_grad():
        for name, p in list(block.named_parameters()) + list(block.named_buffers()):
            if not p.is_floating_point():
                continue
            leaf = name.rsplit(".", 1)[-1]
            if p.dim() >= 2 and not leaf.endswith("_bias"):
                fan_in = p.shape[-2] if leaf in transposed else p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return block.to(case.torch_dtype).eval()


def inputs(case: Case, tokens: int, salt: int = 0) -> torch.Tensor:
    """Hidden states for ``tokens`` tokens: [T, H] for the loop form, [1, T, H] for transformers' blocks."""
    g = torch.Generator().manual_seed(case.seed * 7919 + tokens * 31 + salt + 1)
    shape = (tokens, case.H) if case.form == "loop" else (1, tokens, case.H)
    return torch.randn(shape, generator=g).to(case.torch_dtype)


# ------------------------------------------------------------------------------------------------
# keeping routing decisions away from near-ties
# ------------------------------------------------------------------------------------------------


class TopkMargins(torch.overrides.TorchFunctionMode):
    """Checks, for every ``topk`` an eager forward runs, each row's gap between the k-th largest value and the next
    (what decides whether a token's choice flips when its scores move by a rounding): the gap must exceed
    ``rel_value`` times the larger magnitude of the two (a rounding of the values themselves: softmax
    probabilities, sigmoid scores) and ``rel_row`` times the row's largest magnitude (a rounding of a sum over H:
    logits). Rows are the first dimension (the tokens, in every router here); ``ok`` holds a [T] bool per topk."""

    def __init__(self, rel_value: float, rel_row: float) -> None:
        super().__init__()
        self.rel_value, self.rel_row = rel_value, rel_row
        self.ok: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.topk, torch.Tensor.topk):
            self._record(*args, **kwargs)
        return out

    def _record(self, values, k, dim=-1, largest=True, sorted=True):
        v = values.detach().double().movedim(dim, -1)
        if v.shape[-1] <= k or v.shape[0] == 0:
            return
        top = torch.topk(v if largest else -v, k + 1, dim=-1).values
        above, below = top[..., k - 1], top[..., k]
        gap = torch.where(torch.isinf(below), torch.full_like(above, float("inf")), above - below)  # -inf: masked
        finite = torch.where(torch.isfinite(v), v.abs(), torch.zeros_like(v))
        value = torch.maximum(above.abs(), torch.where(torch.isfinite(below), below.abs(), torch.zeros_like(below)))
        ok = (gap > self.rel_value * value) & (gap > self.rel_row * finite.amax(-1))
        self.ok.append(ok.reshape(v.shape[0], -1).all(-1))


# (rel_value, rel_row) of TopkMargins per dtype. fp32 is compared with eager: Inductor's exp / sums round differently
# by ~1e-7 relative. bf16 / fp16 are compared with Inductor's compile, whose router code is the same as in rubin's:
# the same routing, ties included; the margin only keeps exact ties (bf16 logits have 8 bits) out.
MIN_GAP = {"fp32": (1e-5, 1e-6), "bf16": (1e-3, 1e-4), "fp16": (1e-3, 1e-4)}


def separated_inputs(case: Case, block: nn.Module, tokens: int, salt: int = 0, tries: int = 40) -> torch.Tensor:
    """``inputs(case, tokens)`` with every token whose routing has a near-tie (a top-k gap under
    ``MIN_GAP[case.dtype]``, see TopkMargins, in an eager run) drawn again, so that rounding cannot send a token to another
    expert in one of the two runs compared. Rows are independent (a token's routing reads only its row)."""
    x = inputs(case, tokens, salt)
    flat = x.view(-1, case.H)
    g = torch.Generator().manual_seed(case.seed + tokens + salt + 12345)
    for _ in range(tries):
        mode = TopkMargins(*MIN_GAP[case.dtype])
        with torch.no_grad(), mode:
            block(x)
        if not mode.ok:
            return x
        bad = (~torch.stack(mode.ok).all(0)).nonzero().flatten()
        if bad.numel() == 0:
            return x
        flat[bad] = torch.randn(bad.numel(), case.H, generator=g).to(x.dtype)
    raise AssertionError(f"no well-separated routing for {tokens} tokens after {tries} draws: {case}")
