"""inline_kernels: trace the launches of our Triton kernels into the graph, so Inductor launches them itself.

A canonical node bound to one of our Triton kernels is, by default, a call of the rubin op in Inductor's generated
code: every step that call goes through the dispatcher, the op's argument checks, the kernel registry and the
adapter's Python (launch configuration, buffers, the launches themselves). Outside CUDA graphs a decode step pays
that host cost per node, and it made the uncaptured step slower than Inductor's own (issue 16;
benchmarks/results/host-cost-h200-2026-12-03/). This pass runs the node's adapter once, at compile time, under
``make_fx`` with the node's fake values: its ``torch.empty`` buffers become graph nodes and each
``launcher(kernel)[grid](...)`` is recorded through ``torch.library.wrap_triton`` (kernels/triton/launch.py,
``into_graph``) as a ``triton_kernel_wrapper_mutation`` node with its grid and constants fixed. The traced ops
replace the node (torch's pattern matcher, ``Match.replace_by_example``, as select_kernels lowers nodes to ATen),
and Inductor compiles and launches the kernels like user-defined Triton kernels (``torch.library.triton_op``'s
machinery): no op call, no Python of ours per step. The kernels and their launch configuration are the ones the op
call would run, so results are the same.

A node is traced when all of these hold, and the report says which one failed otherwise:

* ``options.inline_kernels`` is not ``"off"``; with ``"auto"`` the graph does not run under CUDA graphs (a replay
  pays no host cost, and the op call keeps its PDL launches there), with ``"on"`` it may (then note that a kernel
  whose writes torch cannot analyse, below, counts as writing its inputs, and cudagraph trees may skip a graph
  that mutates its inputs: the op call is the better choice there);
* its kernel declares ``in_graph`` (``Kernel.in_graph``: our Triton MoE, routing and decode attention);
* the graph runs on this machine (the adapter reads the GPU's properties) and the node is the canonical op itself;
* its sizes are static (the adapter picks tiles and splits from them; a symbolic size is decided per call);
* it is launched without PDL and without a locality placement (Inductor's launcher takes neither);
* tracing the adapter succeeds (anything it raises leaves the node a call, with the error in the report).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from rubin_compile.ops.library import python_impl
from rubin_compile.ops.registry import bound_nodes
from rubin_compile.passes.base import Decision, Pass, PassContext, PassResult
from rubin_compile.passes.fx import bound_arguments, dotted_name, node_val, replace_by_trace
from rubin_compile.passes.select_kernels import planning

NAME = "inline_kernels"
IN_GRAPH = "in graph"
CALL = "op call"

# Inductor asks torch which tensors a traced kernel writes (identify_mutated_tensors, from the kernel's TTIR). Our L2
# prefetch is inline PTX (kernels/triton/pdl.py: l2_prefetch, not pure: its result is unused), which that analysis
# cannot read: it then takes every tensor argument as written, which is correct (only more conservative scheduling),
# and logs a warning with a traceback per kernel and compile. This filter drops that one warning, and only for
# that cause; the report says it (NOTE_MUTATIONS).
# torch logs it from triton_kernel_wrap.py on the "torch._dynamo" logger (2.11-2.13); the module's own name too, in case
_ANALYSIS_LOGGERS = ("torch._dynamo", "torch._higher_order_ops.triton_kernel_wrap")
_INLINE_ASM = "analyze: tt.elementwise_inline_asm"
NOTE_MUTATIONS = (
    "Inductor's mutation analysis cannot read the inline PTX of our kernels' L2 prefetch; for such a kernel it "
    "takes every tensor argument as written (correct, more conservative), and its warning about it is not shown"
)


class _InlineAsmAnalysisFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (
            record.getMessage().startswith("Encountered an exception in identify_")
            and exc is not None
            and _INLINE_ASM in str(exc)
        )


def _quiet_inline_asm_analysis() -> None:
    for name in _ANALYSIS_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _InlineAsmAnalysisFilter) for f in logger.filters):
            logger.addFilter(_InlineAsmAnalysisFilter())


def _static(value: Any) -> bool:
    """Whether a fake value (tensor, list, number) has no symbolic size."""
    if isinstance(value, torch.Tensor):
        return not any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride(), value.storage_offset()))
    if isinstance(value, (list, tuple)):
        return all(_static(v) for v in value)
    return not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


def why_not(node: torch.fx.Node, bound, mode: str, cudagraphs: bool, how: str, runs_here: bool) -> Optional[str]:
    """Why ``node`` stays a call of its op (``None``: it is traced into the graph)."""
    kernel = bound.kernel
    if mode == "off":
        return "options inline_kernels='off'"
    if not kernel.in_graph:
        return f"kernel {kernel.name!r} runs through its adapter (only our Triton kernels are traced into the graph)"
    if not runs_here or not bound.target.is_cuda:
        return f"the graph is planned for {bound.target.name} on another machine: launches are traced where they run"
    if python_impl(node.target) is None:
        return f"{dotted_name(node.target)} runs the kernel through another op's call (only rubin ops are traced)"
    if cudagraphs and mode == "auto":
        return (
            f"the graph runs under CUDA graphs ({how}), whose replays pay no host cost per call; the op call keeps "
            "its PDL launches (inline_kernels='on' traces it anyway)"
        )
    args = bound_arguments(node)
    if args.get("pdl"):
        return "launched with PDL (chain_pdl), which Inductor's launcher does not take"
    if args.get("placement"):
        return f"placed on locality domains ({args['placement']}): its launches go to several streams"
    values = [node_val(v) if isinstance(v, torch.fx.Node) else v for v in args.values()]
    if not all(_static(v) for v in values) or not _static(node_val(node)):
        return "a size is symbolic (dynamic shapes): the adapter chooses tiles and splits per call"
    return None


def _trace_keeping_launches(fn, args):
    """make_fx of the adapter as the pattern matcher traces a replacement (its decompositions), without the dead
    code pass it runs by default: the recorded launches have no users and must stay."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._inductor.pattern_matcher import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    with enable_python_dispatcher():
        gm = make_fx(fn, select_decomp_table(), tracing_mode="real")(*args)
    gm.recompile()
    return gm


def inline(graph: torch.fx.Graph, node: torch.fx.Node) -> list[str]:
    """Replace ``node`` by its adapter's traced launches; returns the kernels recorded (raises what tracing
    raises, with the graph unchanged)."""
    from rubin_compile.kernels.triton.launch import into_graph

    fn = python_impl(node.target)
    # the arguments the node gives (a schema default can read differently from the function's: ScalarType as int)
    args = dict(zip((a.name for a in node.target._schema.arguments), node.args), **node.kwargs)
    recorded: list[str] = []

    def launches(**values: Any):
        with into_graph() as seen:
            out = fn(**values)
        recorded[:] = seen
        return out

    replace_by_trace(graph, node, launches, args, trace_fn=_trace_keeping_launches)
    return recorded


def run(graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
    result = PassResult(NAME)
    mode = ctx.options.inline_kernels
    _, runs_here, _, _ = planning(graph, ctx)
    cudagraphs, how = ctx.engine.runs_under_cudagraphs(ctx.options)
    traced = 0
    for node, bound in bound_nodes(graph, ctx.target):
        name, op_name = node.name, dotted_name(node.target)
        details: dict[str, Any] = {"kernel": bound.kernel.name, "target": bound.target.name}
        why = why_not(node, bound, mode, bool(cudagraphs), how, runs_here)
        if why is None:
            try:
                kernels = inline(graph, node)
            except Exception as exc:  # any adapter error: the node stays the op call that raised nothing at compile
                why = f"tracing its adapter failed ({type(exc).__name__}: {exc}); it runs as an op call"
            else:
                traced += 1
                result.changed = True
                details["launches"] = kernels
                reason = f"{len(kernels)} launch(es) traced into the graph: {', '.join(kernels) or 'none'}"
                result.decisions.append(Decision(name, op_name, IN_GRAPH, reason, details))
                continue
        result.decisions.append(Decision(name, op_name, CALL, why, details))
    if result.decisions:
        result.notes.append(
            f"{traced} of {len(result.decisions)} kernel node(s) traced into the graph (inline_kernels={mode!r})"
            + ("; Inductor launches their Triton kernels from its generated code" if traced else "")
        )
    if traced:
        _quiet_inline_asm_analysis()
        result.notes.append(NOTE_MUTATIONS)
    return result


PASS = Pass(NAME, run, reads=("options", "target", "engine"))
