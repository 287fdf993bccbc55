"""Building canonical nodes in a post-grad FX graph, with the fake values Inductor needs on them."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch._guards import detect_fake_mode
from torch.fx.node import map_aggregate

import rubin_compile.ops  # noqa: F401  (registers torch.ops.rubin.*)


def call(graph: torch.fx.Graph, target: Callable, args: tuple, kwargs: Optional[dict] = None) -> torch.fx.Node:
    """Insert ``target(*args, **kwargs)`` at the graph's current insertion point and give it a fake
    ``meta["val"]`` computed from its inputs' values (Inductor lowers from these)."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    vals: list[Any] = []

    def to_val(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            v = a.meta.get("val")
            vals.append(v)
            return v
        return a

    fargs = map_aggregate(args, to_val)
    fkwargs = map_aggregate(kwargs, to_val)
    if all(v is not None for v in vals):
        fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
        if fake_mode is not None:
            with fake_mode:
                node.meta["val"] = target(*fargs, **fkwargs)
    return node


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
    """Insert a ``rubin.moe`` node (kernel "reference" until select_kernels binds one)."""
    kwargs: dict[str, Any] = {"activation": activation}
    for name, value in (("w13_bias", w13_bias), ("w2_bias", w2_bias), ("w13_scale", w13_scale),
                        ("w2_scale", w2_scale)):
        if value is not None:
            kwargs[name] = value
    if block_shape is not None:
        kwargs["block_shape"] = list(block_shape)
    if weight_layout != "plain":
        kwargs["weight_layout"] = weight_layout
    return call(graph, torch.ops.rubin.moe.default, (hidden_states, w13, w2, topk_weights, topk_ids), kwargs)


def tensor_meta(node: Any) -> Optional[torch.Tensor]:
    """The fake tensor on a node, or None."""
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def inherit_source(new_nodes: list[torch.fx.Node], origin: torch.fx.Node) -> None:
    """Give nodes a rewrite created the source line of the node they stand for, so dumps keep saying
    which line of the model they come from."""
    trace = origin.meta.get("stack_trace")
    if trace:
        for n in new_nodes:
            n.meta.setdefault("stack_trace", trace)
