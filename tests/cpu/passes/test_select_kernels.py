"""select_kernels: plans per target in the dumps, forced kernels, strict mode, and the clear error when a
plan made for a GPU is executed on this CPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from rubin_compile.ops.registry import KernelUnavailableError, canonical_form
from rubin_compile.options import RubinOptions
from rubin_compile.passes import select_kernels
from rubin_compile.passes.base import PassContext
from rubin_compile.passes.manager import PassManager
from tests.conftest import assert_close_to_eager, count_ops, stage_file
from tests.cpu.passes.match_moe.test_expert_loop import LoopMoE

needs_flashinfer = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None,
    reason="flashinfer-python is not installed (tests/run.sh installs it)",
)
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks behaviour on a machine without CUDA")


def _model(dtype):
    model = LoopMoE().to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def _moe_graph(w_dtype=torch.bfloat16, block_shape=None, E=8, H=256, I=256, T=4, k=2, activation="silu"):
    """A graph with one rubin.moe node and fake values on every node, as match_moe leaves it."""
    import rubin_compile.ops  # noqa: F401

    def f(x, w13, w2, tw, ids, *scales):
        kwargs = {}
        if scales:
            kwargs = {"w13_scale": scales[0], "w2_scale": scales[1], "block_shape": block_shape}
        return torch.ops.rubin.moe(x, w13, w2, tw, ids, activation, **kwargs)

    with FakeTensorMode():
        args = [
            torch.empty(T, H, dtype=torch.bfloat16),
            torch.empty(E, 2 * I, H, dtype=w_dtype),
            torch.empty(E, H, I, dtype=w_dtype),
            torch.empty(T, k),
            torch.zeros(T, k, dtype=torch.int64),
        ]
        if w_dtype == torch.float8_e4m3fn:
            if block_shape:
                bn, bk = block_shape
                args += [torch.empty(E, -(-2 * I // bn), -(-H // bk)), torch.empty(E, -(-H // bn), -(-I // bk))]
            else:
                args += [torch.empty(E), torch.empty(E)]
        return make_fx(f, tracing_mode="fake")(*args).graph


def _select(graph, **options):
    opts = RubinOptions.resolve(options, environ={})
    return select_kernels.run(graph, PassContext(options=opts, target=opts.resolved_target()))


def _is_moe(node):
    form = canonical_form(node)
    return form is not None and form[0].name == "moe"


def _impl(graph):
    (node,) = [n for n in graph.nodes if _is_moe(n)]
    return node.kwargs.get("impl", "reference")


@pytest.mark.parametrize(
    "w_dtype, block, target, kernel, quant",
    [
        (torch.bfloat16, None, "sm90", "triton", "none"),
        (torch.float8_e4m3fn, None, "sm90", "triton", "fp8_tensor"),
        (torch.float8_e4m3fn, [128, 128], "sm90", "triton", "fp8_block"),
        (torch.float8_e4m3fn, [128, 128], "sm100", "flashinfer_trtllm", "fp8_block"),
        (torch.bfloat16, None, "sm107", "flashinfer_trtllm", "none"),
        (torch.bfloat16, None, "cpu", "reference", "none"),
    ],
)
def test_spec_from_the_node_and_the_kernel_written_into_it(w_dtype, block, target, kernel, quant):
    if kernel.startswith("flashinfer") and importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer-python is not installed")
    graph = _moe_graph(w_dtype, block)
    result = _select(graph, target=target)
    (plan,) = result.plans
    assert plan.spec["quant"] == quant and plan.spec["shape"] == {"T": 4, "E": 8, "H": 256, "I": 256, "k": 2}
    assert plan.kernel == kernel and plan.target == target
    if target == "cpu":  # the reference on the CPU, bf16: lowered into the op's ATen form (grouped GEMMs)
        assert plan.lowered == "aten" and not any(_is_moe(n) for n in graph.nodes)
    else:
        assert _impl(graph) == plan.impl == f"{kernel}@{target}" and plan.lowered is None
    assert result.changed


@pytest.mark.parametrize("target", ["sm90", "sm107"])
def test_moe_no_kernel_takes_on_a_gpu_target_is_lowered_to_grouped_gemms(target):
    """GPT-OSS's clamped SwiGLU (interleaved gate / up rows), bf16, on a GPU target: no kernel of ours takes it, so
    it is bound to the reference -- which inside a CUDA graph runs every expert on every token (E / k times the
    weight bytes) -- and is lowered into the ATen form, torch's grouped GEMM over the routed experts (below sm_90,
    a detected target only, it stays the op with the reason: tests/cpu/ops/test_moe.py). The Triton MoE's own
    activations are bound to it as before (test_spec_from_the_node_and_the_kernel_written_into_it)."""
    graph = _moe_graph(activation="swigluoai")
    result = _select(graph, target=target)
    (plan,) = result.plans
    assert plan.kernel == "reference" and plan.lowered == "aten"
    assert any("activation swigluoai is not implemented in the Triton MoE" in r["reason"] for r in plan.rejected)
    assert not any(_is_moe(n) for n in graph.nodes) and "grouped_mm" in str(graph)


@cpu_only
def test_cpu_target_runs_the_reference_with_exact_numerics(rubin_run):
    model = _model(torch.float32)
    x = torch.randn(7, 32)
    with torch.no_grad():
        out = rubin_run.compile(model)(x)
        assert_close_to_eager(out, model(x))
    (plan,) = rubin_run.plans()
    assert plan["kernel"] == "reference" and plan["target"] == "cpu" and plan["impl"] == "reference"
    assert {r["kernel"] for r in plan["rejected"]} >= {"triton", "flashinfer_cutlass", "flashinfer_trtllm"}
    assert rubin_run.reports()[0]["target"]["name"] == "cpu"


@needs_flashinfer
@cpu_only
def test_plan_for_sm107_made_on_the_cpu_and_executing_it_raises_a_clear_error(rubin_run):
    # the fused routing ahead of the MoE forced to run here, so that the MoE's kernel is the one that cannot
    compiled = rubin_run.compile(_model(torch.bfloat16), target="sm107", kernels={"route": "reference"})
    with pytest.raises(KernelUnavailableError) as err, torch.no_grad():
        compiled(torch.randn(5, 32, dtype=torch.bfloat16))
    (plan,) = rubin_run.plans("rubin.moe")
    # H=32 / I=24: trtllm-gen's I % 128 limit rejects it, so CUTLASS (128-bit aligned rows) is chosen.
    assert plan["kernel"] == "flashinfer_cutlass" and plan["impl"] == "flashinfer_cutlass@sm107"
    rejected = {r["kernel"]: r["reason"] for r in plan["rejected"]}
    assert rejected["flashinfer_trtllm"] == "shape limit: I=24 must be a multiple of 128"
    assert "cc [90] only, not on sm107" in rejected["flashinfer_cutedsl"]
    message = str(err.value)
    assert "compiled for target sm107 with kernel 'flashinfer_cutlass'" in message
    assert "cannot run on this machine (target cpu)" in message
    # The dump shows the bound kernel; report.md and explain show the plan.
    (graph_dir,) = rubin_run.dump_dir.iterdir()
    assert "impl = 'flashinfer_cutlass@sm107'" in stage_file(graph_dir, "select_kernels").read_text()
    report_md = (graph_dir / "report.md").read_text()
    assert "target: sm107 (Rubin)" in report_md
    assert "| moe_default | rubin.moe | bfloat16 T=5 E=6 H=32 I=24 k=2 silu | flashinfer_cutlass (sm107) |" in report_md
    assert "| moe_default | flashinfer_trtllm | shape limit: I=24 must be a multiple of 128 |" in report_md
    cli = subprocess.run(
        [sys.executable, "-m", "rubin_compile", "explain", str(rubin_run.dump_dir), "--changed"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0 and "flashinfer_cutlass (sm107)" in cli.stdout and "rejected kernel" in cli.stdout


@needs_flashinfer
def test_forced_kernel_rejected_with_its_reason_and_strict_makes_it_an_error():
    graph = _moe_graph()
    result = _select(graph, target="sm107", kernels={"moe": "flashinfer_cutedsl"})
    (plan,) = result.plans
    assert plan.forced == "flashinfer_cutedsl" and "cc [90] only, not on sm107" in plan.forced_reason
    assert plan.kernel == "flashinfer_trtllm"
    assert any("forced kernel 'flashinfer_cutedsl' rejected on sm107" in n for n in result.notes)
    with pytest.raises(
        select_kernels.KernelSelectionError,
        match=r"rubin \(strict\): options.kernels forces 'flashinfer_cutedsl' for rubin.moe.*sm107.*cc \[90\]",
    ):
        _select(_moe_graph(), target="sm107", kernels={"moe": "flashinfer_cutedsl"}, strict=True)


def test_forced_kernel_that_can_run_is_used_and_unknown_names_are_errors():
    graph = _moe_graph()
    result = _select(graph, target="sm90", kernels={"moe": "reference"})
    (plan,) = result.plans
    assert plan.kernel == "reference" and plan.forced_reason is None and _impl(graph) == "reference@sm90"
    # the reference the user named runs as itself on a GPU target, not as the ATen form
    assert plan.lowered is None and any("options.kernels names the reference" in n for n in result.notes)
    with pytest.raises(ValueError, match=r"unknown kernel 'cutlass' for rubin.moe; its kernels are \[.*'triton'"):
        _select(_moe_graph(), target="sm90", kernels={"moe": "cutlass"})


@cpu_only
def test_forced_reference_on_a_gpu_target_still_runs_here(rubin_run):
    model = _model(torch.bfloat16)
    x = torch.randn(6, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        out = rubin_run.compile(model, target="sm100", kernels={"moe": "reference", "route": "reference"})(x)
        assert_close_to_eager(out, model(x))
    plans = rubin_run.plans()
    assert [(p["canonical_op"], p["kernel"], p["forced"]) for p in plans] == [
        ("rubin.route", "reference", "reference"),
        ("rubin.moe", "reference", "reference"),
    ]


def test_uuid_follows_the_target_and_forced_kernels():
    def uuid(**o):
        return PassManager(RubinOptions.resolve(o, environ={})).uuid()

    assert uuid(target="sm107") != uuid(target="sm90") != uuid(target="cpu")
    assert uuid(target="sm107") == uuid(target="sm_107") == uuid(target="rubin")
    assert uuid(target="sm90") != uuid(target="sm90", kernels={"moe": "triton"})
    report = json.loads(
        json.dumps(PassManager(RubinOptions.resolve({"target": "sm107"}, environ={})).run(_moe_graph()))
    )
    assert report["target"]["name"] == "sm107" and report["target"]["sm_count"] == 212


def test_impl_given_positionally_is_replaced_in_place():
    graph = _moe_graph()
    (node,) = [n for n in graph.nodes if _is_moe(n)]
    node.args = (*node.args, "silu", None, None, None, None, None, "reference")  # as an emitter might
    node.kwargs = {}
    _select(graph, target="sm90")
    assert node.args[11] == "triton@sm90" and "impl" not in node.kwargs


def test_auto_target_on_a_gpu_machine_plans_cpu_graphs_for_the_cpu(rubin_run, monkeypatch):
    """target "auto" on a machine with a GPU, model on the CPU: the plan is for the CPU (the reference
    kernel), not for the GPU the tensors never reach (seen on the H200 before this was fixed)."""
    from rubin_compile import target as target_mod

    monkeypatch.setattr(target_mod, "detect", lambda device_index=0: target_mod.resolve("sm90"))
    model = LoopMoE().to(torch.bfloat16).eval()
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        got = rubin_run.compile(model)(x)
        want = model(x)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    (report,) = rubin_run.reports()
    sel = next(p for p in report["passes"] if p["name"] == "select_kernels")
    assert [pl["impl"] for pl in sel["plans"]] == ["reference"] and sel["plans"][0]["target"] == "cpu"
    assert any("planning for the CPU" in n for n in sel["notes"])


class _Mlp(torch.nn.Module):
    """A gated MLP: one product with a SiLU-and-mul epilogue, one with a bias and a residual add."""

    def __init__(self, hidden=32, inter=48):
        super().__init__()
        self.gate_up = torch.nn.Linear(hidden, 2 * inter, bias=False)
        self.down = torch.nn.Linear(inter, hidden, bias=True)

    def forward(self, x):
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return x + self.down(torch.nn.functional.silu(g) * u)


@pytest.mark.parametrize(
    "target,kernel,dtype",
    [
        ("cpu", "reference", torch.float32),
        ("cpu", "reference", torch.bfloat16),
        ("sm90", "torch", torch.bfloat16),
        ("sm107", "torch", torch.bfloat16),
    ],
)
def test_gemm_bound_to_aten_kernels_is_lowered_back_to_aten(rubin_run, target, kernel, dtype):
    """A rubin.gemm whose kernel is torch.mm / addmm (the torch kernel on a GPU, the reference on the CPU)
    goes back to those ATen ops, so Inductor fuses the epilogue as it would without rubin; the plan keeps
    the decision and says it was lowered; results equal eager."""
    model = _Mlp().to(dtype).eval()
    x = torch.randn(2, 5, 32, dtype=dtype)
    with torch.no_grad():
        got = rubin_run.compile(model, target=target)(x)
    assert_close_to_eager(got, model(x), dtype)
    (report,) = rubin_run.reports()
    sel = next(p for p in report["passes"] if p["name"] == "select_kernels")
    plans = [pl for pl in sel["plans"] if pl["canonical_op"] == "rubin.gemm"]
    assert [pl["kernel"] for pl in plans] == [kernel, kernel] and all(pl["lowered"] == "aten" for pl in plans)
    assert any("lowered back to ATen" in n for n in sel["notes"])
    assert "rubin.gemm" in rubin_run.stage_code("match_gemm")
    final = rubin_run.final_code()
    assert "rubin.gemm" not in final and "aten.addmm" in final and "aten.mm" in final
    (md,) = [p.read_text() for p in rubin_run.dump_dir.glob("*/report.md")]
    assert md.count("; lowered to ATen") == 2  # what `python -m rubin_compile explain` prints


@cpu_only
def test_moe_on_the_cpu_is_lowered_to_grouped_gemms(rubin_run):
    """bf16 on the CPU: rubin.moe bound to the reference (a loop over the routed experts with a host
    synchronisation, slower than Inductor's compile of transformers' grouped-mm experts: benchmarks/results/
    cpu-models.md) becomes its ATen form, grouped GEMMs over the slots sorted by expert, which Inductor compiles;
    the plan says so and the result stays within bf16 tolerance of eager."""
    model = _model(torch.bfloat16)
    x = torch.randn(7, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        got = rubin_run.compile(model)(x)
        assert_close_to_eager(got, model(x), torch.bfloat16)
    (plan,) = rubin_run.plans("rubin.moe")
    assert plan["kernel"] == "reference" and plan["lowered"] == "aten"
    (report,) = rubin_run.reports()
    sel = next(p for p in report["passes"] if p["name"] == "select_kernels")
    assert any(
        "rubin.moe node(s) bound to torch / reference lowered back to ATen (grouped GEMMs" in n for n in sel["notes"]
    )
    assert "rubin.moe" in rubin_run.stage_code("match_moe")
    final = rubin_run.final_code()
    assert "rubin.moe" not in final and "_grouped_mm" in final


@cpu_only
def test_moe_the_aten_form_cannot_express_stays_an_op_call_with_the_reason(rubin_run):
    """fp16 on the CPU: Inductor compiles torch's grouped GEMM for bf16 only, so the node stays the reference op
    call, and select_kernels' notes say why."""
    model = _model(torch.float16)
    x = torch.randn(7, 32, dtype=torch.float16)
    with torch.no_grad():
        assert_close_to_eager(rubin_run.compile(model)(x), model(x))
    (plan,) = rubin_run.plans("rubin.moe")
    assert plan["lowered"] is None
    (report,) = rubin_run.reports()
    notes = next(p for p in report["passes"] if p["name"] == "select_kernels")["notes"]
    assert any(
        "rubin.moe stays an op call of 'reference': its ATen form (grouped GEMMs over the slots sorted by expert) "
        "does not apply: torch.float16 activations" in n
        for n in notes
    ), notes
    assert "rubin.moe" in rubin_run.final_code()


def test_moe_float32_on_the_cpu_lowered_with_a_gemm_per_expert(rubin_run):
    """fp32 on the CPU: the ATen form with its two grouped GEMMs as grouped_mm_rows calls (a GEMM per expert's
    run of slots; Inductor's grouped GEMM takes bf16 only), the sort, gathers and sums compiled by Inductor; no
    reference op call is left (it looped over the experts in Python, 1.4x Inductor's time on the generate example)."""
    model = _model(torch.float32)
    x = torch.randn(7, 32)
    with torch.no_grad():
        assert_close_to_eager(rubin_run.compile(model)(x), model(x))
    (plan,) = rubin_run.plans("rubin.moe")
    assert plan["lowered"] == "aten"
    code = rubin_run.final_code()
    assert "rubin.moe" not in code and count_ops(code, "rubin.grouped_mm_rows") == 2


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer-python for its FP8 GEMM")
def test_gemm_bound_to_another_kernel_stays_a_canonical_op(rubin_run):
    """FP8 per-tensor on sm_100 binds a FlashInfer GEMM: the node stays rubin.gemm (not lowered), and running
    the plan here is the clear error of a kernel this machine cannot run."""
    from tests.cpu.passes.test_match_gemm import Fp8Linear

    block = Fp8Linear(bias=False)
    compiled = rubin_run.compile(block, target="sm100")
    with pytest.raises(KernelUnavailableError, match="sm100"):
        compiled(torch.randn(2, 5, 32, dtype=torch.bfloat16))
    (report,) = rubin_run.reports()
    (plan,) = next(p for p in report["passes"] if p["name"] == "select_kernels")["plans"]
    assert plan["kernel"].startswith("flashinfer") and plan["lowered"] is None
    assert "rubin.gemm" in rubin_run.final_code()


def test_a_plan_for_a_gpu_made_without_its_packages_says_so(rubin_run, monkeypatch):
    """RUBIN_TARGET=sm107 where triton and flashinfer are not installed (the README's first command): the plan
    binds the reference kernel, says once which packages are missing with the install command (a note and a
    warning), and the passes after selection reason about sm107, not the CPU (before: "target cpu has no GPU")."""
    import importlib.util

    from tests.cpu.passes.match_moe.test_expert_loop import LoopMoE

    select_kernels._warn_once.cache_clear()
    real = importlib.util.find_spec
    hidden = ("triton", "flashinfer", "cutlass", "cudnn")
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name.split(".")[0] in hidden else real(name, *a)
    )
    model = LoopMoE(hidden=256, inter=256).to(torch.bfloat16).eval()
    with (
        pytest.warns(UserWarning, match=r"the plan for sm107 may not be the one sm107 gets.*pip install"),
        torch.no_grad(),
    ):
        rubin_run.compile(model, target="sm107", cudagraphs=True)(torch.randn(4, 256, dtype=torch.bfloat16))
    (report,) = rubin_run.reports()
    passes = {p["name"]: p for p in report["passes"]}
    (plan,) = passes["select_kernels"]["plans"]
    assert plan["impl"] == "reference@sm107"
    (note,) = [n for n in passes["select_kernels"]["notes"] if "not installed here" in n]
    assert "pip install flashinfer-python triton" in note and "triton" in note.split("(")[1]
    assert plan["lowered"] is None  # the op, not its ATen form: sm107's own plan binds a kernel the packages bring
    assert [d["reason"] for d in passes["place_locality"]["decisions"]] == ["kernel reference has no split-N form"]
    assert passes["chain_pdl"]["decisions"][0]["reason"].startswith("reference takes no PDL launch")
    assert passes["chain_pdl"]["decisions"][0]["details"]["target"] == "sm107"


def test_a_forced_kernel_that_cannot_run_warns(rubin_run):
    """options.kernels={"moe": "triton"} on the CPU: without strict the reference runs, and the user is told so by a
    warning, not only in the report (before: silently)."""
    from tests.cpu.passes.match_moe.test_expert_loop import LoopMoE

    select_kernels._warn_once.cache_clear()
    model = LoopMoE().eval()
    with (
        pytest.warns(UserWarning, match=r"options.kernels: .*forced kernel 'triton' rejected on cpu.*strict=True"),
        torch.no_grad(),
    ):
        rubin_run.compile(model, kernels={"moe": "triton"})(torch.randn(5, 32))
