"""The README's example runs as documented: numerics on the CPU, and a Rubin plan made on the CPU."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args, **env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RUBIN_")}
    out = subprocess.run(
        [sys.executable, "examples/standalone_moe.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**environ, **env},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_standalone_example_prints_the_rewrite_table(tmp_path):
    text = _run("--dump-dir", str(tmp_path))
    diff = float(text.split("max |diff| = ")[1].split()[0])
    assert diff < 1e-4
    assert text.count("| rubin.moe | expert loop |") == 2


def test_standalone_example_plans_for_rubin_on_a_cpu(tmp_path):
    text = _run("--dump-dir", str(tmp_path), "--dtype", "bfloat16", RUBIN_TARGET="sm107")
    assert "the plan cannot run on this machine" in text and "compiled for target sm107" in text
    assert "target: sm107 (Rubin)" in text
