"""Graph dumps: one folder per compiled graph under the dump directory (docs/architecture.md, "Dumps")::

DIR/<graph-id>/00-input.py        the graph as received
DIR/<graph-id>/NN-<pass>.py       after each pass that changed something
DIR/<graph-id>/NN-<pass>.diff     unified diff against the previous stage
DIR/<graph-id>/report.json        machine-readable report
DIR/<graph-id>/report.md          the same for people
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from rubin_compile.debug.report import render_markdown


def graph_code(graph: torch.fx.Graph) -> str:
    """Readable Python for a graph, with each value's dtype and shape, as ``print_readable`` shows it."""
    return graph.python_code(root_module="self", verbose=True).src.lstrip("\n")


@dataclass
class GraphDump:
    """The dump folder of one graph."""

    path: Path

    @property
    def graph_id(self) -> str:
        return self.path.name

    @classmethod
    def create(cls, root: str, compile_id: str) -> "GraphDump":
        """A new folder ``gNNN-<compile id>`` under ``root``; NNN counts the graphs dumped there so far,
        so several graphs of one compile (vLLM's piecewise subgraphs) and several processes never collide."""
        base = Path(root)
        base.mkdir(parents=True, exist_ok=True)
        n = sum(1 for p in base.iterdir() if p.is_dir())
        while True:
            path = base / f"g{n:03d}-{compile_id}"
            try:
                path.mkdir()
                return cls(path)
            except FileExistsError:
                n += 1

    def write_stage(self, index: int, name: str, code: str, previous: Optional[str]) -> None:
        stem = f"{index:02d}-{name}"
        (self.path / f"{stem}.py").write_text(code)
        if previous is not None:
            diff = difflib.unified_diff(
                previous.splitlines(keepends=True),
                code.splitlines(keepends=True),
                fromfile="before",
                tofile=f"after {name}",
            )
            (self.path / f"{stem}.diff").write_text("".join(diff))

    def write_report(self, report: dict[str, Any]) -> None:
        tmp = self.path / "report.json.tmp"
        tmp.write_text(json.dumps(report, indent=1, default=str))
        os.replace(tmp, self.path / "report.json")
        (self.path / "report.md").write_text(render_markdown(report))
