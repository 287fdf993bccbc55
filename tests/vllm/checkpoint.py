"""A tiny Qwen3-MoE checkpoint with random, non-trivial weights, saved as safetensors for vLLM to load."""

from __future__ import annotations

from pathlib import Path

import torch

QWEN3_MOE = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    # 0.1 (transformers' default is 0.02) so that every layer, experts included, moves the logits.
    initializer_range=0.1,
)


def save_qwen3_moe(folder: Path, seed: int) -> Path:
    """Build a 2-layer Qwen3-MoE (hidden 256, 8 experts, top-2) from a seed; save it (fp32 safetensors)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**QWEN3_MOE)
    config.architectures = ["Qwen3MoeForCausalLM"]
    model = Qwen3MoeForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return Path(folder)
