"""What every pass shares: the context it runs in, and the ``PassResult`` it returns.

A pass is a module in this package with ``NAME`` and ``run(graph, ctx) -> PassResult``; ``manager.py``
owns the order, the dumps after each pass, timing and ``uuid()``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from rubin_compile.options import RubinOptions
from rubin_compile.target import Target


@dataclass
class Rewrite:
    """One source idiom rewritten into a canonical op."""

    node: str  # name of the new canonical node in the graph
    canonical_op: str  # e.g. "rubin.moe"
    source_idiom: str  # e.g. "vllm _C.cpu_fused_moe", "hf grouped_mm (qwen3_moe)", "expert loop"
    replaced: list[str]  # names of the source nodes it replaced
    details: dict[str, Any] = field(default_factory=dict)  # shapes, dtype, activation, routing, ...


@dataclass
class Unchanged:
    """Something that looked like an idiom we handle but was left as it was, and why."""

    node: str
    idiom: str
    reason: str


@dataclass
class KernelPlan:
    """The kernel chosen for one canonical node, and why every other candidate was not."""

    node: str  # name of the canonical node
    canonical_op: str  # e.g. "rubin.moe"
    target: str  # the target the plan is for, e.g. "sm107"
    kernel: str  # the chosen kernel, e.g. "flashinfer_trtllm"
    impl: str  # what was written into the node's ``impl`` argument, e.g. "flashinfer_trtllm@sm107"
    entry: str  # what runs, e.g. "flashinfer.fused_moe.trtllm_bf16_moe"
    spec: dict[str, Any] = field(default_factory=dict)  # quantisation, dtypes, shapes, activation
    rejected: list[dict[str, str]] = field(default_factory=list)  # {"kernel", "reason"}, by priority
    outranked: list[str] = field(default_factory=list)  # supported, but of lower priority
    forced: Optional[str] = None  # options.kernels asked for this kernel
    forced_reason: Optional[str] = None  # why the forced kernel was not used
    lowered: Optional[str] = None  # "aten": the node was replaced by the ATen ops its kernel runs


@dataclass
class Decision:
    """How one canonical node is launched or placed (chain_pdl: PDL on / off; place_locality: a placement
    or none), and why."""

    node: str
    canonical_op: str
    decision: str  # e.g. "pdl on", "pdl off", "split_n backfill x2", "whole"
    reason: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class PassResult:
    """What one pass did to one graph."""

    name: str
    implemented: bool = True
    changed: bool = False
    rewrites: list[Rewrite] = field(default_factory=list)
    unchanged: list[Unchanged] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    plans: list[KernelPlan] = field(default_factory=list)  # select_kernels: one per canonical node
    decisions: list[Decision] = field(default_factory=list)  # place_locality, chain_pdl: one per canonical node

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class PassContext:
    """What a pass may read besides the graph: the options, and where the graph came from."""

    options: RubinOptions
    graph_id: str = "graph"
    source: str = "backend"  # "backend" (torch.compile(backend="rubin")) or "vllm" (the vLLM pass)
    extra: dict[str, Any] = field(default_factory=dict)
    target: Optional[Target] = None  # the resolved options.target (the pass manager sets it)


def node_val(node: torch.fx.Node) -> Optional[Any]:
    """The fake value (tensor or tuple of tensors) recorded on a node, if any."""
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def bound_arguments(node: torch.fx.Node) -> dict[str, Any]:
    """A call of an ``OpOverload``: its arguments by schema name, defaults filled in."""
    schema = node.target._schema
    out = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    out.update(zip((a.name for a in schema.arguments), node.args))
    out.update(node.kwargs)
    return out
