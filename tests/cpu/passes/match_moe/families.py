"""transformers' MoE families built as docs/models.md builds them (rubin_compile.debug.moe_families: the tiny random
configuration of each family's text model), for the tests that compile one family's MoE block or trace its router.
"""

from __future__ import annotations

import functools

import torch

from rubin_compile.debug import moe_families


@functools.lru_cache(maxsize=None)
def _families() -> dict:
    return {f.model_type: f for f in moe_families.discover()[0]}


def tiny_model(model_type: str) -> tuple[torch.nn.Module, object]:
    """The family's tiny text model (fp32, eval, weights from seed 0) and its configuration."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    family = _families()[model_type]
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
