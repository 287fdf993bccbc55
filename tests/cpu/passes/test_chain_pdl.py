"""chain_pdl: the PDL decision per target / option / kernel, and end to end through the dumps and reports."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from rubin_compile.ops.moe import MOE
from rubin_compile.ops.registry import KernelUnavailableError, canonical_form
from rubin_compile.passes.base import Engine
from rubin_compile.options import RubinOptions
from rubin_compile.passes import chain_pdl, select_kernels
from rubin_compile.passes.base import PassContext
from rubin_compile.passes.manager import PassManager
from rubin_compile.target import Target, resolve
from tests.conftest import stage_file

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks behaviour on a machine without CUDA")

SM80 = Target("sm80", "Ampere (A100)", (8, 0), 108)  # no named target: pdl False by default
SM90, SM107, CPU = resolve("sm90"), resolve("sm107"), resolve("cpu")

NO_GRAPHS = (
    "pdl='auto' and the graph does not run under CUDA graphs, where a PDL launch's host cost can "
    "outweigh the overlap; compile with mode='reduce-overhead' or options cudagraphs=True, or "
    "force it with pdl='on'"
)
REFERENCE_NO_PDL = "reference takes no PDL launch (its kernels do not wait on griddepcontrol)"


class DirectMoE(torch.nn.Module):
    """A router and one ``torch.ops.rubin.moe`` call on the module's own stacked expert weights."""

    def __init__(self, E=4, H=256, I=256, k=2):
        super().__init__()
        self.router = torch.nn.Linear(H, E, bias=False)
        self.w13 = torch.nn.Parameter(torch.randn(E, 2 * I, H) * 0.05)
        self.w2 = torch.nn.Parameter(torch.randn(E, H, I) * 0.05)
        self.k, self.H = k, H

    def forward(self, x):
        w, ids = torch.topk(self.router(x).softmax(-1, dtype=torch.float32), self.k, dim=-1)
        return torch.ops.rubin.moe(x, self.w13, self.w2, w, ids, "silu")


def compile_for_gpu_target(rubin_run, model, tokens=4, dynamic=None, **options):
    """Compile ``model`` (bf16) with the rubin backend for a GPU target and call it once on this CPU: the
    passes run and write their dumps, then the bound GPU kernel raises ``KernelUnavailableError``."""
    model = model.to(torch.bfloat16).eval()
    if dynamic is None:
        compiled = rubin_run.compile(model, **options)
    else:
        torch._dynamo.reset()
        compiled = torch.compile(
            model, backend="rubin", dynamic=dynamic, options={"dump_dir": str(rubin_run.dump_dir), **options}
        )
    with pytest.raises(KernelUnavailableError, match="cannot run on this machine"), torch.no_grad():
        compiled(torch.randn(tokens, model.H, dtype=torch.bfloat16))


def pass_decisions(rubin_run, name):
    return [d for rep in rubin_run.reports() for p in rep["passes"] if p["name"] == name for d in p["decisions"]]


def moe_decisions(rubin_run):
    """chain_pdl's decisions for the rubin.moe nodes (the rubin.route ahead of each has its own: route_decisions)."""
    return [d for d in pass_decisions(rubin_run, "chain_pdl") if d["canonical_op"] == "rubin.moe"]


def route_decisions(rubin_run):
    return [d for d in pass_decisions(rubin_run, "chain_pdl") if d["canonical_op"] == "rubin.route"]


def pass_notes(rubin_run, name):
    return [n for rep in rubin_run.reports() for p in rep["passes"] if p["name"] == name for n in p["notes"]]


def moe_lines(code):
    return [line for line in code.splitlines() if "torch.ops.rubin.moe.default(" in line]


# ------------------------------------------------------------------------------------------------
# decide()
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
@pytest.mark.parametrize("cudagraphs", [True, False])
def test_sm80_and_cpu_never_get_pdl(mode, cudagraphs):
    want = "options pdl='off'" if mode == "off" else None
    assert chain_pdl.decide(mode, SM80, None, cudagraphs) == (False, want or "target sm80 has no PDL (sm_90 and newer)")
    assert chain_pdl.decide(mode, CPU, None, cudagraphs) == (False, want or "target cpu has no PDL (sm_90 and newer)")


@pytest.mark.parametrize("target", [SM90, SM107], ids=["sm90", "sm107"])
def test_pdl_capable_targets(target):
    name = target.name
    assert chain_pdl.decide("auto", target, None, True) == (
        True,
        f"PDL-safe kernel on {name}, run under CUDA graphs (captured as a programmatic edge)",
    )
    on, why = chain_pdl.decide("auto", target, None, False)
    assert on is False and why == NO_GRAPHS and "CUDA graphs" in why
    assert chain_pdl.decide("on", target, None, False) == (True, "options pdl='on'")
    assert chain_pdl.decide("on", target, None, True) == (True, "options pdl='on'")
    assert chain_pdl.decide("off", target, None, True) == (False, "options pdl='off'")
    assert chain_pdl.decide("off", target, None, False) == (False, "options pdl='off'")


def test_a_kernel_that_is_not_pdl_safe_stays_off_even_when_forced():
    spec = MOE.example_spec("none")
    reason = MOE.kernel("reference").pdl_unsupported(spec)
    assert reason == REFERENCE_NO_PDL
    assert MOE.kernel("triton").pdl_unsupported(spec) is None
    for target in (SM90, SM107):
        for cudagraphs in (True, False):
            assert chain_pdl.decide("on", target, reason, cudagraphs) == (False, REFERENCE_NO_PDL)
            assert chain_pdl.decide("auto", target, reason, cudagraphs) == (False, REFERENCE_NO_PDL)
    # "off" and a target without PDL are given before the kernel's own reason
    assert chain_pdl.decide("off", SM90, reason, True) == (False, "options pdl='off'")
    assert chain_pdl.decide("on", SM80, reason, True) == (False, "target sm80 has no PDL (sm_90 and newer)")


# ------------------------------------------------------------------------------------------------
# run() on a graph (fake CUDA tensors, so the reference kernel is planned for the GPU target)
# ------------------------------------------------------------------------------------------------


def _cuda_moe_graph(E=4, H=256, I=256, T=4, k=2):
    import rubin_compile.ops  # noqa: F401

    def f(x, w13, w2, tw, ids):
        return torch.ops.rubin.moe(x, w13, w2, tw, ids, "silu")

    with FakeTensorMode():
        dev = "cuda"
        args = [
            torch.empty(T, H, dtype=torch.bfloat16, device=dev),
            torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device=dev),
            torch.empty(E, H, I, dtype=torch.bfloat16, device=dev),
            torch.empty(T, k, device=dev),
            torch.zeros(T, k, dtype=torch.int64, device=dev),
        ]
        return make_fx(f, tracing_mode="fake")(*args).graph


def _select_then_pdl(graph, **options):
    opts = RubinOptions.resolve(options, environ={})
    ctx = PassContext(options=opts, target=opts.resolved_target())
    select_kernels.run(graph, ctx)
    return chain_pdl.run(graph, ctx)


def _is_moe(node):
    form = canonical_form(node)
    return form is not None and form[0].name == "moe"


def _moe_node(graph):
    (node,) = [n for n in graph.nodes if _is_moe(n)]
    return node


@pytest.mark.parametrize(
    "options, pdl, decision, reason",
    [
        (
            dict(target="sm90", cudagraphs=True),
            True,
            "pdl on",
            "PDL-safe kernel on sm90, run under CUDA graphs (captured as a programmatic edge)",
        ),
        (dict(target="sm90"), False, "pdl off", NO_GRAPHS),
        (dict(target="sm90", pdl="on"), True, "pdl on", "options pdl='on'"),
        (dict(target="sm90", pdl="off", cudagraphs=True), False, "pdl off", "options pdl='off'"),
        (
            dict(target="sm90", pdl="on", cudagraphs=True, kernels={"moe": "reference"}),
            False,
            "pdl off",
            REFERENCE_NO_PDL,
        ),
    ],
)
def test_run_writes_the_pdl_argument_and_a_decision(options, pdl, decision, reason):
    graph = _cuda_moe_graph()
    result = _select_then_pdl(graph, **options)
    node = _moe_node(graph)
    assert node.kwargs.get("pdl", False) is pdl
    assert result.changed is pdl
    (d,) = result.decisions
    assert (d.node, d.canonical_op, d.decision, d.reason) == ("moe", "rubin.moe", decision, reason)
    kernel = options.get("kernels", {}).get("moe", "triton")
    assert d.details == {"kernel": kernel, "target": "sm90"}
    assert result.notes[0] == (
        f"{int(pdl)} of 1 kernel node(s) launched with PDL (pdl={options.get('pdl', 'auto')!r}; "
        f"options cudagraphs={options.get('cudagraphs', False)})"
    )


def test_run_turns_a_stale_pdl_flag_off():
    graph = _cuda_moe_graph()
    _select_then_pdl(graph, target="sm90", pdl="on")
    assert _moe_node(graph).kwargs["pdl"] is True
    result = chain_pdl.run(
        graph,
        PassContext(options=RubinOptions.resolve({"target": "sm90", "pdl": "off"}, environ={}), target=resolve("sm90")),
    )
    assert result.changed is True and _moe_node(graph).kwargs["pdl"] is False
    assert [d.decision for d in result.decisions] == ["pdl off"]


def test_pdl_option_changes_the_pass_uuid():
    def uuid(**o):
        return PassManager(RubinOptions.resolve({"target": "sm90", **o}, environ={})).uuid()

    assert len({uuid(pdl="auto"), uuid(pdl="on"), uuid(pdl="off")}) == 3
    assert uuid(pdl=True) == uuid(pdl="on") and uuid(pdl=False) == uuid(pdl="off")
    assert uuid() == uuid(pdl="auto")
    assert uuid(cudagraphs=True) != uuid(cudagraphs=False)


# ------------------------------------------------------------------------------------------------
# end to end: torch.compile(backend="rubin") on the CPU, plans for sm90
# ------------------------------------------------------------------------------------------------


@cpu_only
def test_sm90_under_cudagraphs_launches_the_moe_with_pdl(rubin_run):
    compile_for_gpu_target(rubin_run, DirectMoE(), target="sm90", cudagraphs=True)
    (line,) = moe_lines(rubin_run.stage_code("chain_pdl"))
    assert "impl = 'triton@sm90'" in line and "pdl = True" in line
    (graph_dir,) = rubin_run.dump_dir.iterdir()
    assert "pdl = True" in stage_file(graph_dir, "chain_pdl").read_text()
    assert "pdl = True" not in stage_file(graph_dir, "select_kernels").read_text()
    (d,) = moe_decisions(rubin_run)
    assert d["decision"] == "pdl on" and d["canonical_op"] == "rubin.moe"
    assert d["reason"] == "PDL-safe kernel on sm90, run under CUDA graphs (captured as a programmatic edge)"
    assert d["details"] == {"kernel": "triton", "target": "sm90"}
    (r,) = route_decisions(rubin_run)  # the fused routing ahead of it (match_routing), chained the same way
    assert r["decision"] == "pdl on" and r["details"] == {"kernel": "triton", "target": "sm90"}
    assert "2 of 2 kernel node(s) launched with PDL (pdl='auto'; options cudagraphs=True)" in pass_notes(
        rubin_run, "chain_pdl"
    )
    (report,) = rubin_run.reports()
    assert report["options"]["cudagraphs"] is True and report["options"]["pdl"] == "auto"


@cpu_only
def test_sm90_without_cudagraphs_leaves_pdl_off(rubin_run):
    compile_for_gpu_target(rubin_run, DirectMoE(), target="sm90", cudagraphs=False)
    (line,) = moe_lines(rubin_run.stage_code("chain_pdl"))
    assert "impl = 'triton@sm90'" in line and "pdl" not in line
    (graph_dir,) = rubin_run.dump_dir.iterdir()
    assert not stage_file(graph_dir, "chain_pdl").exists()  # nothing changed: no stage written
    (d,) = moe_decisions(rubin_run)
    assert d["decision"] == "pdl off" and d["reason"] == NO_GRAPHS


@cpu_only
def test_sm90_pdl_on_without_graphs_and_mode_reduce_overhead(rubin_run, monkeypatch):
    compile_for_gpu_target(rubin_run, DirectMoE(), target="sm90", pdl=True)
    (line,) = moe_lines(rubin_run.stage_code("chain_pdl"))
    assert "pdl = True" in line
    assert [(d["decision"], d["reason"]) for d in pass_decisions(rubin_run, "chain_pdl")] == [
        ("pdl on", "options pdl='on'")
    ] * 2  # the rubin.route ahead of the MoE, and the MoE

    # mode="reduce-overhead" (torch.compile takes mode or options, not both: the rest from RUBIN_*) implies
    # cudagraphs, so pdl="auto" turns on
    dump = rubin_run.dump_dir.parent / "mode_dumps"
    monkeypatch.setenv("RUBIN_DUMP_DIR", str(dump))
    monkeypatch.setenv("RUBIN_TARGET", "sm90")
    torch._dynamo.reset()
    model = DirectMoE().to(torch.bfloat16).eval()
    compiled = torch.compile(model, backend="rubin", mode="reduce-overhead")
    with pytest.raises(KernelUnavailableError), torch.no_grad():
        compiled(torch.randn(4, 256, dtype=torch.bfloat16))
    from tests.conftest import RubinRun

    run2 = RubinRun(dump)
    (line,) = moe_lines(run2.stage_code("chain_pdl"))
    assert "pdl = True" in line
    (d,) = moe_decisions(run2)
    assert d["decision"] == "pdl on" and "run under CUDA graphs" in d["reason"]


def test_the_execution_mode_comes_from_the_engine():
    """chain_pdl asks the engine adapter whether the graph runs under CUDA graphs (inside vLLM: vLLM's
    cudagraph_mode, tests/cpu/integrations/test_vllm_engine.py); without an engine, the options say it."""

    class UnderGraphs(Engine):
        def runs_under_cudagraphs(self, options):
            return True, "the engine replays CUDA graphs"

    opts = RubinOptions.resolve({"target": "sm90", "cudagraphs": False}, environ={})
    graph = _cuda_moe_graph()
    select_kernels.run(graph, PassContext(options=opts))
    result = chain_pdl.run(graph, PassContext(options=opts, engine=UnderGraphs()))
    assert result.decisions[0].decision == "pdl on"
    assert any("the engine replays CUDA graphs" in n for n in result.notes)
    assert Engine().runs_under_cudagraphs(opts) == (False, "options cudagraphs=False")
