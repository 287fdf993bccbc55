"""``python -m rubin_compile explain DIR``: per graph, what was matched, from which idiom, into what."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, TextIO

from rubin_compile.debug.report import render_markdown


class ExplainError(ValueError):
    """The folder given to ``explain`` holds no rubin dump."""


def find_reports(root: Path) -> list[Path]:
    """report.json files under ``root`` (a dump folder, or one graph's folder), in graph order."""
    if (root / "report.json").is_file():
        return [root / "report.json"]
    return sorted(root.glob("*/report.json"))


def shown_when_changed(p: dict) -> bool:
    """``--changed`` keeps a pass that rewrote, left something unchanged, chose kernels or decided a
    launch / placement."""
    return bool(p["rewrites"] or p["unchanged"] or p.get("plans") or p.get("decisions"))


def explain(root: str, out: TextIO, only_changed: bool = False, graph: Optional[str] = None) -> int:
    """Print the report tables of every graph dumped under ``root``; return how many graphs were shown."""
    path = Path(root)
    if not path.is_dir():
        raise ExplainError(f"{root}: no such folder; pass the dump folder given as RUBIN_DUMP_DIR / dump_dir")
    reports = find_reports(path)
    if not reports:
        raise ExplainError(
            f"{root}: no rubin dump here (no */report.json). Set RUBIN_DUMP_DIR={root} or "
            "options={'dump_dir': ...} and compile again; a compile-cache hit writes no dump."
        )
    loaded = [json.loads(p.read_text()) for p in reports]
    if graph is not None and graph not in {r["graph_id"] for r in loaded}:
        raise ExplainError(f"{root}: no graph {graph!r}; the graphs dumped here are {[r['graph_id'] for r in loaded]}")
    shown = 0
    for report in loaded:
        if graph is not None and report["graph_id"] != graph:
            continue
        if only_changed and not any(shown_when_changed(p) for p in report["passes"]):
            continue
        if only_changed:
            report = {**report, "passes": [p for p in report["passes"] if shown_when_changed(p)]}
        out.write(render_markdown(report) + "\n")
        shown += 1
    total = sum(len(p["rewrites"]) for r in loaded for p in r["passes"])
    out.write(f"{len(reports)} graph(s) in {root}; {total} rewrite(s) in all\n")
    return shown
