"""The fused-MoE kernels compiled ahead of time for sm_90 on a machine without a GPU (Triton's own ptxas):
every option of the decode path compiles, and the PTX holds what the design says it does (one
griddepcontrol.wait; launch_dependents also right after it with early_launch; the L2 prefetch instruction
where w2 -> L2 or FC2's prefetch is on; wgmma for swapped tiles). Catches a kernel that would fail to
compile on the H200 before a GPU session is spent on it; what it does not check -- numerics and speed --
tests/gpu does on the GPU."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="needs the triton package")
compiler = pytest.importorskip("triton.compiler")
backend = pytest.importorskip("triton.backends.compiler")
if not hasattr(compiler, "ASTSource") or not hasattr(backend, "GPUTarget"):
    pytest.skip("this Triton has no ASTSource / GPUTarget AOT API", allow_module_level=True)

MOE = Path(__file__).resolve().parents[3] / "rubin_compile" / "kernels" / "triton" / "moe.py"
BF = "*bf16"


@pytest.fixture(scope="module")
def kernels():
    """kernels/triton/moe.py loaded as a plain module (the package refuses to import without CUDA)."""
    spec = importlib.util.spec_from_file_location("rubin_moe_aot", MOE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["rubin_moe_aot"] = mod
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules["rubin_moe_aot"]


def compile_sm90(fn, constexprs: dict, pointers: dict, num_stages: int = 4) -> str:
    params = inspect.signature(fn.fn).parameters
    sig = {p: "constexpr" if p in constexprs else pointers.get(p, "i32") for p in params}
    src = compiler.ASTSource(fn, sig, constexprs=constexprs)
    k = triton.compile(src, target=backend.GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": num_stages})
    return k.asm["ptx"]


FC1_PTRS = {"x_ptr": BF, "w_ptr": BF, "b_ptr": BF, "w2_ptr": BF, "ws_ptr": "*fp32", "ids_ptr": "*i64",
            "sorted_ptr": "*i32", "gexp_ptr": "*i32", "gstart_ptr": "*i32", "gcount_ptr": "*i32", "cnt_ptr": "*i32"}
FC1 = dict(ACT=0, HAS_BIAS=False, W_SCALE=0, A_FP8=False, DOT_PREC="tf32", ROUTE=0, SLOT_P2=64, BM=16, BN=32, BK=128,
           EVEN_K=True, GDC=True, PREFETCH=0, PF_CHUNK=16, SWAP=False, SPLIT=1, EARLY=False, W2_L2=0, W2_CHUNK=16)
FC2_PTRS = {"w_ptr": BF, "b_ptr": BF, "part_ptr": BF, "out_ptr": BF, "ws_ptr": "*fp32", "ids_ptr": "*i64",
            "tw_ptr": "*fp32", "sorted_ptr": "*i32", "gexp_ptr": "*i32", "gstart_ptr": "*i32", "gcount_ptr": "*i32",
            "cnt_ptr": "*i32"}
FC2 = dict(HAS_BIAS=False, W_SCALE=0, A_FP8=False, DOT_PREC="tf32", ROUTE=0, SLOT_P2=64, BM=16, BN=64, BK=128,
           EVEN_K=True, GDC=True, PREFETCH=0, PF_CHUNK=16, FUSED_SUM=True, SWAP=False, SPLIT1=1, ACT=0)


@pytest.mark.parametrize("over,split", [
    ({}, 1),
    ({"SPLIT": 4, "HAS_BIAS": True, "ACT": 1}, 4),
    ({"SPLIT": 2, "SWAP": True, "BN": 64, "BK": 64, "ROUTE": 1}, 2),
    ({"W2_L2": 16 * 128 * 96, "W2_CHUNK": 16 * 96, "EARLY": True}, 1),
    ({"SPLIT": 2, "W2_L2": 16 * 128 * 48, "W2_CHUNK": 16 * 48, "EARLY": True, "ROUTE": 1}, 2),
], ids=["plain", "split4-bias-gelu", "split2-swap-grouped", "w2l2-early", "split2-w2l2-early-grouped"])
def test_fc1_variants_compile_for_sm90(kernels, over, split):
    ptx = compile_sm90(kernels._moe_fc1_kernel, dict(FC1, **over), dict(FC1_PTRS, inter_ptr="*fp32" if split > 1 else BF))
    assert ptx.count("griddepcontrol.wait") == 1
    assert ptx.count("griddepcontrol.launch_dependents") == (2 if over.get("EARLY") else 1)
    assert ptx.count("cp.async.bulk.prefetch.L2") == (1 if over.get("W2_L2") else 0)
    assert ("wgmma.mma_async" in ptx) == bool(over.get("SWAP"))


@pytest.mark.parametrize("over,stages", [
    ({}, 4), ({"SPLIT1": 4}, 4), ({"SPLIT1": 2, "SWAP": True, "ACT": 1}, 4), ({"SPLIT1": 8}, 2),
    ({"PREFETCH": 131072, "PF_CHUNK": 1024}, 4),
], ids=["plain", "split4", "split2-swap-gelu", "split8-2-stages", "prefetch"])
def test_fc2_variants_compile_for_sm90(kernels, over, stages):
    ptx = compile_sm90(kernels._moe_fc2_kernel, dict(FC2, **over),
                       dict(FC2_PTRS, a_ptr="*fp32" if over.get("SPLIT1", 1) > 1 else BF), num_stages=stages)
    assert ptx.count("griddepcontrol.wait") == 1 and ptx.count("griddepcontrol.launch_dependents") == 1
    assert ptx.count("cp.async.bulk.prefetch.L2") == (1 if over.get("PREFETCH") else 0)
