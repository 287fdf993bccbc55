"""A Hugging Face MoE model compiled with backend="rubin" on the GPU: every MoE block runs our Triton
kernel, matmuls and attention run the kernels select_kernels chose for this machine, and every token's logits
match Inductor's compile of the same model (tests/conftest.py says why not eager, and how routing is kept
identical)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_close_to_eager, assert_moe_blocks_close, block_inputs
from tests.cpu.passes.match_moe.test_hf_grouped_mm import qwen3_moe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.skipif(
    torch.cuda.get_device_capability() != (9, 0) if torch.cuda.is_available() else True,
    reason="the sm_90 row of docs/kernels/selection.md",
)
def test_qwen3_moe_bf16_on_sm90(rubin_run):
    torch.manual_seed(0)
    # the whole model with every token routed to every expert (no near-tie can route a token differently in the
    # two runs), against Inductor alone: every token bounded
    model = qwen3_moe(num_experts_per_tok=8).to("cuda", torch.bfloat16).eval()
    tokens = torch.randint(0, model.config.vocab_size, (2, 24), device="cuda")
    with torch.no_grad():
        got = rubin_run.compile(model)(tokens).logits
        torch._dynamo.reset()
        want = torch.compile(model, backend="inductor")(tokens).logits
    assert_close_to_eager(got, want, torch.bfloat16)
    # the family's own top-4 routing, block by block on the hidden states each block sees eagerly
    routed = qwen3_moe().to("cuda", torch.bfloat16).eval()
    blocks = [layer.mlp for layer in routed.model.layers]
    assert_moe_blocks_close(blocks, block_inputs(routed, blocks, tokens), torch.bfloat16)
    plans = rubin_run.plans()
    by_op: dict[str, set] = {}
    for pl in plans:
        by_op.setdefault(pl["canonical_op"], set()).add(pl["impl"])
    assert by_op["rubin.moe"] == {"triton@sm90"}
    assert len([pl for pl in plans if pl["canonical_op"] == "rubin.moe"]) == model.config.num_hidden_layers
    # what runs here: never a kernel without an adapter (FlashInfer attention is rejected with its reason)
    assert by_op.get("rubin.attention", {"torch@sm90"}) == {"torch@sm90"}
    assert by_op.get("rubin.gemm", {"torch@sm90"}) <= {"torch@sm90"}
