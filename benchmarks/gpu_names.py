"""The GPU's word in the benchmarks' output file names: ``moe-h200.md`` on an H200, ``moe-h100-80gb-hbm3.md`` on an
H100 SXM, ``...-cpu`` where no GPU is visible (dry runs). (Until 2026-12-05 every benchmark wrote ``*-h200.*`` on any
GPU.) The step scripts of benchmarks/h200/ read the files by pattern, so they find them on any GPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch


def gpu_slug(name: Optional[str] = None) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3', 'NVIDIA H200' -> 'h200'; without a name, this process's GPU."""
    if name is None:
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    words = name.lower().replace("nvidia", " ").replace("/", " ").split()
    return "-".join(words) or "gpu"


def write_results(out: Path, stem: str, text: str, payload: dict) -> None:
    """A benchmark's table and its data under ``out`` (made if missing), named by this process's GPU:
    ``<stem>-<gpu>.md`` (``text``) and ``<stem>-<gpu>.json`` (``payload``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}-{gpu_slug()}.md").write_text(text + "\n")
    (out / f"{stem}-{gpu_slug()}.json").write_text(json.dumps(payload, indent=1))
