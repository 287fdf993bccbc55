"""inline_kernels on the GPU: the Triton launches traced into the graph are compiled and launched by Inductor, give
bitwise the op call's results (the same kernels with the same configuration), leave no rubin op call in the
generated code, and cost less host time per call than the op calls (the reason the pass exists)."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

pytest.importorskip("triton")
from torch._inductor.utils import run_and_get_code  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

E, H, I, K = 128, 2048, 768, 8  # Qwen3-30B-A3B's MoE
HQ, HKV, D = 32, 4, 128


class DecodeLayer(torch.nn.Module):
    """One decode step's rubin ops at Qwen3-30B-A3B sizes: attention over a static cache with a bool mask, the
    routing and the MoE, each written as the canonical op (selection binds our Triton kernels on sm_90)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.router = torch.nn.Parameter(torch.randn(E, H, generator=g) * 0.02)
        self.w13 = torch.nn.Parameter(torch.randn(E, 2 * I, H, generator=g) * 0.02)
        self.w2 = torch.nn.Parameter(torch.randn(E, H, I, generator=g) * 0.02)

    def forward(self, x, q, k, v, mask):
        attn = torch.ops.rubin.attention(q, k, v, mask)
        tw, ids = torch.ops.rubin.route(x, self.router, K, renormalize=True)
        y = torch.ops.rubin.moe(x, self.w13, self.w2, tw, ids, "silu")
        return attn, y, tw, ids


def _inputs(context=4232, filled=4096):
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, H, generator=g, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, HQ, 1, D, generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, HKV, context, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, HKV, context, D, generator=g, device="cuda", dtype=torch.bfloat16)
    mask = torch.zeros(1, 1, 1, context, dtype=torch.bool, device="cuda")
    mask[..., :filled] = True
    return x, q, k, v, mask


def _compiled(model, mode, dump_dir=None):
    options = {"inline_kernels": mode, **({"dump_dir": str(dump_dir)} if dump_dir else {})}
    return torch.compile(model, backend="rubin", options=options, dynamic=False)


def _fused_decode_config():
    from rubin_compile.kernels.triton import moe

    G = moe.GemmConfig
    return moe.MoEConfig(
        mode="fused",
        fc1=G(BM=16, BN=32, BK=128, num_stages=4, occupancy=2, split_k=2),
        fc2=G(BM=16, BN=32, BK=128, num_stages=4, occupancy=2, split_k=4),
    )


@pytest.mark.parametrize("moe_path", ["two_kernels", "fused"])
@torch.inference_mode()
def test_traced_launches_equal_the_op_calls_and_leave_no_op_call(tmp_path, moe_path, monkeypatch):
    """The MoE in the slot-mode kernels (FC1, FC2) and in the fused decode kernel (moe_decode.py, whose traced form
    zeroes a workspace of its own per call), whichever the tuned table holds, each forced here."""
    from rubin_compile.kernels.triton import moe

    T = 1
    if moe_path == "fused":
        monkeypatch.setattr(moe, "_tuned_config", lambda *a, **kw: _fused_decode_config())
        moe_kernels = ("_moe_decode_kernel",)
    else:
        slot = moe.heuristic_config(T, E, H, I, K, torch.bfloat16, None)
        monkeypatch.setattr(moe, "_tuned_config", lambda *a, **kw: slot)
        moe_kernels = ("_moe_fc1_kernel", "_moe_fc2_kernel")
    torch._dynamo.reset()
    model = DecodeLayer().cuda().to(torch.bfloat16)
    inputs = _inputs()
    called = _compiled(model, "off")(*inputs)
    torch._dynamo.reset()
    traced, codes = run_and_get_code(_compiled(model, "auto", tmp_path), *inputs)
    code = "\n".join(codes)
    for name in ("rubin.attention", "rubin.route", "rubin.moe"):
        assert f"torch.ops.{name}" not in code, f"{name} is still called in Inductor's code"
    for kernel in ("_split_kv", "_router_logits_kernel", "_route_topk_kernel", *moe_kernels):
        assert kernel in code, f"{kernel} is not launched from Inductor's code"
    for a, b in zip(called, traced):
        assert torch.equal(a, b)
    report = next(tmp_path.rglob("report.md")).read_text()
    assert "## inline_kernels" in report and "in graph" in report


@torch.inference_mode()
def test_traced_launches_cost_less_host_time_than_op_calls():
    model = DecodeLayer().cuda().to(torch.bfloat16)
    inputs = _inputs()

    def host_us(fn, reps=200):
        for _ in range(10):
            fn(*inputs)
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(*inputs)
            times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        return statistics.median(times) * 1e6

    torch._dynamo.reset()
    call = host_us(_compiled(model, "off"))
    torch._dynamo.reset()
    inline = host_us(_compiled(model, "auto"))
    print(f"host us per call: op calls {call:.0f}, traced launches {inline:.0f}")
    assert inline < call, f"traced launches cost {inline:.0f} us of host time per call, op calls {call:.0f}"
