"""The pass manager: pipeline order, uuid(), dumps, explain, TORCH_TRACE."""

import io
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rubin_compile.debug.explain import ExplainError, explain
from rubin_compile.options import RubinOptions
from rubin_compile.passes import PASS_NAMES
from rubin_compile.passes.manager import PassManager
from tests.cpu.passes.match_moe.test_expert_loop import LoopMoE


def _graph():
    gm = torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1)
    return gm.graph


def test_pipeline_order():
    report = PassManager(RubinOptions.resolve({}, environ={})).run(_graph())
    assert [p["name"] for p in report["passes"]] == list(PASS_NAMES)
    assert PASS_NAMES == (
        "canonicalize",
        "match_moe",
        "match_routing",
        "match_attention",
        "match_gemm",
        "fuse_projections",
        "select_kernels",
        "place_locality",
        "chain_pdl",
        "inline_kernels",
    )


def test_a_pass_reads_only_what_its_entry_declares():
    """The manager hands each pass a context holding the fields its Pass entry declares."""
    from rubin_compile.passes import PIPELINE
    from rubin_compile.passes.base import Pass, PassContext, PassResult

    ctx = PassContext(options=RubinOptions.resolve({}, environ={}), graph_id="g0")
    seen = {}

    def reads_target(graph, view):
        seen["graph_id"], seen["target"] = view.graph_id, view.target.name
        view.engine  # noqa: B018  (not declared: an error naming the pass)
        return PassResult("probe")

    probe = Pass("probe", reads_target, reads=("target",))
    with pytest.raises(AttributeError, match=r"pass probe reads ctx.engine, which its Pass entry does not declare"):
        probe.run(_graph(), probe.context(ctx))
    assert seen == {"graph_id": "g0", "target": ctx.target.name}
    with pytest.raises(ValueError, match="reads \\['device'\\], which PassContext does not have"):
        Pass("bad", reads_target, reads=("device",))
    assert [p.name for p in PIPELINE] == list(PASS_NAMES)


def test_disabled_passes_do_not_run():
    report = PassManager(RubinOptions.resolve({"passes": "canonicalize"}, environ={})).run(_graph())
    ran = [p["name"] for p in report["passes"] if p["notes"] != ["disabled by options.passes"]]
    assert ran == ["canonicalize"]


def test_uuid_is_stable_and_changes_with_options():
    base = RubinOptions.resolve({}, environ={})
    assert PassManager(base).uuid() == PassManager(RubinOptions.resolve({}, environ={})).uuid()
    assert PassManager(base).uuid() != PassManager(RubinOptions.resolve({"strict": True}, environ={})).uuid()
    assert PassManager(base).uuid() != PassManager(RubinOptions.resolve({"passes": "match_moe"}, environ={})).uuid()


def test_dumps_and_explain(rubin_run):
    # fp16: the MoE stays a rubin.moe op call on the CPU (fp32 and bf16 are lowered to ATen), so the later passes
    # decide something about it
    model = LoopMoE().half().eval()
    with torch.no_grad():
        rubin_run.compile(model)(torch.randn(5, 32, dtype=torch.float16))
    (graph_dir,) = sorted(rubin_run.dump_dir.iterdir())
    names = sorted(p.name for p in graph_dir.iterdir())
    assert "00-input.py" in names and "02-match_moe.py" in names and "02-match_moe.diff" in names
    assert "report.json" in names and "report.md" in names
    diff = (graph_dir / "02-match_moe.diff").read_text()
    assert "+" in diff and "torch.ops.rubin.moe.default" in diff
    report = json.loads((graph_dir / "report.json").read_text())
    assert report["uuid"] and report["options"]["dump_dir"] == str(rubin_run.dump_dir)
    out = io.StringIO()
    assert explain(str(rubin_run.dump_dir), out) == 1
    text = out.getvalue()
    assert "| moe_default | rubin.moe | expert loop |" in text
    assert "1 rewrite(s) in all" in text
    cli = subprocess.run(
        [sys.executable, "-m", "rubin_compile", "explain", str(rubin_run.dump_dir), "--changed"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0 and "expert loop" in cli.stdout
    assert "## chain_pdl" in cli.stdout and "| pdl off |" in cli.stdout  # a decision per MoE node is shown
    assert "## match_attention" not in cli.stdout  # nothing matched, chosen or decided there
    # --graph with an id not dumped here: an error listing the ones that are (before: nothing, exit 0)
    cli = subprocess.run(
        [sys.executable, "-m", "rubin_compile", "explain", str(rubin_run.dump_dir), "--graph", "g999-nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        cli.returncode == 2 and f"no graph 'g999-nope'; the graphs dumped here are ['{graph_dir.name}']" in cli.stderr
    )
    assert explain(str(rubin_run.dump_dir), io.StringIO(), graph=graph_dir.name) == 1


def test_explain_on_a_folder_without_dumps(tmp_path):
    with pytest.raises(ExplainError, match="no rubin dump here"):
        explain(str(tmp_path), io.StringIO())
    cli = subprocess.run(
        [sys.executable, "-m", "rubin_compile", "explain", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 2 and "no such folder" in cli.stderr


def test_env_dump_dir_and_torch_trace_artifacts(tmp_path):
    """RUBIN_DUMP_DIR alone turns dumps on; TORCH_TRACE gets the same artifacts for tlparse."""
    script = textwrap.dedent("""
        import torch
        from tests.cpu.passes.match_moe.test_expert_loop import LoopMoE
        m = LoopMoE().eval()
        with torch.no_grad():
            torch.compile(m, backend="rubin")(torch.randn(4, 32))
    """)
    env = dict(os.environ, RUBIN_DUMP_DIR=str(tmp_path / "dumps"), TORCH_TRACE=str(tmp_path / "trace"))
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert list((tmp_path / "dumps").glob("*/report.json"))
    logs = "".join(p.read_text() for p in (tmp_path / "trace").glob("*.log"))
    for name in ("rubin_graph_input", "rubin_graph_after_match_moe", "rubin_report"):
        assert f'"name": "{name}"' in logs


def test_a_second_compile_into_the_same_dump_dir_dumps_again(rubin_run):
    """No compile cache (FX graph or AOTAutograd) may skip the pass while dumps are asked for."""
    model = LoopMoE().eval()
    for expected in (1, 2):
        with torch.no_grad():
            rubin_run.compile(model)(torch.randn(4, 32))
        assert len(rubin_run.reports()) == expected


def test_package_import_stays_light():
    # (Triton and cuda.bindings are left out: torch itself imports them whenever they are installed.)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, rubin_compile; "
            "print(sorted(m for m in ('vllm', 'flashinfer', 'cutlass', 'transformers') if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_uuid_changes_with_the_packages_that_decide_a_plan(monkeypatch):
    """Installing or upgrading FlashInfer (or Triton, CuTe-DSL, vLLM) changes what selection chooses, so it must
    change the cache key too (before: only rubin's sources, the options and torch were hashed)."""
    import importlib.metadata

    from rubin_compile.passes import manager as manager_mod

    opts = RubinOptions.resolve({}, environ={})
    manager_mod.package_versions.cache_clear()
    before = PassManager(opts).uuid()
    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: "99.0" if name == "flashinfer-python" else real(name)
    )
    manager_mod.package_versions.cache_clear()
    try:
        assert manager_mod.package_versions()["flashinfer-python"] == "99.0"
        assert PassManager(opts).uuid() != before
    finally:
        manager_mod.package_versions.cache_clear()
