"""FX helpers every pass and matcher shares: reading nodes, walking users, reading mutating calls back from
``auto_functionalized``, and inserting nodes with the fake values Inductor needs on them.

The helpers that read a call's arguments and fake values live in ops/nodes.py (the canonical ops need them
too) and are re-exported here, so a pass imports everything of this kind from one module.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch._guards import detect_fake_mode
from torch._inductor.pattern_matcher import CallFunctionVarArgs, Match, MatchContext
from torch._inductor.virtualized import NullHandler, V
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.node import map_aggregate

from rubin_compile.ops.nodes import (  # noqa: F401  (re-exported for the passes)
    FLOAT_DTYPES,
    FP8_DTYPES,
    bound_arguments,
    device_type,
    dtype_name,
    node_val,
    schema_name,
    static_size,
    tensor_val,
    val_dtype,
)

aten = torch.ops.aten
prims = torch.ops.prims

RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
CONVERTS = (prims.convert_element_type.default, aten._to_copy.default)
_AF = torch.ops.higher_order.auto_functionalized
_AF2 = torch.ops.higher_order.auto_functionalized_v2


# --------------------------------------------------------------------------------------------------
# reading nodes
# --------------------------------------------------------------------------------------------------


def is_call(node: Any, *targets: Any) -> bool:
    """``node`` is a call_function node of one of ``targets``."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def single_user(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The only user of ``node``, or ``None`` when it has none or several."""
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def getitem_of(node: Any, index: int, *targets: Any) -> Optional[torch.fx.Node]:
    """For ``node = getitem(op(...), index)`` with op in ``targets``: the op node; else None."""
    if is_call(node, operator.getitem) and node.args[1] == index and is_call(node.args[0], *targets):
        return node.args[0]
    return None


def strip_converts(node: Any) -> Any:
    """The node under any chain of dtype conversions (``.to(dtype)`` / ``.float()``) on top of it."""
    while is_call(node, *CONVERTS) and not set(node.kwargs) - {"dtype"}:
        node = node.args[0]
    return node


def scalar(node: Any) -> Optional[float]:
    """A Python number, or None."""
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes, symbolic sizes included, without adding a guard."""
    return a.dim() == b.dim() and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))


def dotted_name(op: Any) -> str:
    """``"rubin.moe"`` for ``torch.ops.rubin.moe.default``: how reports name an op."""
    return (schema_name(op) or str(op)).replace("::", ".")


def report_value(value: Any) -> Any:
    """A size for a report: a plain int as it is, a symbolic one (dynamic shapes) as its text."""
    return value if isinstance(value, int) else str(value)


# --------------------------------------------------------------------------------------------------
# mutating ops behind auto_functionalized / auto_functionalized_v2
# --------------------------------------------------------------------------------------------------


@dataclass
class MutatingCall:
    """A mutating custom op as it appears, functionalized, in a post-grad graph."""

    node: torch.fx.Node  # the auto_functionalized(_v2) node (or the call itself, version 0)
    op: torch._ops.OpOverload
    version: int  # 1 or 2 (0: a plain call)
    args: dict[str, Any]  # every argument by schema name; a mutated one is the tensor passed in
    result_index: dict[str, int]  # mutated argument -> getitem index of its value after the call
    view_args: list[str] = field(default_factory=list)  # mutated arguments passed as views of a larger base

    def other_users(self, keep: set[int]) -> list[torch.fx.Node]:
        """Users that read something other than the results at ``keep`` (unused ``getitem``s aside)."""
        return [u for u in self.node.users if not is_call(u, operator.getitem) or (u.args[1] not in keep and u.users)]


def decode_mutating_call(node: torch.fx.Node) -> Optional[MutatingCall]:
    """Read an ``auto_functionalized`` (v1) or ``auto_functionalized_v2`` node; None for anything else."""
    if not is_call(node, _AF, _AF2) or not node.args or not isinstance(node.args[0], torch._ops.OpOverload):
        return None
    op = node.args[0]
    schema = op._schema
    returns = len(schema.returns)
    first = returns if returns > 1 else 1  # auto_functionalized returns (*outs, *mutated) or (out, *mutated)
    args: dict[str, Any] = {}
    result_index: dict[str, int] = {}
    view_args: list[str] = []
    mutable = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if node.target is _AF:
        for a in schema.arguments:
            args[a.name] = node.kwargs.get(a.name, a.default_value if a.has_default_value() else None)
        for i, name in enumerate(mutable):
            result_index[name] = first + i
    else:
        bases = node.kwargs.get("_all_bases", [])
        for a in schema.arguments:
            if a.name in mutable:
                idx = node.kwargs.get(f"_{a.name}_base_index")
                if idx is None:
                    args[a.name] = None
                    continue
                args[a.name] = bases[idx]
                result_index[a.name] = first + idx
                if f"_{a.name}_size" in node.kwargs or f"_{a.name}_slice_dim" in node.kwargs:
                    view_args.append(a.name)
            else:
                args[a.name] = node.kwargs.get(a.name, a.default_value if a.has_default_value() else None)
    return MutatingCall(node, op, 1 if node.target is _AF else 2, args, result_index, view_args)


def called_op(node: torch.fx.Node) -> Any:
    """The op a node calls: the wrapped op of an ``auto_functionalized`` node, else its target."""
    mc = decode_mutating_call(node)
    return mc.op if mc is not None else node.target


# --------------------------------------------------------------------------------------------------
# changing the graph
# --------------------------------------------------------------------------------------------------


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


def inherit_source(new_nodes: list[torch.fx.Node], origin: torch.fx.Node) -> None:
    """Give nodes a rewrite created the source line of the node they stand for, so dumps keep saying
    which line of the model they come from."""
    trace = origin.meta.get("stack_trace")
    if trace:
        for n in new_nodes:
            n.meta.setdefault("stack_trace", trace)


def set_argument(node: torch.fx.Node, name: str, value: Any) -> None:
    """Set argument ``name`` of a call of an ``OpOverload`` where it is given: positionally or by keyword."""
    index = [a.name for a in node.target._schema.arguments].index(name)
    if index < len(node.args):
        node.update_arg(index, value)
    else:
        node.update_kwarg(name, value)


def replace_by_trace(
    graph: torch.fx.Graph,
    node: torch.fx.Node,
    fn: Callable[..., Any],
    args: dict[str, Any],
    trace_fn: Optional[Callable[..., Any]] = None,
) -> None:
    """Replace ``node`` by the ops ``fn(**args)`` runs, traced with the node's fake values: the ``args`` that are
    nodes become the traced inputs, the others stay constants. One node is the whole "pattern": a Match over it lets
    torch's pattern matcher trace ``fn`` and splice it in (meta, users and erasure handled there; ``trace_fn``: its
    tracer, ``fwd_only`` by default). Nothing changes when tracing raises."""
    tensors = [n for n, v in args.items() if isinstance(v, torch.fx.Node)]
    consts = {n: v for n, v in args.items() if n not in tensors}

    def replacement(*values: torch.Tensor) -> Any:
        return fn(**consts, **dict(zip(tensors, values)))

    pattern = CallFunctionVarArgs(node.target)
    match = Match(MatchContext([pattern], {pattern: node}, graph=graph), pattern, node.args, node.kwargs)
    match.nodes = [node]
    # The pattern matcher traces under Inductor's fake mode (V.fake_mode), which a graph's passes run under; a pass run
    # on its own (tests, `python -m rubin_compile`) has none, and then the tensors ``fn`` makes (torch.zeros ...) would
    # be real ones mixed with the fake inputs: trace under the inputs' own fake mode then.
    mode = detect_fake_mode([args[n].meta.get("val") for n in tensors])
    unset = isinstance(V.fake_mode, NullHandler)
    with V.set_fake_mode(mode) if (unset and mode is not None) else contextlib.nullcontext():
        match.replace_by_example(
            replacement, [args[n] for n in tensors], **({"trace_fn": trace_fn} if trace_fn else {})
        )
