"""passes/match_routing.py: the router ahead of each rubin.moe rewritten into rubin.route where a routing kernel takes
it (a GPU target), with the arguments read off the idiom; left as written, with the reason, everywhere else.

The plans are made on the CPU for sm_90 (declarations only, as docs/kernels/selection.md); the compiled blocks run
under Triton's interpreter in a subprocess (``TRITON_INTERPRET=1`` must be set before Triton is imported), fp32,
against eager transformers, at static and dynamic T (T > 64 takes the op's reference inside the adapter).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rubin_compile.ops.registry import KernelUnavailableError
from tests.conftest import count_ops
from tests.cpu.passes.match_moe.families import hidden_size, moe_block, require
from tests.cpu.passes.match_moe.test_expert_loop import LoopMoE

PASSES = ["canonicalize", "match_moe", "match_routing", "select_kernels", "chain_pdl"]
FAMILIES = {  # model type: what the rewrite must have read
    "qwen3_moe": dict(order="softmax_then_topk", renormalize=False, n_group=1),  # the tiny config: norm_topk_prob off
    "mixtral": dict(order="softmax_then_topk", renormalize=True, n_group=1),
    "olmoe": dict(order="softmax_then_topk", n_group=1),
    "deepseek_v3": dict(
        order="sigmoid_then_topk", renormalize=True, score_correction_bias=True, n_group=2, topk_group=1, scale=2.5
    ),
    "glm4_moe": dict(order="sigmoid_then_topk", renormalize=True, score_correction_bias=True, n_group=1),
    "gpt_oss": dict(order="topk_then_softmax", router_bias=True),
}
ROOT = Path(__file__).resolve().parents[3]


class FirstOutput(torch.nn.Module):
    """The block's hidden states only (GPT-OSS's MLP also returns its router scores)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x):
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out


def _block(model_type: str) -> tuple[torch.nn.Module, int]:
    require(model_type)
    block, config = moe_block(model_type)
    return FirstOutput(block).eval(), hidden_size(config)


def _plan(rubin_run, model_type: str, T: int = 3, target: str = "sm90", **options):
    block, H = _block(model_type)
    compiled = rubin_run.compile(block, target=target, passes=PASSES, **options)
    with torch.no_grad():
        try:
            compiled(torch.randn(1, T, H))
        except KernelUnavailableError:
            pass  # a plan for sm_90 made on the CPU: its kernels cannot run here (the subprocess runs them)
    return rubin_run


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_each_family_router_becomes_one_rubin_route_on_sm90(rubin_run, model_type):
    _plan(rubin_run, model_type)
    (rw,) = rubin_run.rewrites("match_routing")
    assert rw["canonical_op"] == "rubin.route" and rw["details"]["kernel"] == "triton"
    for key, want in FAMILIES[model_type].items():
        assert rw["details"][key] == want, (key, rw["details"])
    assert "topk" in rw["replaced"]  # the old choice is gone from the graph
    code = rubin_run.final_code()
    assert count_ops(code, "rubin.route") == 1 and count_ops(code, "aten.topk") == 0
    plans = rubin_run.plans()
    route = [pl for pl in plans if pl["canonical_op"] == "rubin.route"]
    assert len(route) == 1 and route[0]["impl"] == "triton@sm90"
    decisions = [
        d for rep in rubin_run.reports() for p in rep["passes"] if p["name"] == "chain_pdl" for d in p["decisions"]
    ]
    assert any(d["canonical_op"] == "rubin.route" and d["decision"] == "pdl off" for d in decisions)  # no CUDA graphs


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_the_online_softmax_of_cuda_graphs_is_read(rubin_run, monkeypatch, model_type):
    """On CUDA, Inductor's post-grad patterns turn a softmax into ``prepare_softmax_online`` before rubin's pass runs
    (``prepare_softmax_extra_check`` allows it for CUDA / XPU only); allowed here for the CPU, the routers come to
    the pass in that form and are rewritten the same."""
    import torch._inductor.fx_passes.post_grad as post_grad

    monkeypatch.setattr(post_grad.prepare_softmax_extra_check, "__code__", (lambda match: True).__code__)
    _plan(rubin_run, model_type)
    code = rubin_run.stage_code("match_moe")
    assert "prepare_softmax_online" in code  # the form the pass read
    (rw,) = rubin_run.rewrites("match_routing")
    assert rw["details"]["order"] == FAMILIES[model_type]["order"]


def test_the_cpu_target_keeps_the_routing_and_says_so(rubin_run):
    _plan(rubin_run, "qwen3_moe", target="cpu")
    assert rubin_run.rewrites("match_routing") == []
    (report,) = rubin_run.reports()
    (p,) = [p for p in report["passes"] if p["name"] == "match_routing"]
    assert p["notes"] == [
        "target cpu: the routing of 1 MoE block(s) stays as written (no routing kernel for the CPU; Inductor compiles it)"
    ]
    assert count_ops(rubin_run.final_code(), "aten.topk") == 1


def test_a_prefill_sized_static_t_keeps_the_routing_with_the_reason(rubin_run):
    _plan(rubin_run, "qwen3_moe", T=100, strict=True)  # a kernel decision, not a near miss: strict does not raise
    assert rubin_run.unchanged("match_routing") == []
    (report,) = rubin_run.reports()
    (note,) = [n for p in report["passes"] if p["name"] == "match_routing" for n in p["notes"]]
    assert note.startswith("moe_default: routing kept as written: no routing kernel takes it on sm90")
    assert "T=100 tokens: not decode-sized (the kernel takes up to 64); Inductor's routing is kept" in note
    assert count_ops(rubin_run.final_code(), "rubin.route") == 0


def test_router_logits_read_elsewhere_keep_the_routing(rubin_run):
    """A block that also returns its router logits (an auxiliary loss, or output_router_logits) would compute them
    twice if fused."""

    class WithLogits(LoopMoE):
        def forward(self, x):
            logits = self.router(x)
            w, ids = torch.topk(logits.softmax(-1, dtype=torch.float32), self.k, dim=-1)
            w = w / w.sum(-1, keepdim=True)
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                out = out + (w * (ids == e)).sum(-1, keepdim=True) * expert(x)
            return out, logits

    plain = LoopMoE().eval()
    for model, rewritten in ((WithLogits(), 0), (plain, 1)):
        rubin_run.dump_dir = rubin_run.dump_dir.parent / f"dumps-{rewritten}"
        compiled = rubin_run.compile(model, target="sm90", passes=PASSES)
        with torch.no_grad():
            try:
                compiled(torch.randn(5, 32))
            except KernelUnavailableError:
                pass
        assert len(rubin_run.rewrites("match_routing")) == rewritten
    (u,) = [u for rep in [rubin_run.dump_dir.parent / "dumps-0"] for u in _unchanged(rep)]
    assert "the router's logits are also read by" in u["reason"] and "computed twice" in u["reason"]


def _unchanged(dump_dir: Path) -> list:
    reports = [json.loads(p.read_text()) for p in sorted(dump_dir.glob("*/report.json"))]
    return [u for rep in reports for p in rep["passes"] if p["name"] == "match_routing" for u in p["unchanged"]]


def test_a_forced_reference_routing_is_rewritten_and_bound_to_it(rubin_run):
    _plan(rubin_run, "qwen3_moe", kernels={"route": "reference"})
    (rw,) = rubin_run.rewrites("match_routing")
    assert rw["details"]["kernel"] == "reference"


def test_pass_can_be_left_out():
    from rubin_compile.options import RubinOptions

    opts = RubinOptions.resolve({"passes": [p for p in PASSES if p != "match_routing"]}, environ={})
    assert "match_routing" not in opts.enabled_passes()


# --- run under Triton's interpreter -----------------------------------------------------------------------------


def _interpreted(cases: list[tuple[str, int, bool]]) -> dict:
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)  # a transformers leg's first
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run(
        [sys.executable, __file__, json.dumps(cases)], capture_output=True, text=True, timeout=1200, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


RUNS = [
    ("qwen3_moe", 3, False),
    ("mixtral", 1, False),
    ("deepseek_v3", 5, False),
    ("glm4_moe", 2, False),
    ("gpt_oss", 4, False),
    ("qwen3_moe", 70, True),  # dynamic T: compiled once, run at 2 and at 70 (> 64: the reference inside the adapter)
    ("deepseek_v3", 70, True),
]


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return _interpreted(RUNS)


@pytest.mark.parametrize("case", RUNS, ids=[f"{m}-T{t}{'-dynamic' if d else ''}" for m, t, d in RUNS])
def test_the_fused_routing_runs_and_equals_eager(interpreted, case):
    out = interpreted["/".join(map(str, case))]
    assert out["routes"] == 1, out
    for err, scale in out["errors"]:
        assert err <= 1e-4 * scale, out


def _main(cases: list) -> None:
    """The subprocess: compile each block for sm_90 with the kernels run by the interpreter, compare with eager."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import tempfile

    from tests.conftest import RubinRun

    results = {}
    for model_type, T, dynamic in cases:
        torch.manual_seed(0)
        block, H = _block(model_type)
        run = RubinRun(Path(tempfile.mkdtemp()) / "dumps")
        compiled = run.compile(block, dynamic=True if dynamic else None, target="sm90", passes=PASSES)
        errors = []
        with torch.no_grad():
            for t in [2, T] if dynamic else [T]:
                x = torch.randn(1, t, H)
                want, got = block(x), compiled(x)
                errors.append(((got - want).abs().max().item(), want.abs().max().item()))
        results["/".join(map(str, (model_type, T, dynamic)))] = {
            "routes": count_ops(run.final_code(), "rubin.route"),
            "errors": errors,
        }
    print(json.dumps(results))


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
