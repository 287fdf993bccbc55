"""The README's vLLM example runs as documented and exits 0 (before: it exited with explain's graph count)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def test_vllm_example_serves_and_prints_the_rewrite_table(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUBIN_")}
    out = subprocess.run(
        [sys.executable, "examples/vllm_qwen3_moe.py", "--dump-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count("greedy tokens") == 2
    assert "| rubin.moe | vllm _C.cpu_fused_moe |" in out.stdout
