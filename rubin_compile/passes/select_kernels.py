"""select_kernels: bind every canonical node to the best kernel for the target, and record why.

For each ``torch.ops.rubin.<op>`` node (today ``rubin.moe``; ``rubin.gemm`` and ``rubin.attention`` come
with their matchers) it builds a ``KernelSpec`` from the node's arguments and fake values (quantisation,
dtypes, shapes, activation), asks the registry (kernels/registry.py) for the supported candidate of highest
priority on ``ctx.target``, and writes the choice into the node's ``impl`` argument
(``"flashinfer_trtllm@sm107"``), so the dumps show it and Inductor's cache keys on it. The plan -- chosen
kernel, what runs, every rejected candidate with its reason -- goes into ``PassResult.plans`` and from
there into report.json / report.md.

``options.kernels`` forces a kernel per op (vLLM's ``--moe-backend``): a forced kernel that cannot run on
the target is rejected with its reason and selection goes on as usual; with ``strict`` that is an error.
On the CPU target every candidate but ``reference`` is rejected, so CPU runs keep exact numerics.

**Lowering back to ATen.** A ``rubin.gemm`` or ``rubin.attention`` bound to ``torch`` or ``reference``
would run, as an opaque extern call, the very ATen ops that Inductor compiles itself from the source
graph, and Inductor could no longer fuse or choose around them: a GEMM's bias / activation / residual
epilogue and template (measured on the CPU: a 4-layer Phi-3 at T=1 ran 1.21x slower than with Inductor
alone), attention's SDPA backend choice and mask padding (the H200 profile of a decode step showed, at
T=1, ATen math-backend and copy kernels in place of Inductor's two fused attention kernels). Such a
node is replaced by those ATen ops (``ops/gemm.py:gemm_aten``, ``ops/attention.py:attention_aten``, traced
in with torch's pattern matcher, ``Match.replace_by_example``); its plan says ``lowered: aten``. Nodes
bound to any other kernel stay canonical ops.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from rubin_compile import target as target_mod
from rubin_compile.kernels import registry
from rubin_compile.ops import attention as attention_ops
from rubin_compile.ops import gemm as gemm_ops
from rubin_compile.kernels.registry import KernelSpec
from rubin_compile.options import CANONICAL_OPS
from rubin_compile.passes.base import KernelPlan, PassContext, PassResult, bound_arguments, node_val
from rubin_compile.passes.manager import RubinStrictError

NAME = "select_kernels"

# Kernels whose code is what Inductor would compile itself from ATen: nodes bound to them are lowered back,
# per canonical op, into that op's ATen form.
KERNELS_LOWERED_TO_ATEN: tuple[str, ...] = ("torch", "reference")
ATEN_FORMS: dict[Any, Callable[..., torch.Tensor]] = {
    torch.ops.rubin.gemm.default: gemm_ops.gemm_aten,
    torch.ops.rubin.attention.default: attention_ops.attention_aten,
}


class KernelSelectionError(RubinStrictError):
    """``strict=True`` and a kernel forced by ``options.kernels`` cannot run on the target."""


# rubin ops that run a canonical op's kernel through its ``impl`` argument without being that op:
# ops/vllm_moe.py's layer ops call rubin.moe's kernel on the weights of the vLLM layer they name.
RUNS_KERNEL_OF: dict[str, str] = {"vllm_moe_layer": "moe", "vllm_moe_layer_shared": "moe"}


def canonical_op(node: torch.fx.Node) -> Optional[str]:
    """``"moe"`` for a ``torch.ops.rubin.moe`` node (or an op in ``RUNS_KERNEL_OF``), etc.; else ``None``."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    if node.target.namespace != "rubin":
        return None
    name = op_name(node)
    return name if name in CANONICAL_OPS else RUNS_KERNEL_OF.get(name)


def op_name(node: torch.fx.Node) -> str:
    """``"moe"`` for ``torch.ops.rubin.moe.default``."""
    return node.target._schema.name.split("::")[-1]


def set_argument(node: torch.fx.Node, name: str, value: Any) -> None:
    """Set argument ``name`` of the node where it is given: positionally or as a keyword."""
    index = [a.name for a in node.target._schema.arguments].index(name)
    if index < len(node.args):
        node.update_arg(index, value)
    else:
        node.update_kwarg(name, value)


def _dtype(node: Any) -> str:
    val = node_val(node)
    return str(val.dtype).replace("torch.", "") if isinstance(val, torch.Tensor) else "unknown"


def _size(val: Any, dim: int) -> Optional[int]:
    if not isinstance(val, torch.Tensor) or val.dim() <= dim:
        return None
    size = val.shape[dim]
    return size if isinstance(size, int) else None  # symbolic sizes (dynamic T) are left out


def moe_spec(node: torch.fx.Node) -> KernelSpec:
    """What selection needs to know of a ``rubin.moe`` node (schema in ops/moe.py)."""
    args = bound_arguments(node)
    hidden, w13, ids = (node_val(args[n]) for n in ("hidden_states", "w13", "topk_ids"))
    weight_dtype = _dtype(args["w13"])
    block = args.get("block_shape")
    if weight_dtype.startswith("float8"):
        quant = "fp8_block" if block else "fp8_tensor"
    else:
        quant = "none"  # rubin.moe has no FP4 weights yet; its schema will say how they are marked
    two_i = _size(w13, 1)
    sizes = {"T": _size(hidden, 0), "E": _size(w13, 0), "H": _size(hidden, 1),
             "I": two_i // 2 if two_i is not None else None, "k": _size(ids, 1)}
    return KernelSpec(
        op="moe", quant=quant, act_dtype=_dtype(args["hidden_states"]), weight_dtype=weight_dtype,
        block_shape=tuple(block) if block else None,
        shape=tuple((k, v) for k, v in sizes.items() if v is not None),
        activation=args.get("activation"), node=node.name, weight_layout=args.get("weight_layout") or "plain",
    )


def vllm_layer_spec(node: torch.fx.Node) -> KernelSpec:
    """A ``rubin.vllm_moe_layer*`` node: its weights live on the vLLM layer, not in the graph, and the
    matcher only rewrites unquantised layers (ops/vllm_moe.py:layer_unsupported_reason), so the weights
    have the activations' dtype. E, I, k, the activation and the weight layout come from what the matcher
    read off the layer (``node.meta["rubin_vllm_layer"]``; absent on a graph built by hand)."""
    args = bound_arguments(node)
    hidden = node_val(args["hidden_states"])
    dtype = _dtype(args["hidden_states"])
    layer = node.meta.get("rubin_vllm_layer", {})
    sizes = {"T": _size(hidden, 0), "E": layer.get("E"), "H": _size(hidden, 1), "I": layer.get("I"),
             "k": layer.get("k")}
    return KernelSpec(op="moe", quant="none", act_dtype=dtype, weight_dtype=dtype,
                      shape=tuple((k, v) for k, v in sizes.items() if v is not None), node=node.name,
                      activation=layer.get("activation"), weight_layout=layer.get("weight_layout", "plain"))


# rubin op name -> how its node becomes a spec. A matcher that adds a canonical op adds its builder here.
SPEC_BUILDERS: dict[str, Callable[[torch.fx.Node], KernelSpec]] = {
    "moe": moe_spec, "vllm_moe_layer": vllm_layer_spec, "vllm_moe_layer_shared": vllm_layer_spec,
    "gemm": gemm_ops.kernel_spec, "attention": attention_ops.kernel_spec,
}


def bound_kernel(node: torch.fx.Node, ctx: PassContext) -> Optional[tuple[str, registry.Candidate, Any, KernelSpec]]:
    """For a canonical node after select_kernels: (canonical op, the kernel's candidate, the target it was
    planned for, the node's spec); ``None`` for any other node (later passes read the plan from the graph,
    so they work on graphs that went through selection in another process too)."""
    op = canonical_op(node)
    builder = SPEC_BUILDERS.get(op_name(node)) if op is not None else None
    if builder is None:
        return None
    kernel, planned = registry.parse_impl(bound_arguments(node).get("impl") or "reference")
    try:
        cand = registry.candidate(op, kernel)
    except registry.UnknownKernelError:
        return None
    if planned is not None:
        target = target_mod.resolve(planned)
        here = target_mod.detect()
        if here.name == target.name:
            target = here  # this machine's own SM count and name
    else:  # the reference kernel carries no target: it runs wherever it is
        target = ctx.target if ctx.target is not None and not _on_cpu(node) else target_mod.resolve("cpu")
    return op, cand, target, builder(node)


def _device_type(node: torch.fx.Node) -> Optional[str]:
    """The device type of the node's first tensor input (``None`` when it has none)."""
    for arg in node.args:
        val = node_val(arg) if isinstance(arg, torch.fx.Node) else None
        if isinstance(val, torch.Tensor):
            return val.device.type
    return None


def _on_cpu(node: torch.fx.Node) -> bool:
    return _device_type(node) in (None, "cpu")


def _on_cuda(graph: torch.fx.Graph) -> bool:
    """Whether the canonical nodes of ``graph`` compute on a CUDA device (by their first tensor input)."""
    for node in graph.nodes:
        device = _device_type(node) if canonical_op(node) is not None else None
        if device is not None:
            return device == "cuda"
    return False


def run(graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
    result = PassResult(NAME)
    target = ctx.target if ctx.target is not None else ctx.options.resolved_target()
    if ctx.options.target in ("auto", "") and target.is_cuda and not _on_cuda(graph):
        # "auto" detected a GPU, but this graph's tensors live on the CPU: plan for where it will run.
        result.notes.append(f"target auto: the graph's tensors are on the CPU, not the {target.name} GPU; "
                            "planning for the CPU")
        target = target_mod.resolve("cpu")
    # Compiling for the machine we run on: choose only kernels that can run here (see registry.select).
    runs_here = target.name == target_mod.detect().name or not target.is_cuda
    forced_kernels = dict(ctx.options.kernels)
    for op, name in forced_kernels.items():
        registry.candidate(op, name)  # an unknown kernel name is an error, listing the valid ones
    for node in list(graph.nodes):
        op = canonical_op(node)
        if op is None:
            continue
        builder = SPEC_BUILDERS.get(op_name(node))
        if builder is None:
            result.notes.append(
                f"{node.name}: no spec builder for rubin.{op_name(node)}; it keeps impl={bound_arguments(node).get('impl')!r}"
            )
            continue
        spec = builder(node)
        forced = forced_kernels.get(op)
        selection = registry.select(spec, target, forced, runs_here=runs_here)
        if forced is not None and selection.forced_reason is not None:
            if ctx.options.strict:
                raise KernelSelectionError(
                    f"rubin (strict): options.kernels forces {forced!r} for rubin.{op} (node {node.name} in "
                    f"graph {ctx.graph_id}), but it cannot run on target {target.name}: {selection.forced_reason}. "
                    f"Kernels that can: {[selection.chosen.name, *selection.outranked]}."
                )
            result.notes.append(
                f"{node.name}: forced kernel {forced!r} rejected on {target.name} ({selection.forced_reason}); "
                f"chose {selection.chosen.name!r}"
            )
        impl = selection.impl
        if bound_arguments(node).get("impl") != impl:
            set_argument(node, "impl", impl)
            result.changed = True
        result.plans.append(KernelPlan(
            node=node.name, canonical_op=f"rubin.{op_name(node)}", target=target.name, kernel=selection.chosen.name,
            impl=impl, entry=selection.chosen.entry(spec), spec=spec.to_json(),
            rejected=[{"kernel": k, "reason": r} for k, r in selection.rejected],
            outranked=selection.outranked, forced=forced, forced_reason=selection.forced_reason,
        ))
    lowered = _lower_to_aten(graph, result.plans)
    for op, count in lowered.items():
        result.changed = True
        what = {"gemm": "mm / addmm / _scaled_mm + epilogue", "attention": "repeat_kv + SDPA"}.get(op, "ATen")
        result.notes.append(f"{count} rubin.{op} node(s) bound to torch / reference lowered back to ATen "
                            f"({what}), so Inductor fuses and tunes them itself")
    if not result.plans:
        result.notes.append(f"no canonical node to bind (target {target.name})")
    return result


def _lower_to_aten(graph: torch.fx.Graph, plans: list[KernelPlan]) -> dict[str, int]:
    """Replace the canonical nodes whose kernel is plain ATen (``KERNELS_LOWERED_TO_ATEN``) by their op's ATen
    form (``ATEN_FORMS``); return how many per op."""
    from torch._inductor.pattern_matcher import CallFunctionVarArgs, Match, MatchContext

    by_name = {pl.node: pl for pl in plans}
    counts: dict[str, int] = {}
    for node in list(graph.nodes):
        plan = by_name.get(node.name)
        form = ATEN_FORMS.get(node.target)
        if form is None or plan is None or plan.kernel not in KERNELS_LOWERED_TO_ATEN:
            continue
        args = bound_arguments(node)
        tensors = [n for n, v in args.items() if isinstance(v, torch.fx.Node)]
        consts = {n: v for n, v in args.items() if n not in tensors and n != "impl"}

        def aten_form(*values: torch.Tensor, tensors=tensors, consts=consts, form=form) -> torch.Tensor:
            return form(**consts, **dict(zip(tensors, values)))

        # One node is the whole "pattern": a Match over it lets the pattern matcher trace the ATen form
        # with the node's fake values and splice it in (meta, users and erasure handled there).
        pattern = CallFunctionVarArgs(node.target)
        match = Match(MatchContext([pattern], {pattern: node}, graph=graph), pattern, node.args, node.kwargs)
        match.nodes = [node]
        match.replace_by_example(aten_form, [args[n] for n in tensors])
        plan.lowered = "aten"
        op = op_name(node)
        counts[op] = counts.get(op, 0) + 1
    return counts
