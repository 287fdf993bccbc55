"""A Hugging Face MoE model compiled with backend="rubin" on the GPU: every MoE block runs our Triton
kernel, matmuls and attention run the kernels select_kernels chose for this machine, logits match eager."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_logits_close
from tests.cpu.passes.match_moe.test_hf_grouped_mm import qwen3_moe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.skipif(
    torch.cuda.get_device_capability() != (9, 0) if torch.cuda.is_available() else True,
    reason="the sm_90 row of docs/kernels/selection.md",
)
def test_qwen3_moe_bf16_on_sm90(rubin_run):
    torch.manual_seed(0)
    model = qwen3_moe().to("cuda", torch.bfloat16).eval()
    tokens = torch.randint(0, model.config.vocab_size, (2, 24), device="cuda")
    with torch.no_grad():
        got = rubin_run.compile(model)(tokens).logits
        want = model(tokens).logits
    assert_logits_close(got, want, torch.bfloat16)
    plans = [
        pl for rep in rubin_run.reports() for p in rep["passes"] if p["name"] == "select_kernels" for pl in p["plans"]
    ]
    by_op: dict[str, set] = {}
    for pl in plans:
        by_op.setdefault(pl["canonical_op"], set()).add(pl["impl"])
    assert by_op["rubin.moe"] == {"triton@sm90"}
    assert len([pl for pl in plans if pl["canonical_op"] == "rubin.moe"]) == model.config.num_hidden_layers
    # what runs here: never a kernel without an adapter (FlashInfer attention is rejected with its reason)
    assert by_op.get("rubin.attention", {"torch@sm90"}) == {"torch@sm90"}
    assert by_op.get("rubin.gemm", {"torch@sm90"}) <= {"torch@sm90"}
