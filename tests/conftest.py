"""Shared test helpers: compile with the rubin backend and read back what the pipeline did."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch

import rubin_compile  # noqa: F401  (registers the ops and the backend)


class RubinRun:
    """A model compiled with ``backend="rubin"`` into a fresh dump folder, and the reports it wrote."""

    def __init__(self, dump_dir: Path) -> None:
        self.dump_dir = dump_dir

    def compile(self, model: Callable, **options: Any) -> Callable:
        torch._dynamo.reset()
        return torch.compile(model, backend="rubin", options={"dump_dir": str(self.dump_dir), **options})

    def reports(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.dump_dir.glob("*/report.json"))]

    def rewrites(self, pass_name: str = "match_moe") -> list[dict]:
        return [r for rep in self.reports() for p in rep["passes"] if p["name"] == pass_name for r in p["rewrites"]]

    def unchanged(self, pass_name: str = "match_moe") -> list[dict]:
        return [u for rep in self.reports() for p in rep["passes"] if p["name"] == pass_name for u in p["unchanged"]]

    def final_code(self) -> str:
        """The code of every dumped graph after the last stage that changed it, concatenated."""
        out = []
        for d in sorted(self.dump_dir.iterdir()):
            stages = sorted(d.glob("[0-9][0-9]-*.py"))
            out.append(stages[-1].read_text())
        return "\n".join(out)


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
