"""generate() with a static cache under rubin on real transformers code, family by family
(rubin_compile/debug/generate_families.py; the whole table: docs/generate-families.md).

A few families that cover the forms rubin meets in a decode step: SDPA over the static cache with GQA (Qwen3-MoE,
Llama), sliding-window layers (Gemma 3), DeepSeek-V3's multi-head latent attention and grouped routing, Mixtral's
experts, and GPT-OSS's eager attention with sinks (written out as ops, rewritten with ``sinks`` over the cache
buffers). Each generates greedily in fp32:
the ids must be eager's, the decode step must compile once, and the decode graph's report must say what it did.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from rubin_compile.debug import generate_families  # noqa: E402

SDPA_OVER_THE_CACHE = "rewritten: 1, static cache read by 1"
CASES = {
    # model type: (kind, the decode graph's attention, its MoE)
    "qwen3_moe": ("moe", SDPA_OVER_THE_CACHE, "rewritten: 1"),
    # transformers 5.19 and 5.25's DeepSeek-V3 attends over keys / values computed from the cache each step (the
    # rotary part joined per head, the values padded): the rewrite reads those, not the cache buffers (5.4's reads
    # the buffers); either way the attention is rewritten
    "deepseek_v3": ("moe", "rewritten: 1, static cache read by ", "rewritten: 1"),
    "mixtral": ("moe", SDPA_OVER_THE_CACHE, "rewritten: 1"),
    "gpt_oss": ("moe", SDPA_OVER_THE_CACHE, "rewritten: 1"),
    "llama": ("dense", SDPA_OVER_THE_CACHE, "-"),
    "gemma3_text": ("dense", SDPA_OVER_THE_CACHE, "-"),
}


@pytest.mark.parametrize("model_type", list(CASES))
def test_generate_equals_eager_and_the_decode_graph_is_rewritten(model_type):
    kind, attention, moe = CASES[model_type]
    row = generate_families.survey_one(model_type, model_type, kind)
    assert row.status == "ids equal eager's" and row.equal, row
    assert row.graphs == 2, f"{model_type}: {row.graphs} graphs compiled (prefill + decode is 2): it recompiled"
    assert row.attention.startswith(attention), row.attention
    assert row.moe == moe, row.moe
    if model_type == "gpt_oss":
        assert row.attention.endswith(", 1 written out as ops (1 with attention sinks)"), row.attention


def test_the_table_names_every_family_once():
    rows = [
        generate_families.Row("a", "moe", "ACausalLM", "ids equal eager's", True, 2, "x | y", "rewritten: 1"),
        generate_families.Row("b", "dense", status="eager failed: KeyError"),
    ]
    text = generate_families.render(rows)
    assert "Families: 2; generated under rubin: 1; ids equal eager's: 1." in text
    assert "| `a` | moe | ACausalLM | 2 | x \\| y | rewritten: 1 | ids equal eager's |" in text
    assert "| `b` | dense | - | - | - | - | eager failed: KeyError |" in text
