"""select_kernels: bind every canonical node to the best kernel for the target, and record why.

For each node of a canonical op (``rubin.moe``, ``rubin.gemm``, ``rubin.attention``, and the ops that run their
kernels, such as vLLM's MoE layer op) it builds the op's ``KernelSpec`` from the node's arguments and fake
values (quantisation, dtypes, shapes, activation), asks the op (ops/registry.py) for the supported kernel of
highest priority on ``ctx.target``, and writes the choice into the node's ``impl`` argument
(``"flashinfer_trtllm@sm107"``), so the dumps show it and Inductor's cache keys on it. The plan -- chosen
kernel, what runs, every rejected candidate with its reason -- goes into ``PassResult.plans`` and from
there into report.json / report.md.

``options.kernels`` forces a kernel per op (vLLM's ``--moe-backend``): a forced kernel that cannot run on
the target is rejected with its reason and selection goes on as usual; with ``strict`` that is an error.
On the CPU target every candidate but ``reference`` is rejected, so CPU runs keep exact numerics.

**Lowering back to ATen.** A ``rubin.gemm`` or ``rubin.attention`` bound to ``torch`` or ``reference``
would run, as an opaque extern call, the very ATen ops that Inductor compiles itself from the source
graph, and Inductor could no longer fuse or choose around them: a GEMM's bias / activation / residual
epilogue and template, attention's SDPA backend choice and mask padding (measurements in
docs/kernels/selection.md). Such a node is replaced by its op's ATen form (``CanonicalOp.aten_form``:
``ops/gemm.py:gemm_aten``, ``ops/attention.py:attention_aten``, traced in with torch's pattern matcher,
``Match.replace_by_example``); its plan says ``lowered: aten``. A bf16 or fp32 ``rubin.moe`` bound to the reference on
the CPU is lowered the same way, into grouped GEMMs over the slots sorted by expert (``ops/moe.py:moe_aten``; fp32's
are ``rubin.grouped_mm_rows`` calls, a GEMM per expert's run): the
reference loops over the routed experts with a host synchronisation, slower than what Inductor compiles from
transformers' grouped-mm experts. On a GPU target (sm_90 and newer) a bf16 ``rubin.moe`` bound to the reference -- one
no kernel takes, e.g. a clamped SwiGLU in an op call written by hand (match_moe leaves such model blocks as written
there) -- takes the same form: inside a CUDA graph the reference runs every expert on every token, the grouped GEMMs
only the routed ones (``ops/moe.py:aten_declines``). Where an op's ATen form
cannot express a node (``CanonicalOp.aten_declines``),
the node stays an op call and the notes say why. Nodes bound to any other kernel stay canonical ops.
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Optional

import torch

import rubin_compile.kernels  # noqa: F401  (registers every kernel onto its op)
from rubin_compile import target as target_mod
from rubin_compile.ops.registry import CanonicalOp, canonical_form, op_of
from rubin_compile.passes.base import KernelPlan, KernelSelectionError, Pass, PassContext, PassResult
from rubin_compile.passes.fx import bound_arguments, device_type, dotted_name, node_val, replace_by_trace, set_argument
from rubin_compile.target import Target

NAME = "select_kernels"

# Kernels whose code is what Inductor would compile itself from ATen: nodes bound to them are lowered back,
# per canonical op, into that op's ATen form.
KERNELS_LOWERED_TO_ATEN: tuple[str, ...] = ("torch", "reference")


def _on_cuda(graph: torch.fx.Graph) -> bool:
    """Whether the canonical nodes of ``graph`` compute on a CUDA device (by their first tensor input)."""
    for node in graph.nodes:
        device = device_type(node) if canonical_form(node) is not None else None
        if device is not None:
            return device == "cuda"
    return False


def planning(graph: torch.fx.Graph, ctx: PassContext) -> tuple[Target, bool, Optional[bool], Optional[str]]:
    """What selection plans ``graph`` for: ``(target, runs_here, cudagraphs, note)`` -- the target (the CPU when
    "auto" found a GPU but the graph's tensors are on the CPU; ``note`` says so), whether the graph runs on this
    machine (only kernels that can run here are chosen then: ``CanonicalOp.select``), and whether it is replayed
    from CUDA graphs. match_routing asks it too, to rewrite only where a routing kernel will be chosen."""
    target, note = ctx.target, None
    if ctx.options.target in ("auto", "") and target.is_cuda and not _on_cuda(graph):
        # "auto" detected a GPU, but this graph's tensors live on the CPU: plan for where it will run.
        note = f"target auto: the graph's tensors are on the CPU, not the {target.name} GPU; planning for the CPU"
        target = target_mod.resolve("cpu")
    runs_here = target.name == target_mod.detect().name or not target.is_cuda
    return target, runs_here, ctx.engine.runs_under_cudagraphs(ctx.options)[0], note


def run(graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
    result = PassResult(NAME)
    target, runs_here, cudagraphs, note = planning(graph, ctx)
    if note:
        result.notes.append(note)
    forced_kernels = dict(ctx.options.kernels)
    for op_name, kernel in forced_kernels.items():
        op_of(op_name).kernel(kernel)  # an unknown kernel name is an error, listing the valid ones
    to_lower: list[tuple[torch.fx.Node, CanonicalOp, KernelPlan]] = []
    missing: dict[str, set[str]] = {}  # package -> kernels that outrank the chosen ones but need it
    for node in list(graph.nodes):
        form = canonical_form(node)
        if form is None:
            continue
        op, spec_of = form
        spec = spec_of(node)
        forced = forced_kernels.get(op.name)
        selection = op.select(spec, target, forced, runs_here=runs_here, cudagraphs=cudagraphs)
        if forced is not None and selection.forced_reason is not None:
            if ctx.options.strict:
                raise KernelSelectionError(
                    f"rubin (strict): options.kernels forces {forced!r} for rubin.{op.name} (node {node.name} in "
                    f"graph {ctx.graph_id}), but it cannot run on target {target.name}: {selection.forced_reason}. "
                    f"Kernels that can: {[selection.chosen.name, *selection.outranked]}."
                )
            note = (
                f"{node.name}: forced kernel {forced!r} rejected on {target.name} ({selection.forced_reason}); "
                f"chose {selection.chosen.name!r}"
            )
            result.notes.append(note)
            _warn_once(f"rubin: options.kernels: {note} (strict=True makes this an error)")
        outranked_by_missing = False
        for name, reason in selection.rejected:
            package = _MISSING.fullmatch(reason)
            if package and op.kernel(name).rank(target, spec) > selection.chosen.rank(target, spec):
                missing.setdefault(package.group(1), set()).add(name)
                outranked_by_missing = True
        impl = selection.impl
        if bound_arguments(node).get("impl") != impl:
            set_argument(node, "impl", impl)
            result.changed = True
        plan = KernelPlan(
            node=node.name,
            canonical_op=dotted_name(node.target),
            target=target.name,
            kernel=selection.chosen.name,
            impl=impl,
            entry=selection.chosen.entry(spec) + _prepared(selection.chosen, node),
            spec=spec.to_json(),
            rejected=[{"kernel": k, "reason": r} for k, r in selection.rejected],
            outranked=selection.outranked,
            forced=forced,
            forced_reason=selection.forced_reason,
        )
        result.plans.append(plan)
        if selection.chosen.name in KERNELS_LOWERED_TO_ATEN:
            kept = _kept_as_reference(target, selection.chosen.name, forced, outranked_by_missing and not runs_here)
            if kept:
                result.notes.append(f"{node.name}: rubin.{op.name} stays an op call of {plan.kernel!r}: {kept}")
            else:
                to_lower.append((node, op, plan))
    lowered: dict[str, int] = {}
    for node, op, plan in to_lower:  # after every spec is read: a lowered node's users see new nodes
        declined = _lower_to_aten(graph, node, op, target)
        if declined is None:
            plan.lowered = "aten"
            lowered[op.name] = lowered.get(op.name, 0) + 1
        elif declined:
            result.notes.append(f"{node.name}: rubin.{op.name} stays an op call of {plan.kernel!r}: {declined}")
    for name, count in lowered.items():
        result.changed = True
        result.notes.append(
            f"{count} rubin.{name} node(s) bound to torch / reference lowered back to ATen "
            f"({op_of(name).aten_label}), so Inductor fuses and tunes them itself"
        )
    if missing and target.is_cuda:
        # A plan for a GPU made where its packages are missing is not the plan that GPU gets: say so, once.
        packages = sorted(missing)
        note = (
            f"the plan for {target.name} may not be the one {target.name} gets: kernels ranked above the chosen "
            f"ones ({', '.join(sorted(set().union(*missing.values())))}) could not be considered because "
            f"{', '.join(packages)} {'is' if len(packages) == 1 else 'are'} not installed here; "
            f"pip install {' '.join(packages)} and compile again"
        )
        result.notes.append(note)
        _warn_once(f"rubin: {note}")
    if not result.plans:
        result.notes.append(f"no canonical node to bind (target {target.name})")
    return result


_MISSING = re.compile(r"package (\S+) is not installed")


def _kept_as_reference(target: Target, kernel: str, forced: Optional[str], planned_elsewhere: bool) -> str:
    """Why a node bound to the reference on a GPU target stays the op instead of its ATen form (``""``: it does
    not). The reference is lowered there when it is what would run -- no kernel of ours takes the call, or, on the
    GPU itself, none that is installed -- but not when ``options.kernels`` names it (the user asked for the
    reference itself), nor in a plan for a GPU made on another machine where a kernel ranked above it was rejected
    only because its package is missing here (``planned_elsewhere``: that GPU's own plan binds the kernel; the plan
    made here keeps the op, so the passes after selection show what that GPU runs)."""
    if kernel != "reference" or not target.is_cuda:
        return ""
    if forced == "reference":
        return "options.kernels names the reference"
    if planned_elsewhere:
        return "kernels ranked above it need packages this machine lacks (the GPU's own plan binds one of them)"
    return ""


def _prepared(kernel, node: torch.fx.Node) -> str:
    """``"; keeps N MB of weights in its layout"`` for a kernel that prepares the node's weights once (the memory
    cost the plan shows, like the matchers' stacked-weights note); ``""`` otherwise."""
    if kernel.prepared_bytes is None:
        return ""
    try:
        size = kernel.prepared_bytes(node)
    except Exception as exc:  # informative only: never fail selection over it
        return f"; prepared weights: not computed ({type(exc).__name__})"
    if not size:
        return ""
    return f"; keeps {size / 1e6:.3g} MB of weights in its layout (prepared once, reused while unchanged)"


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=2)


def _lower_to_aten(graph: torch.fx.Graph, node: torch.fx.Node, op: CanonicalOp, target: Target) -> Optional[str]:
    """Replace ``node`` by its op's ATen form (``CanonicalOp.aten_form``): ``None`` when it did, else why not (``""``
    when the node is not the op itself -- another op running its kernels -- or the op has no ATen form: nothing to
    report)."""
    if op.aten_form is None or node.target is not getattr(torch.ops.rubin, op.name).default:
        return ""
    args = {n: v for n, v in bound_arguments(node).items() if n != "impl"}
    if op.aten_declines is not None:
        values = {n: (node_val(v) if isinstance(v, torch.fx.Node) else v) for n, v in args.items()}
        reason = op.aten_declines(target, **values)
        if reason:
            return f"its ATen form ({op.aten_label}) does not apply: {reason}"
    replace_by_trace(graph, node, op.aten_form, args)
    return None


PASS = Pass(NAME, run, reads=("options", "target", "engine"))
