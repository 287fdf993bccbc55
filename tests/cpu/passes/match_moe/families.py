"""transformers' MoE families built as docs/models.md builds them (rubin_compile.debug.moe_families: the tiny random
configuration of each family's text model), for the tests that compile one family's MoE block or trace its router.
"""

from __future__ import annotations

import functools

import pytest
import torch

from rubin_compile.debug import moe_families


@functools.lru_cache(maxsize=None)
def _discovered() -> tuple[dict, list[str]]:
    families, unreadable = moe_families.discover()
    return {f.model_type: f for f in families}, unreadable


def require(*model_types: str) -> None:
    """Skip the calling test where the installed transformers has no such model type: an older 5.x release than the
    one that added the family (the suite runs on 5.4 and on the newest; README "Versions")."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    missing = [t for t in model_types if t not in CONFIG_MAPPING_NAMES]
    if missing:
        pytest.skip(
            f"transformers {transformers.__version__} has no {', '.join(missing)} (a later 5.x release adds it)"
        )


def tiny_model(model_type: str) -> tuple[torch.nn.Module, object]:
    """The family's tiny text model (fp32, eval, weights from seed 0) and its configuration."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    require(model_type)
    families, unreadable = _discovered()
    if model_type not in families:  # e.g. 5.4's Ernie 4.5 / PhiMoE configurations fail their own field validation
        import transformers

        why = [u for u in unreadable if u.startswith(f"{model_type}:")] or [f"{model_type}: no MoE family found"]
        pytest.skip(f"transformers {transformers.__version__}: {why[0]}")
    family = families[model_type]
    config = moe_families.tiny_config(CONFIG_MAPPING[family.build_type]())
    torch.manual_seed(0)
    return moe_families.model_class(config)(config).float().eval(), config


def moe_block(model_type: str) -> tuple[torch.nn.Module, object]:
    """The first MoE block of the family's tiny model (the module around its experts: the router, the experts and
    any shared experts) and the configuration."""
    model, config = tiny_model(model_type)
    modules = dict(model.named_modules())
    name, experts = moe_families._experts_modules(model)[0]
    if type(experts).__name__.endswith("Experts"):  # the experts module: its parent is the block
        name = name.rsplit(".", 1)[0]
    return modules[name], config


def hidden_size(config) -> int:
    return getattr(config, "hidden_size", None) or config.d_model
