"""The reports of the README's example model stay what they were: the CPU run, and the sm_90 / sm_107 plans.

A refactor must not change what rubin decides. This compiles ``examples/standalone_moe.py``'s model for each
configuration below and compares every report.md with the one committed under ``golden_reports/`` (timings and
the dump folder's path masked). The files were written by this test on the code before the structural step
(commit f548027); after a change that *means* to alter a report, regenerate them and review the diff:

    REGENERATE_GOLDEN_REPORTS=1 python -m pytest tests/cpu/test_reports_unchanged.py
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("golden_reports")
sys.path.insert(0, str(ROOT / "examples"))
from standalone_moe import TinyMoEModel  # noqa: E402

# name -> (dtype, token batch shape, model sizes, options): the CPU run, and plans made on this CPU for GPUs
# it does not have; the last two are decode-sized (8 tokens, experts wide enough to split over two domains),
# where PDL and the locality placement decide something.
WIDE = {"hidden": 256, "inter": 256}
CASES = {
    "cpu-float32": (torch.float32, (2, 16), {}, {}),
    "sm90-bfloat16": (torch.bfloat16, (2, 16), {}, {"target": "sm90"}),
    "sm107-bfloat16": (torch.bfloat16, (2, 16), {}, {"target": "sm107"}),
    "sm90-bfloat16-decode-cudagraphs-backfill": (
        torch.bfloat16,
        (8, 1),
        WIDE,
        {"target": "sm90", "cudagraphs": True, "locality": "backfill"},
    ),
    "sm107-bfloat16-decode-cudagraphs-triton": (
        torch.bfloat16,
        (8, 1),
        WIDE,
        {"target": "sm107", "cudagraphs": True, "kernels": {"moe": "triton"}},
    ),
}


def normalise(text: str, dump_dir: Path) -> str:
    text = text.replace(str(dump_dir), "<dump_dir>")
    return re.sub(r"\d+\.\d ms", "<t> ms", text)


def reports_of(case: str, tmp_path: Path) -> dict[str, str]:
    dtype, shape, sizes, options = CASES[case]
    dump_dir = tmp_path / case
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyMoEModel(**sizes).to(dtype).eval()
    compiled = torch.compile(model, backend="rubin", options={"dump_dir": str(dump_dir), **options})
    with torch.no_grad():
        try:
            compiled(torch.randint(0, 512, shape))
        except Exception as exc:  # a plan for a GPU this machine lacks is written, then refuses to run
            assert "target" in options and "cannot run on this machine" in str(exc), exc
    return {p.parent.name: normalise(p.read_text(), dump_dir) for p in sorted(dump_dir.glob("*/report.md"))}


@pytest.mark.parametrize("case", sorted(CASES))
def test_report_unchanged(case, tmp_path, monkeypatch):
    for key in [k for k in os.environ if k.startswith("RUBIN_")]:
        monkeypatch.delenv(key)
    got = reports_of(case, tmp_path)
    assert got, "no report was written"
    folder = GOLDEN / case
    if os.environ.get("REGENERATE_GOLDEN_REPORTS") == "1":
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.md"):
            old.unlink()
        for graph, text in got.items():
            (folder / f"{graph}.md").write_text(text)
    want = {p.stem: p.read_text() for p in sorted(folder.glob("*.md"))}
    assert sorted(got) == sorted(want)
    for graph in want:
        assert got[graph] == want[graph], f"{case}/{graph}: report.md changed"
