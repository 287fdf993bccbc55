"""A property-based fuzzer (hypothesis) over MoE blocks: rubin's compile against eager (fp32) and against Inductor's
own compile (bf16 / fp16), and what the report says of each block.

What is drawn (fuzz_blocks.py): the form (a plain-PyTorch loop over per-expert ``nn.Linear`` modules, or Hugging
Face transformers' own sparse MoE blocks from tiny configs), E, k (1..E), H, I, the dtype, the routing (softmax then
top-k with or without renormalisation; top-k then softmax with a router bias; sigmoid scores with a
score-correction bias, grouped top-k and a routed scaling factor; top-k then sigmoid), the activation (SiLU,
GELU-tanh and exact GELU, which rubin.moe implements, GPT-OSS's clamped SwiGLU in its own block, MiniMax-M3's clamped
SwiGLU over halves and DeepSeek-V4's clamped SiLU in their own experts with a drawn limit, Nemotron-H's non-gated
experts with each activation rubin.moe takes non-gated, and ReLU, a near miss), biases on the experts or not, shared
experts (plain, or scaled by a sigmoid gate) or not, the token count T (0, 1, odd, 64..200), the shape mode (static,
``dynamic=True``, ``mark_dynamic``, or automatic dynamic shapes on a second call) and the seed of the weights and
inputs.

What is checked, for every example:

* fp32: every call of the rubin-compiled block equals eager within 1e-4 of the output's scale; bf16 / fp16: it
  equals the block compiled by Inductor alone (the same router code in both, so the same routing) within the
  tolerance of ``assert_close_to_eager`` (2e-2 / 5e-3 of the output's scale). Every token is compared: tokens
  whose routing has a near-tie (a top-k gap under ``fuzz_blocks.MIN_GAP`` in an eager run) are drawn again, so
  a rounding cannot route a token differently in the two runs.
* A block rubin claims to rewrite (``fuzz_blocks.claimed``) WAS rewritten into ``rubin.moe``, once per compiled
  graph (the report and the final code agree), with the block's E, k, activation and routing in the report. A
  block left unchanged has its reason in the report, so the fuzzer cannot pass by rewriting nothing.

Profiles (docs/contributing.md, "The MoE fuzzer"): ``RUBIN_FUZZ_PROFILE=ci`` (the default) runs a bounded,
derandomised number of examples per test (the same examples on every run, no shrinking, no example database);
``RUBIN_FUZZ_PROFILE=long`` runs many more random ones (``RUBIN_FUZZ_EXAMPLES`` sets the count per test) and
shrinks a failure to a small one. Every failure found becomes a regression test at the end of this file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.conftest import RubinRun, assert_close_to_eager, count_ops  # noqa: E402
from tests.cpu.passes.match_moe.fuzz_blocks import (  # noqa: E402
    HF_FAMILIES,
    LOOP_ROUTINGS,
    Case,
    build,
    claimed,
    hf_cases,
    loop_cases,
    separated_inputs,
)

# --- profiles ----------------------------------------------------------------------------------------------------

PROFILE = os.environ.get("RUBIN_FUZZ_PROFILE", "ci")
if PROFILE not in ("ci", "long"):
    raise ValueError(f"RUBIN_FUZZ_PROFILE={PROFILE!r}: use 'ci' (the default) or 'long'")
_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile(
    "rubin-fuzz-ci",
    derandomize=True,  # the same examples on every run: a CI failure reproduces locally
    database=None,
    deadline=None,
    phases=(Phase.explicit, Phase.generate),  # no shrinking: a compile per shrink step would blow the budget
    suppress_health_check=_HEALTH,
    print_blob=True,
)
settings.register_profile(
    "rubin-fuzz-long",
    deadline=None,
    suppress_health_check=_HEALTH,
    print_blob=True,
)
# Examples per parametrised test; each compiles the block once or twice (a few seconds on a 2-core CPU).
EXAMPLES = {
    "ci": {"loop-fp32": 2, "loop-lowp": 2, "hf-fp32": 2, "hf-lowp": 2},
    "long": {"loop-fp32": 40, "loop-lowp": 25, "hf-fp32": 30, "hf-lowp": 20},
}[PROFILE]
if os.environ.get("RUBIN_FUZZ_EXAMPLES"):
    EXAMPLES = dict.fromkeys(EXAMPLES, int(os.environ["RUBIN_FUZZ_EXAMPLES"]))


def fuzz_settings(kind: str) -> settings:
    return settings(settings.get_profile(f"rubin-fuzz-{PROFILE}"), max_examples=EXAMPLES[kind])


# --- the check ---------------------------------------------------------------------------------------------------

DYNAMIC = {"static": False, "dynamic": True, "mark_dynamic": None, "automatic": None}
ORDER = {
    "softmax_topk": "softmax_then_topk",
    "topk_softmax": "topk_then_softmax",
    "sigmoid_grouped": "sigmoid_then_topk",
    "topk_sigmoid": "topk_then_sigmoid",
}


def _calls(compiled, xs: list[torch.Tensor], shapes: str) -> list[torch.Tensor]:
    outs = []
    with torch.no_grad():
        for x in xs:
            if shapes == "mark_dynamic":
                x = x.clone()
                torch._dynamo.mark_dynamic(x, x.dim() - 2)
            y = compiled(x)
            outs.append(y[0] if isinstance(y, tuple) else y)  # GPT-OSS's block returns (out, router scores)
    return outs


def _assert_close(got: torch.Tensor, want: torch.Tensor, case: Case) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    if want.numel():
        assert_close_to_eager(got, want, case.torch_dtype)


# --- known bugs: the fuzz tests step around them; the xfail regressions at the end of this file keep them visible --


def known_dynamic_scale_bug(case: Case) -> bool:
    """Under ``dynamic=True`` Dynamo turns the routed scaling factor (a Python float attribute of the router) into a
    0-d tensor input of the graph, and match_moe/routing.py then reports a DeepSeek-style routing as unrecognised
    ("the routing weights (mul_tensor) are not derived from the same top-k")."""
    return case.routing == "sigmoid_grouped" and case.shapes == "dynamic"


def known_tiny_router_bug(case: Case, tokens) -> bool:
    """At T = 1 on the CPU Inductor decomposes a router's addmm with H, E <= 16 (and an mm or addmm with E = 1) into
    mul / sum / add (torch/_inductor/decomposition.py); routing.py then reports the router as "unrecognised (add)"
    without its bias, and a router it does not see as one gets no reason either. Toy sizes only."""
    return tokens == 1 and (case.E == 1 or (case.H <= 16 and case.E <= 16))


def known_top1_decode_bug(case: Case, graph_index: int, unchanged: list) -> bool:
    """transformers' grouped_mm experts at T * k = 1 (one token, top-1): ``inv_perm[perm] = arange(1)`` reaches the
    graph as ``index_put(empty, [perm], reshape(iota(1), []))`` and match_moe/hf_grouped_mm.py leaves the block
    unchanged ("... gathered by something other than the inverse sort permutation")."""
    return (
        case.form == "hf"
        and case.impl == "grouped_mm"
        and case.k == 1
        and case.T == 1
        and graph_index == 0  # the first graph is compiled for case.T
        and any("inverse sort permutation" in u["reason"] for u in unchanged)
    )


class KnownBug(AssertionError):
    """A check failed where one of the known bugs above says it does (the xfail regressions expect exactly this)."""


def _expect(ok: bool, known: bool, skip_known: bool, message) -> None:
    """Assert ``ok``; a failure that a known bug explains (``known``) is stepped around with ``skip_known`` and
    raised as ``KnownBug`` without."""
    if ok or (known and skip_known):
        return
    raise (KnownBug if known else AssertionError)(message)


def _check_report(run: RubinRun, case: Case, skip_known: bool) -> None:
    """A claimed block rewritten into rubin.moe in every graph (report and final code agreeing, details right); a
    block left unchanged has a reason."""
    reports = run.reports()
    assert reports, "rubin compiled no graph"
    why_not = claimed(case)
    total = 0
    for index, report in enumerate(reports):
        graph_tokens = case.T if index == 0 else None  # later graphs: T2, or a symbolic T
        assert report["reporting_errors"] == [], report["reporting_errors"]
        (result,) = [p for p in report["passes"] if p["name"] == "match_moe"]
        moes = [r for r in result["rewrites"] if r["canonical_op"] == "rubin.moe"]
        unchanged = result["unchanged"]
        total += len(moes)
        if why_not is None:
            _expect(
                len(moes) == 1,
                known_top1_decode_bug(case, index, unchanged),
                skip_known,
                f"graph {report['graph_id']}: claimed block not rewritten: {unchanged}",
            )
        if not moes:
            _expect(
                bool(unchanged),
                known_tiny_router_bug(case, graph_tokens),
                skip_known,
                f"graph {report['graph_id']}: block left unchanged without a reason",
            )
        assert all(u["reason"].strip() for u in unchanged), unchanged
        for r in moes:
            _check_details(r["details"], case, skip_known)
    assert count_ops(run.final_code(), "rubin.moe") == total


def _check_details(d: dict, case: Case, skip_known: bool) -> None:
    assert (d["E"], d["k"]) == (case.E, case.k), d
    assert d["activation"].split(":")[0] == case.act, d  # "swigluoai[:alpha:limit]"
    if "bias" in d:
        assert d["bias"] is case.expert_bias, d
    routing = d["routing"]
    want = {"recognised": True, "order": ORDER[case.routing], "top_k": case.k, "num_experts": case.E}
    if case.routing in ("softmax_topk", "sigmoid_grouped"):
        want["renormalize"] = case.renorm
    if case.routing == "sigmoid_grouped":
        want["score_correction_bias"] = True
        if case.scale != 1.0:  # a scale of 1.0 may be folded away
            want["scale"] = case.scale
    got = {key: routing.get(key) for key in want}
    _expect(got == want, known_dynamic_scale_bug(case), skip_known, f"routing {routing}, want {want}")
    # the loop's router is an nn.Linear with or without a bias; transformers' routers have one in GPT-OSS only
    bias = case.router_bias if case.form == "loop" else case.family in ("gpt_oss", "gpt_oss_router")
    _expect(
        (routing["router"], routing["router_bias"]) == ("linear", bias),
        known_tiny_router_bug(case, d["T"]),
        skip_known,
        f"routing {routing}, want router 'linear' with router_bias {bias}",
    )


def check_case(case: Case, skip_known: bool = True) -> None:
    """Compile ``case``'s block with rubin, call it at each of its token counts, and compare (see the module
    docstring). ``skip_known``: step around the known bugs above (the regression tests do not)."""
    torch._dynamo.reset()
    block = build(case)
    xs = [separated_inputs(case, block, t) for t in case.token_counts()]
    dump = Path(tempfile.mkdtemp(prefix="rubin-fuzz-"))
    try:
        run = RubinRun(dump / "dumps")
        got = _calls(run.compile(block, dynamic=DYNAMIC[case.shapes]), xs, case.shapes)
        if case.dtype == "fp32":
            want = _calls(block, xs, "static")
        else:
            torch._dynamo.reset()
            want = _calls(torch.compile(block, backend="inductor", dynamic=DYNAMIC[case.shapes]), xs, case.shapes)
        for g, w in zip(got, want):
            _assert_close(g, w, case)
        _check_report(run, case, skip_known)
    finally:
        torch._dynamo.reset()
        shutil.rmtree(dump, ignore_errors=True)


# --- the fuzz tests ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("routing", LOOP_ROUTINGS)
@fuzz_settings("loop-fp32")
@given(data=st.data())
def test_fuzz_loop_fp32_against_eager(routing, data):
    check_case(data.draw(loop_cases(routing, ("fp32",)), label="case"))


@pytest.mark.parametrize("routing", LOOP_ROUTINGS)
@fuzz_settings("loop-lowp")
@given(data=st.data())
def test_fuzz_loop_low_precision_against_inductor(routing, data):
    check_case(data.draw(loop_cases(routing, ("bf16", "fp16")), label="case"))


@pytest.mark.parametrize("family", HF_FAMILIES)
@fuzz_settings("hf-fp32")
@given(data=st.data())
def test_fuzz_hf_fp32_against_eager(family, data):
    check_case(data.draw(hf_cases(family, ("fp32",)), label="case"))


@pytest.mark.parametrize("family", HF_FAMILIES)
@fuzz_settings("hf-lowp")
@given(data=st.data())
def test_fuzz_hf_low_precision_against_inductor(family, data):
    check_case(data.draw(hf_cases(family, ("bf16", "fp16")), label="case"))


# --- regressions: every failure the fuzzer found, with its concrete parameters -------------------------------------


def _xfail(reason: str):
    return pytest.mark.xfail(strict=True, raises=KnownBug, reason=reason)


@_xfail(
    "rubin bug (routing description): under dynamic=True the routed scaling factor of a DeepSeek-V3 router becomes a "
    "0-d tensor input of the graph (Dynamo does not specialise the float), and match_moe/routing.py reports the "
    "routing as unrecognised: 'the routing weights (mul_tensor) are not derived from the same top-k' (renormalize "
    "and scale lost too). The rewrite itself is right."
)
@pytest.mark.parametrize(
    "case",
    [
        Case(
            form="hf",
            family="deepseek_v3",
            E=8,
            k=2,
            H=16,
            I=16,
            act="silu",
            routing="sigmoid_grouped",
            renorm=True,
            n_group=2,
            topk_group=1,
            scale=2.5,
            shared="plain",
            T=7,
            T2=9,
            shapes="dynamic",
            seed=1,
        ),
        # the fuzzer's first find: the loop form, T = 0 then a symbolic T, scale 1.0
        Case(
            form="loop",
            family="loop",
            E=6,
            k=4,
            H=14,
            I=32,
            act="gelu_tanh",
            routing="sigmoid_grouped",
            n_group=2,
            topk_group=2,
            T=0,
            T2=200,
            shapes="dynamic",
            seed=264,
        ),
    ],
    ids=["hf_deepseek_v3", "loop"],
)
def test_regression_dynamic_routed_scaling_factor_misdescribed(case):
    check_case(case, skip_known=False)


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_regression_gpt_oss_dynamic_alpha_and_limit_rewritten(impl):
    """Found by the fuzzer: under dynamic=True Dynamo makes GPT-OSS's SwiGLU alpha (torch 2.13) and limit (2.15 too)
    graph inputs, and both Hugging Face matchers left the experts unchanged. They are rewritten now, the constants
    passed to rubin.moe as activation_constants (match_moe/hf_activation.py)."""
    case = Case(
        form="hf",
        family="gpt_oss",
        E=8,
        k=2,
        H=32,
        I=32,
        act="swigluoai",
        routing="topk_softmax",
        expert_bias=True,
        impl=impl,
        T=5,
        T2=9,
        shapes="dynamic",
        seed=3,
    )
    check_case(case, skip_known=False)


@_xfail(
    "rubin bug (missed rewrite): transformers' grouped_mm experts at T * k = 1 (one token, top-1 routing) are left "
    "unchanged: inv_perm[perm] = arange(1) reaches the graph as index_put(empty, [perm], reshape(iota(1), [])) and "
    "hf_grouped_mm.py wants the iota itself ('the weighted expert output is gathered by something other than the "
    "inverse sort permutation')"
)
@pytest.mark.parametrize(
    "case",
    [
        Case(
            form="hf",
            family="mixtral",
            E=2,
            k=1,
            H=8,
            I=8,
            act="silu",
            routing="softmax_topk",
            renorm=True,
            dtype="bf16",
            T=1,
        ),
        Case(
            form="hf",
            family="deepseek_v3",
            E=2,
            k=1,
            H=8,
            I=8,
            act="silu",
            routing="sigmoid_grouped",
            shared="plain",
            T=1,
        ),
        # a realistic size: decode (one token) of a top-1 model
        Case(
            form="hf",
            family="qwen3_moe",
            E=16,
            k=1,
            H=64,
            I=32,
            act="silu",
            routing="softmax_topk",
            renorm=True,
            T=1,
            seed=5,
        ),
    ],
    ids=["mixtral_bf16", "deepseek_v3", "qwen3_moe_h64"],
)
def test_regression_top1_single_token_grouped_mm_not_rewritten(case):
    check_case(case, skip_known=False)


@_xfail(
    "rubin bug (routing description, toy sizes): at T = 1 on the CPU Inductor decomposes a router addmm with H, E <= "
    "16 into mul / sum / add; routing.py reports the router as 'unrecognised (add)' and router_bias False"
)
@pytest.mark.parametrize(
    "case",
    [
        Case(
            form="loop",
            family="loop",
            E=2,
            k=1,
            H=8,
            I=8,
            act="silu",
            routing="sigmoid_grouped",
            router_bias=True,
            T=1,
        ),
        Case(
            form="hf",
            family="gpt_oss",
            E=2,
            k=1,
            H=8,
            I=8,
            act="swigluoai",
            routing="topk_softmax",
            expert_bias=True,
            impl="batched_mm",
            T=1,
        ),
    ],
    ids=["loop_sigmoid_grouped", "hf_gpt_oss_batched_mm"],
)
def test_regression_tiny_router_at_one_token_misdescribed(case):
    check_case(case, skip_known=False)


@_xfail(
    "rubin gap (no reason given, degenerate block): a loop over a single expert (E = 1) at T = 1: expert_loop groups "
    "two masks or more, and the router fallback of match_moe/__init__.py skips the router because Inductor "
    "decomposed its [H, 1] mm (routing.py: router 'unrecognised'), so the report says nothing of the block"
)
def test_regression_one_expert_one_token_left_without_reason():
    check_case(
        Case(form="loop", family="loop", E=1, k=1, H=8, I=8, act="silu", routing="topk_sigmoid", T=1),
        skip_known=False,
    )
