"""On an H200 with FlashInfer installed, a model compiled with ``backend="rubin"`` runs the FlashInfer kernels its plan
chose -- FA3 for prefill attention, DeepGEMM for FP8 block-quantised linears at prefill sizes -- and its logits stay
within the stated tolerance of the same model run eagerly (examples/standalone_moe.py's model, head dim 128, its
projections and experts stored as 128 x 128 block FP8 and dequantised in the forward with rubin.dequantize)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("flashinfer")

from rubin_compile.kernels.flashinfer import adapter as fa  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "standalone_moe.py"
needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="FA3 and DeepGEMM run on sm_90 (the H200)",
)


def _example():
    spec = importlib.util.spec_from_file_location("standalone_moe_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_sm90
def test_compiled_model_runs_the_flashinfer_kernels_it_planned(tmp_path, monkeypatch):
    ex = _example()
    torch.manual_seed(0)
    model = ex.TinyMoEModel(vocab=512, hidden=512, heads=4, inter=128, experts=8, k=2).to(torch.bfloat16).cuda().eval()
    tokens = torch.randint(0, 512, (2, 80), device="cuda")  # M = 160 > 64: DeepGEMM's measured range
    model = ex.quantize_model(model, "fp8_block", tokens)
    with torch.no_grad():
        want = model(tokens).float()
    ran: list[str] = []
    real_run = fa.run

    def counting(adapter, args, launch):
        ran.append(adapter.name)
        return real_run(adapter, args, launch)

    monkeypatch.setattr(fa, "run", counting)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="rubin", options={"dump_dir": str(tmp_path)})
    with torch.no_grad():
        got = compiled(tokens).float()
    plans = json.dumps([json.loads(p.read_text()) for p in sorted(tmp_path.glob("*/report.json"))])
    assert "flashinfer_fa3" in plans and "flashinfer_deepgemm" in plans, "the plan chose no FA3 / DeepGEMM"
    assert "flashinfer_fa3.single_prefill" in ran and "fp8_blockscale_gemm_sm90" in ran, sorted(set(ran))
    # DeepGEMM quantises the bf16 activations to FP8 per 1 x 128 group (its stated tolerance, ops/gemm.py's weight-only
    # semantics keeps them bf16); over two layers the logits stay within 5% of their norm
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 5e-2, rel
