"""Building a ``rubin.moe`` node in a post-grad FX graph (the matchers of this package share it)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch

import rubin_compile.kernels  # noqa: F401  (registers every kernel on the op: reference_only_reason asks the registry)
from rubin_compile.ops.moe import MOE
from rubin_compile.ops.registry import KernelSpec
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
    apply_router_weight_on_input: bool = False,
    activation_constants: Optional[torch.fx.Node] = None,
    **quantised: Optional[torch.fx.Node],
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
    if apply_router_weight_on_input:
        kwargs["apply_router_weight_on_input"] = True
    if activation_constants is not None:
        kwargs["activation_constants"] = activation_constants
    for name in ("w13_scale_2", "w2_scale_2", "a13_scale", "a2_scale"):  # FP4 global / static activation scales
        if quantised.get(name) is not None:
            kwargs[name] = quantised.pop(name)
    if quantised:
        raise TypeError(f"emit_moe: unknown arguments {sorted(quantised)}")
    return call(graph, torch.ops.rubin.moe.default, (hidden_states, w13, w2, topk_weights, topk_ids), kwargs)


def reference_only_reason(
    target: Any,
    act_dtype: str,
    weight_dtype: str,
    sizes: dict[str, Any],
    activation: str,
    features: Sequence[str] = (),
) -> Optional[str]:
    """On a CUDA target, why a block stays when its activation or the optional semantics it uses (``features``:
    ``ops.moe.call_features``, e.g. Llama 4's router weight on the input) are what leave only the reference kernel
    to run its ``rubin.moe`` (the reference loops over the experts: slower on a GPU than what the block runs without
    rubin, Inductor's compile of it or vLLM's fused MoE). None when a GPU kernel takes it, on a CPU target, or when
    the reference would run it for another reason (an fp32 model, rewritten as before)."""
    if not getattr(target, "is_cuda", False):
        return None
    spec = KernelSpec(
        op="moe",
        act_dtype=act_dtype,
        weight_dtype=weight_dtype,
        shape=tuple((k, v) for k, v in sizes.items() if isinstance(v, int)),
        activation=activation,
        features=tuple(features),
    )
    selection = MOE.select(spec, target)
    if selection.chosen.name != "reference":
        return None
    if MOE.select(dataclasses.replace(spec, activation="silu", features=()), target).chosen.name == "reference":
        return None
    why = "; ".join(f"{name}: {reason}" for name, reason in selection.rejected)
    # Name what is to blame: the activation, the features, or (when each alone has a GPU kernel) the two together.
    blame = []
    if MOE.select(dataclasses.replace(spec, features=()), target).chosen.name == "reference":
        blame.append(f"activation {activation}")
    if features and MOE.select(dataclasses.replace(spec, activation="silu"), target).chosen.name == "reference":
        blame.append(", ".join(features))
    what = " and ".join(blame) or f"activation {activation} with {', '.join(features)}"
    return (
        f"on {target.name} only the reference implements {what} ({why}); the reference loops "
        "over the experts, slower than the block as written, so the block stays"
    )
