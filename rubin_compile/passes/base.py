"""What every pass shares: the ``Pass`` entry of the pipeline, the context a pass runs in, the engine adapter it
asks about the framework the graph comes from, the ``PassResult`` it returns, and the errors of strict mode.

A pass is a module of this package with a ``PASS = Pass(name, run, reads)``; ``passes/__init__.py`` lists them
in pipeline order and ``manager.py`` runs them (order, dumps after each pass, timing, ``uuid()``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from rubin_compile.errors import RubinError
from rubin_compile.target import Target

if TYPE_CHECKING:  # type-only: options.py validates pass names against passes/__init__.py's list
    from rubin_compile.options import RubinOptions


class RubinStrictError(RubinError, RuntimeError):
    """``strict=True`` and the pipeline left something it recognised unchanged."""


class KernelSelectionError(RubinStrictError):
    """``strict=True`` and a kernel forced by ``options.kernels`` cannot run on the target."""


# Why a matcher leaves a block of a training graph alone (PassContext.gradients).
GRADIENTS_REASON = (
    "not rewritten: the graph computes gradients (rubin's ops have no backward); rubin compiles "
    "inference: run the model under torch.no_grad() or torch.inference_mode()"
)


# --------------------------------------------------------------------------------------------------
# what a pass reports
# --------------------------------------------------------------------------------------------------


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
    """The kernel chosen for one canonical node, and why every other kernel was not."""

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
    changed: bool = False
    rewrites: list[Rewrite] = field(default_factory=list)
    unchanged: list[Unchanged] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    plans: list[KernelPlan] = field(default_factory=list)  # select_kernels: one per canonical node
    decisions: list[Decision] = field(default_factory=list)  # place_locality, chain_pdl: one per canonical node

    def to_json(self) -> dict[str, Any]:
        return jsonable(self)


def jsonable(value: Any) -> Any:
    """``value`` as JSON-able data, for reports: dataclasses and mappings field by field, sequences as lists,
    symbolic sizes (dynamic shapes) and every other object as their text. Never copies a tensor or a symbol
    (``dataclasses.asdict`` deep-copies, which a symbolic size refuses)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    return str(value)


# --------------------------------------------------------------------------------------------------
# the engine a graph comes from
# --------------------------------------------------------------------------------------------------


class Engine:
    """What passes may ask of the inference engine that hands rubin the graph, without importing it.

    This base class is "no engine": a model compiled by ``torch.compile`` alone, where no graph names an
    engine's layers. vLLM's adapter (integrations/vllm/engine.py) answers from vLLM's forward context and
    config; it is the only place that touches vLLM objects.
    """

    name = "torch.compile"

    def runs_under_cudagraphs(self, options: RubinOptions) -> tuple[bool, str]:
        """Whether the compiled graph is replayed from CUDA graphs, and how that is known."""
        return bool(options.cudagraphs), f"options cudagraphs={options.cudagraphs!r}"

    def layer_name(self, value: Any) -> Optional[str]:
        """The name inside a layer-name argument of an engine op (a ``str``, or the engine's own type)."""
        return value if isinstance(value, str) else None

    def find_layer(self, name: str) -> tuple[Any, Optional[str]]:
        """(the engine's layer called ``name``, None), or (None, why it cannot be found)."""
        return None, f"layer {name!r}: no inference engine hands rubin this graph, so its layers cannot be read"

    def moe_layer_unsupported(self, layer: Any, shared: bool) -> Optional[str]:
        """Why the engine's MoE ``layer`` cannot run as ``rubin.moe`` (None when it can)."""
        return "no inference engine to read the layer from"

    def moe_layer_details(self, layer: Any) -> dict[str, Any]:
        """Shapes and routing settings of the engine's MoE ``layer``, for the rewrite report."""
        return {}

    def moe_layer_op(self, shared: bool) -> torch._ops.OpOverload:
        """The rubin op that runs the engine's MoE layer through rubin.moe's kernels."""
        raise RuntimeError("no inference engine: there is no engine MoE layer op")

    def attention_layer_facts(self, layer: Any) -> dict[str, Any]:
        """Backend, kernel, KV cache and heads of the engine's attention ``layer`` (JSON-able)."""
        return {}

    def attention_switches(self, kernel: str) -> Optional[str]:
        """The engine's settings that make it run registry kernel ``kernel`` for attention, if any."""
        return None

    def cpu_weight_layout(self, isa: str, w13: torch.Tensor, w2: torch.Tensor) -> tuple[Optional[str], Optional[str]]:
        """(rubin.moe's weight layout of expert weights the engine's CPU build prepacked for ``isa``, None), or
        (None, why they are in no layout rubin knows). ``w13`` / ``w2`` may be fake tensors."""
        return None, "no inference engine to check its CPU weight layout against"


# --------------------------------------------------------------------------------------------------
# the context, and the pipeline's entries
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PassContext:
    """What a pass may read besides the graph: the options, the target, the engine adapter, whether the graph
    belongs to a training compile, the graph's id.

    ``target`` defaults to the options' (``options.resolved_target()``); ``engine`` to "no engine";
    ``gradients``: the compile computes gradients (its forward keeps tensors for a backward), so the matchers
    leave what they recognise alone and say so.
    """

    options: RubinOptions
    target: Optional[Target] = None
    engine: Engine = field(default_factory=Engine)
    gradients: bool = False
    graph_id: str = "graph"

    def __post_init__(self) -> None:
        if self.target is None:
            object.__setattr__(self, "target", self.options.resolved_target())


CONTEXT_FIELDS = tuple(f.name for f in dataclasses.fields(PassContext) if f.name != "graph_id")


@dataclass(frozen=True)
class Pass:
    """One stage of the pipeline: its name (as ``options.passes`` spells it), the function that runs it, and
    which fields of the ``PassContext`` it reads (``options``, ``target``, ``engine``, ``gradients``; every pass may read
    ``graph_id``). The manager hands each pass a context that holds only those fields."""

    name: str
    run: Callable[[torch.fx.Graph, PassContext], PassResult]
    reads: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = set(self.reads) - set(CONTEXT_FIELDS)
        if unknown:
            raise ValueError(f"pass {self.name}: reads {sorted(unknown)}, which PassContext does not have")

    def context(self, ctx: PassContext) -> "ScopedContext":
        return ScopedContext(ctx, self)


class ScopedContext:
    """A pass's view of the ``PassContext``: the fields its ``Pass`` declares. Reading another one is an
    error that names the pass, so a pass that starts to depend on the engine or the target says so in the
    pipeline list."""

    def __init__(self, ctx: PassContext, owner: Pass) -> None:
        self._ctx = ctx
        self._owner = owner

    def __getattr__(self, name: str) -> Any:
        if name == "graph_id" or name in self._owner.reads:
            return getattr(self._ctx, name)
        if name in CONTEXT_FIELDS:
            raise AttributeError(
                f"pass {self._owner.name} reads ctx.{name}, which its Pass entry does not declare "
                f"(reads={self._owner.reads}); add it there"
            )
        raise AttributeError(name)
