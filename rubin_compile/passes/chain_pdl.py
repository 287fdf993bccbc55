"""chain_pdl: decide, per kernel node, whether it is launched with Programmatic Dependent Launch.

PDL (sm_90 and newer) lets a kernel start while the kernel before it in the stream drains: everything it
does before ``griddepcontrol.wait`` -- index math, pulling weights that no kernel writes into L2 --
overlaps its predecessor's tail, and inside our MoE the FC1 -> FC2 boundary too. A node is launched with
PDL when all of these hold, and the report says which one failed otherwise:

* ``options.pdl`` is not ``"off"``;
* the target has PDL (``Target.pdl``: sm_90 and newer; never on sm_80 or the CPU);
* the kernel is PDL-safe: it waits before it touches anything its predecessor writes *or reads*, and its
  adapter takes the flag (``Kernel.pdl``, declared where the kernel registers: our Triton MoE kernels;
  FlashInfer entry points that take ``enable_pdl``, read from their signatures). cuBLAS / ATen calls never are;
* it pays: with ``pdl="auto"`` only when the graph runs under CUDA graphs (``mode="reduce-overhead"``,
  ``options={"cudagraphs": True}``, or, inside vLLM, what the engine adapter reads of vLLM's
  ``cudagraph_mode``: integrations/vllm/engine.py), where a PDL launch is captured as a programmatic edge. Outside graphs the host cost of the extended launch can outweigh the overlap (vLLM
  issue 40543); ``pdl="on"`` launches with PDL anyway.

The decision is the node's ``pdl`` argument (``rubin.moe(..., pdl=True)``), so the dump shows it and
Inductor's cache keys on it. Results do not change: our kernels are bitwise identical with and without
PDL (tests/gpu/test_pdl_locality.py replays graphs with fresh inputs and compares).

Inductor's own Triton kernels take part only through ``torch._inductor.config.triton.enable_pdl``, which
this pass does not set (each compile reads it; ``options={"inductor": {"triton.enable_pdl": True}}``
turns it on): Inductor decides per kernel whether to wait, from the scheduler's previous node alone. The
report records its value; docs/pdl_locality.md has the measurement behind leaving it off by default.
"""

from __future__ import annotations

from typing import Optional

import torch

from rubin_compile.ops.registry import bound_nodes
from rubin_compile.passes.base import Decision, Pass, PassContext, PassResult
from rubin_compile.passes.fx import bound_arguments, dotted_name, set_argument
from rubin_compile.target import Target

NAME = "chain_pdl"


def decide(mode: str, target: Target, kernel_unsupported: Optional[str], cudagraphs: bool) -> tuple[bool, str]:
    """(launch with PDL?, why) for one kernel node. ``kernel_unsupported``: the kernel's reason it cannot
    take PDL (None when it can)."""
    if mode == "off":
        return False, "options pdl='off'"
    if not target.pdl:
        return False, f"target {target.name} has no PDL (sm_90 and newer)"
    if kernel_unsupported is not None:
        return False, kernel_unsupported
    if mode == "on":
        return True, "options pdl='on'"
    if cudagraphs:
        return True, f"PDL-safe kernel on {target.name}, run under CUDA graphs (captured as a programmatic edge)"
    return False, (
        "pdl='auto' and the graph does not run under CUDA graphs, where a PDL launch's host cost can "
        "outweigh the overlap; compile with mode='reduce-overhead' or options cudagraphs=True, or "
        "force it with pdl='on'"
    )


def run(graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
    result = PassResult(NAME)
    mode = ctx.options.pdl
    cudagraphs, how = ctx.engine.runs_under_cudagraphs(ctx.options)
    on = 0
    for node, bound in bound_nodes(graph, ctx.target):
        kernel, spec, name = bound.kernel, bound.spec, dotted_name(node.target)
        pdl, why = decide(mode, bound.target, kernel.pdl_unsupported(spec), cudagraphs)
        if bool(bound_arguments(node)["pdl"]) != pdl:  # every canonical op's form takes pdl (tests/cpu/ops)
            set_argument(node, "pdl", pdl)
            result.changed = True
        on += pdl
        result.decisions.append(
            Decision(
                node.name,
                name,
                "pdl on" if pdl else "pdl off",
                why,
                {"kernel": kernel.name, "target": bound.target.name},
            )
        )
    if result.decisions:
        result.notes.append(f"{on} of {len(result.decisions)} kernel node(s) launched with PDL (pdl={mode!r}; {how})")
    result.notes.append(
        "Inductor's own Triton kernels: torch._inductor.config.triton.enable_pdl="
        f"{torch._inductor.config.triton.enable_pdl} (not set by rubin; see docs/pdl_locality.md)"
    )
    return result


PASS = Pass(NAME, run, reads=("options", "target", "engine"))
