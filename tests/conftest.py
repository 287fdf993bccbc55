"""Shared test helpers: compile with the rubin backend and read back what the pipeline did."""

from __future__ import annotations

import json
import random
import tempfile
import zlib
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch

import rubin_compile  # noqa: F401  (registers the ops and the backend)

# The files that take minutes, collected first: tests/run.sh runs pytest-xdist with --dist loadfile, which hands files
# to the workers in collection order, so a long file collected last would keep one worker busy after the others are
# done (the model survey alone is 7 minutes on 2 cores). The order within each file, and of the rest, is unchanged.
SLOW_FIRST = (
    "tests/cpu/test_models_doc.py",
    "tests/vllm/test_vllm_e2e.py",
    "tests/vllm/test_vllm_attention_gemm.py",
    "tests/vllm/test_examples_vllm.py",
    "tests/cpu/passes/match_moe/test_hf_grouped_mm.py",
    "tests/cpu/test_examples.py",
    "tests/cpu/passes/match_moe/test_hf_batched_mm.py",
    "tests/cpu/kernels/test_flashinfer_plans.py",
    "tests/cpu/ops/test_fp4_and_dequantize.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


class RubinRun:
    """A model compiled with ``backend="rubin"`` into a fresh dump folder, and the reports it wrote."""

    def __init__(self, dump_dir: Path) -> None:
        self.dump_dir = dump_dir

    def compile(self, model: Callable, dynamic: Optional[bool] = None, **options: Any) -> Callable:
        torch._dynamo.reset()
        return torch.compile(
            model, backend="rubin", dynamic=dynamic, options={"dump_dir": str(self.dump_dir), **options}
        )

    def reports(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.dump_dir.glob("*/report.json"))]

    def rewrites(self, pass_name: str = "match_moe") -> list[dict]:
        return [r for rep in self.reports() for p in rep["passes"] if p["name"] == pass_name for r in p["rewrites"]]

    def notes(self, pass_name: str) -> list[str]:
        return [n for rep in self.reports() for p in rep["passes"] if p["name"] == pass_name for n in p["notes"]]

    def plans(self, canonical_op: Optional[str] = None) -> list[dict]:
        """select_kernels' plans over every dumped graph (of ``canonical_op``, e.g. "rubin.moe", when given)."""
        return [
            pl
            for rep in self.reports()
            for p in rep["passes"]
            if p["name"] == "select_kernels"
            for pl in p["plans"]
            if canonical_op is None or pl["canonical_op"] == canonical_op
        ]

    def unchanged(self, pass_name: str = "match_moe") -> list[dict]:
        return [u for rep in self.reports() for p in rep["passes"] if p["name"] == pass_name for u in p["unchanged"]]

    def stage_code(self, pass_name: str) -> str:
        return stage_code(self.dump_dir, pass_name)

    def matched_code(self) -> str:
        """The code of every dumped graph as the matchers left it (before select_kernels binds its canonical nodes,
        lowering some back to ATen: on the CPU a bf16 rubin.moe becomes grouped GEMMs), concatenated."""
        return self.stage_code("fuse_projections")

    def final_code(self) -> str:
        """The code of every dumped graph after the last stage that changed it, concatenated."""
        out = []
        for d in sorted(self.dump_dir.iterdir()):
            stages = sorted(d.glob("[0-9][0-9]-*.py"))
            out.append(stages[-1].read_text())
        return "\n".join(out)


def check_two_shapes_and_dynamic(
    tmp_path: Path, model: Callable, inputs_at: Callable[[int], tuple], sizes: tuple, pass_name: str, canonical_op: str
) -> None:
    """``model`` compiled with rubin and called at two sizes (the second call recompiles with a dynamic size, as
    torch.compile does), then, after a reset, compiled with ``dynamic=True`` and called at both: every call
    equals eager (fp32), and every graph compiled rewrote at least one ``canonical_op`` in ``pass_name`` (so
    symbolic sizes went through the matcher and into its report)."""
    for dynamic in (None, True):
        run = RubinRun(tmp_path / f"dumps-dynamic-{dynamic}")
        compiled = run.compile(model, dynamic=dynamic)
        for size in sizes:
            inputs = inputs_at(size)
            with torch.no_grad():
                got, want = compiled(*inputs), model(*inputs)
            got, want = (x.logits if hasattr(x, "logits") else x for x in (got, want))
            assert_close_to_eager(got, want, torch.float32)
        reports = run.reports()
        assert len(reports) == (2 if dynamic is None else 1), [r["graph_id"] for r in reports]
        for report in reports:
            (result,) = [p for p in report["passes"] if p["name"] == pass_name]
            assert [r for r in result["rewrites"] if r["canonical_op"] == canonical_op], (dynamic, result)
            assert report["reporting_errors"] == []


def stage_file(graph_dir: Path, pass_name: str) -> Path:
    """The dump of one graph after ``pass_name`` (``NN-<pass>.py``, NN its place in the pipeline; written only when
    the pass changed the graph)."""
    from rubin_compile.passes import PASS_NAMES

    return graph_dir / f"{PASS_NAMES.index(pass_name) + 1:02d}-{pass_name}.py"


def stage_code(dump_dir: Path, pass_name: str) -> str:
    """Every graph dumped under ``dump_dir`` as it was after ``pass_name`` (the latest stage up to it that
    changed the graph), concatenated."""
    from rubin_compile.passes import PASS_NAMES

    last = PASS_NAMES.index(pass_name) + 1
    out = []
    for d in sorted(p for p in dump_dir.iterdir() if p.is_dir()):
        stages = [p for p in sorted(d.glob("[0-9][0-9]-*.py")) if int(p.name[:2]) <= last]
        out.append(stages[-1].read_text())
    return "\n".join(out)


def seeded_random(request: pytest.FixtureRequest) -> random.Random:
    """A ``random.Random`` seeded from the requesting test's or module's id (for module-scoped fixtures, which the
    per-test torch seed below does not reach): the same data on every run, different data per module."""
    return random.Random(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _seed_from_test_id(request: pytest.FixtureRequest) -> None:
    """Every test draws different random data from every other, and the same data on every run: a failure in CI
    reproduces locally by running the same test id (the seed is the CRC-32 of the test id)."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def rubin_run(tmp_path: Path) -> RubinRun:
    return RubinRun(tmp_path / "dumps")


def count_ops(code: str, name: str) -> int:
    """How many calls of ``torch.ops.<name>`` a dumped graph makes (e.g. "rubin.moe", "aten.mm")."""
    return code.count(f"torch.ops.{name}.")


def assert_close_to_eager(actual: torch.Tensor, expected: torch.Tensor, dtype: Optional[torch.dtype] = None) -> None:
    """Compiled vs eager, tolerance by dtype: fp32 1e-4 relative to the output's scale; bf16 / fp16 2e-2."""
    dtype = dtype or expected.dtype
    tol = {torch.float32: 1e-4, torch.float64: 1e-9, torch.bfloat16: 2e-2, torch.float16: 5e-3}[dtype]
    scale = expected.abs().max().item() or 1.0
    err = (actual.float() - expected.float()).abs().max().item()
    assert torch.isfinite(actual).all(), "compiled output has NaN / inf"
    assert err <= tol * scale, f"max |compiled - eager| = {err:.3g}, allowed {tol * scale:.3g} ({dtype})"


def _cpu_rowwise_scaled_mm() -> bool:
    """torch 2.13's CPU _scaled_mm takes row-wise scales; torch 2.11's asserts per-tensor only."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


ROWWISE_SKIP = pytest.mark.skipif(
    not _cpu_rowwise_scaled_mm(), reason=f"torch {torch.__version__}'s CPU _scaled_mm has no row-wise scales"
)


def block_inputs(model: torch.nn.Module, blocks: list, *args: Any) -> list[torch.Tensor]:
    """The hidden states each module of ``blocks`` receives when ``model(*args)`` runs eagerly."""
    seen: list[torch.Tensor] = []
    hooks = [b.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone())) for b in blocks]
    try:
        with torch.no_grad():
            model(*args)
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == len(blocks), "every block runs once per forward"
    return seen


def assert_moe_blocks_close(blocks: list, inputs: list, dtype: torch.dtype, **options: Any) -> None:
    """Each MoE block compiled with rubin (``options``), against the same block compiled by Inductor alone, on the
    same input. The same input and the same router code (Inductor's, in both) give both the same routing, so
    every token is bounded by the dtype's tolerance (``assert_close_to_eager``): no near-tie in a router can send
    a token to another expert in one of them only, as it can across a whole bf16 model. Checks that rubin
    rewrote every block into rubin.moe, too."""
    for block, x in zip(blocks, inputs):
        run = RubinRun(Path(tempfile.mkdtemp(prefix="rubin-block-")))
        with torch.no_grad():
            got = run.compile(block, **options)(x)
            torch._dynamo.reset()
            want = torch.compile(block, backend="inductor")(x)
        got, want = (y[0] if isinstance(y, tuple) else y for y in (got, want))
        assert_close_to_eager(got, want, dtype)
        assert [r for r in run.rewrites() if r["canonical_op"] == "rubin.moe"], run.unchanged()
