"""Building a ``rubin.moe`` node in a post-grad FX graph (the matchers of this package share it)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from rubin_compile.passes.fx import call


def emit_moe(
    graph: torch.fx.Graph,
    hidden_states: torch.fx.Node,
    w13: torch.fx.Node,
    w2: torch.fx.Node,
    topk_weights: torch.fx.Node,
    topk_ids: torch.fx.Node,
    activation: str = "silu",
    w13_bias: Optional[torch.fx.Node] = None,
    w2_bias: Optional[torch.fx.Node] = None,
    w13_scale: Optional[torch.fx.Node] = None,
    w2_scale: Optional[torch.fx.Node] = None,
    block_shape: Optional[Sequence[int]] = None,
    weight_layout: str = "plain",
) -> torch.fx.Node:
    """Insert a ``rubin.moe`` node (kernel "reference" until select_kernels binds one); arguments that are
    their defaults are left out, so the dump reads like the call a person would write."""
    kwargs: dict[str, Any] = {"activation": activation}
    for name, value in (("w13_bias", w13_bias), ("w2_bias", w2_bias), ("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if value is not None:
            kwargs[name] = value
    if block_shape is not None:
        kwargs["block_shape"] = list(block_shape)
    if weight_layout != "plain":
        kwargs["weight_layout"] = weight_layout
    return call(graph, torch.ops.rubin.moe.default, (hidden_states, w13, w2, topk_weights, topk_ids), kwargs)
