"""docs/models.md, the table of transformers' MoE families and what rubin does with each, is what the survey writes
today: ``rubin_compile.debug.moe_families`` runs here (every family's tiny model compiled with rubin, in two
processes: about 5 minutes on two cores) and its markdown must equal the committed file. When rubin or transformers
changes what the table says, regenerate it and review the diff:

    python -m rubin_compile.debug.moe_families --write docs/models.md

The table depends on the versions of transformers, torch and vLLM (its registry, for the vLLM column) recorded in
its header; with others installed, the comparison is skipped and the survey's own checks still run.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

from rubin_compile.debug import moe_families  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"
REGENERATE = "python -m rubin_compile.debug.moe_families --write docs/models.md"


@pytest.fixture(scope="module")
def survey() -> dict:
    return moe_families.survey(jobs=min(2, os.cpu_count() or 1))


def _base(version: str) -> str:
    return version.split("+")[0]


def test_the_survey_finds_the_families_and_rewrites_them_exactly(survey):
    rows = {r.model_type: r for r in survey["rows"]}
    summary = moe_families.summary(survey)
    assert summary["found"] >= 40, summary
    assert summary["built"] >= 0.9 * summary["found"], [r.status for r in rows.values() if r.kind == "failed to build"]
    # a compile that raises is a rubin crash (or a model torch.compile cannot compile): the row says which
    assert [r.status for r in rows.values() if r.kind == "failed to compile"] == []
    rewritten = [r for r in rows.values() if r.kind == "rewritten"]
    assert len(rewritten) >= 30, summary
    not_exact = [(r.model_type, r.note, "also without match_moe" if r.error_elsewhere else "") for r in rewritten]
    assert [x for x, r in zip(not_exact, rewritten) if not r.exact] == []
    # every family that compiles runs as eager does, rewritten or not
    assert [r.model_type for r in rows.values() if r.exact is False] == []
    # what the matcher tests check block by block holds for the whole models too
    for family in ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3"):
        assert rows[family].kind == "rewritten", rows[family].status
    assert "group-limited" in rows["deepseek_v3"].routing and "scale 2.5" in rows["deepseek_v3"].routing
    # a block left unchanged says why
    for r in rows.values():
        if r.kind in ("unchanged", "partly rewritten"):
            assert r.reasons, r


def test_docs_models_md_is_current(survey):
    doc = DOC.read_text()
    recorded = re.search(r"^Versions: transformers (\S+), torch (\S+), vLLM (.+?) \(", doc, re.M)
    assert recorded, f"{DOC} has no versions line; regenerate it: {REGENERATE}"
    installed = (transformers.__version__, torch.__version__, survey["vllm"] or "not installed")
    if tuple(_base(v) for v in recorded.groups()) != tuple(_base(v) for v in installed):
        pytest.skip(
            "docs/models.md was generated with transformers {}, torch {}, vLLM {}; installed: transformers {}, "
            "torch {}, vLLM {}".format(*recorded.groups(), *installed)
        )
    text = moe_families.render(survey)
    if text != doc:
        diff = "".join(list(difflib.unified_diff(doc.splitlines(True), text.splitlines(True), "committed", "now"))[:60])
        pytest.fail(f"docs/models.md is not what the survey finds now; regenerate it with `{REGENERATE}`:\n{diff}")


def test_a_per_layer_field_is_read_from_what_the_configuration_holds():
    """transformers 5.25's heterogeneous configurations raise when a per-layer field is read globally; the survey
    reads the value the (default) configuration holds for every layer, and None where it holds none."""

    class PerLayer:
        def __init__(self):
            self.num_attention_heads = 128

        def __getattribute__(self, name):
            if name in ("num_attention_heads", "head_dim"):
                raise RuntimeError(f"{name!r} is a per-layer attribute and may vary across layers")
            return object.__getattribute__(self, name)

    config = PerLayer()
    assert moe_families._field(config, "num_attention_heads") == 128
    assert moe_families._field(config, "head_dim") is None
    assert moe_families._field(config, "kv_lora_rank") is None


def test_a_family_without_a_modeling_module_is_built_with_the_class_its_mapping_names():
    """Param2-MoE (transformers 5.25) is a configuration whose model type the auto mappings send to GLM-4-MoE's
    classes; the survey builds it as ``AutoModelForCausalLM.from_config`` does."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    if "param2moe" not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no param2moe (5.25 adds it)")
    config = moe_families.tiny_config(CONFIG_MAPPING["param2moe"]())
    cls = moe_families.model_class(config)
    assert cls is transformers.AutoModelForCausalLM._model_mapping[type(config)], cls
    assert cls.__name__ == "Glm4MoeForCausalLM"
