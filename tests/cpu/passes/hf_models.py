"""Tiny Hugging Face decoders compiled once per test session with ``backend="rubin"``, for the attention and
GEMM matcher tests (test_match_attention.py, test_match_gemm.py read the same run: one compile per model and
dtype instead of one per test file).

Random weights, nothing downloaded. ``run(family, dtype)`` compiles the model into a fresh dump folder, runs
it on two fresh random token batches beside the reference, and keeps the outputs and the dumps. The reference
is eager transformers in fp32 and the model compiled by Inductor alone in bf16 (Inductor's own bf16 roundings
move outputs by up to 2.3% of their scale from eager); the MoE layer routes every token to every expert, so no
rounding near-tie can route a token differently in the two runs and every token is compared
(``assert_close_to_eager``).
"""

from __future__ import annotations

import functools
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.conftest import assert_close_to_eager, stage_code  # noqa: F401  (assert_close_to_eager: used through this module)

HIDDEN, VOCAB, LAYERS = 64, 128, 2
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.1,
    use_cache=False,
)


def qwen3_moe():
    """Qwen3-MoE: layer 0 MoE (router + grouped-mm experts), layer 1 dense (gate / up / down projections);
    separate q / k / v / o projections, GQA 4 / 2 heads through SDPA."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        **COMMON,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=8,  # every token to every expert: see the module docstring
        norm_topk_prob=True,
        mlp_only_layers=[1],
    )
    return transformers.Qwen3MoeForCausalLM(cfg)


def phi3():
    """Phi-3: a fused qkv_proj and a fused gate_up_proj split by ``chunk(2)`` (``up * silu(gate)``)."""
    import transformers

    cfg = transformers.Phi3Config(**COMMON, intermediate_size=96, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    return transformers.Phi3ForCausalLM(cfg)


FAMILIES = {"qwen3_moe": qwen3_moe, "phi3": phi3}


@dataclass
class HFRun:
    family: str
    dtype: torch.dtype
    dump_dir: Path
    outputs: list  # (compiled logits, eager logits) per fresh batch

    def reports(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.dump_dir.glob("*/report.json"))]

    def result(self, pass_name: str) -> dict:
        (report,) = self.reports()  # the whole model is one graph
        return next(p for p in report["passes"] if p["name"] == pass_name)

    def input_code(self) -> str:
        return "\n".join(p.read_text() for p in sorted(self.dump_dir.glob("*/00-input.py")))

    def stage_code(self, pass_name: str) -> str:
        """The graph after ``pass_name`` (or the latest stage before it that changed the graph)."""
        (d,) = [d for d in self.dump_dir.iterdir() if d.is_dir()]  # the whole model is one graph
        return stage_code(self.dump_dir, pass_name)


@functools.lru_cache(maxsize=None)
def run(family: str, dtype: torch.dtype) -> HFRun:
    torch._dynamo.reset()
    model = FAMILIES[family]().to(dtype).eval()
    dump_dir = Path(tempfile.mkdtemp(prefix=f"rubin-{family}-")) / "dumps"
    compiled = torch.compile(model, backend="rubin", options={"dump_dir": str(dump_dir)})
    batches = [torch.randint(0, VOCAB, (2, 8)) for _ in range(2)]  # fresh tokens each check; one shape, one compile
    with torch.no_grad():
        got = [compiled(ids).logits for ids in batches]
        reference = model
        if dtype != torch.float32:
            torch._dynamo.reset()
            reference = torch.compile(model, backend="inductor")
        outputs = [(g, reference(ids).logits) for g, ids in zip(got, batches)]
    return HFRun(family, dtype, dump_dir, outputs)
