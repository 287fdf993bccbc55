"""The ``rubin`` torch.compile backend: Inductor, with the rubin pass pipeline as its post-grad pass.

``torch.compile(model, backend="rubin", options={...}, mode=...)`` works without importing this package
(entry point ``torch_dynamo_backends``). Whatever the pipeline does not rewrite, Inductor compiles as it
always does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from rubin_compile.integrations.vllm.engine import VllmEngine
from rubin_compile.options import RubinOptions
from rubin_compile.passes.manager import PassManager


def inductor_config_patches(options: RubinOptions, mode: Optional[str]) -> dict[str, Any]:
    """The Inductor settings of one compile: the mode's (as backend="inductor" takes it), the user's
    ``options["inductor"]``, and our post-grad pass."""
    from torch._inductor import list_mode_options

    patches: dict[str, Any] = dict(list_mode_options(mode)) if mode not in (None, "default") else {}
    if options.cudagraphs:
        # Inductor's own CUDA graphs (cudagraph trees), as mode="reduce-overhead" turns on: our kernels, their
        # PDL edges and the locality domains' streams are captured inside the graph with everything else.
        patches["triton.cudagraphs"] = True
    patches.update(options.inductor)
    # vLLM's backend route hands us its graphs through torch.compile too: the adapter asks vLLM about a layer only
    # when a graph holds vLLM's ops, so standalone compiles never import it.
    ours = PassManager(options, source="backend", engine=VllmEngine(route="backend"))
    theirs = patches.get("post_grad_custom_post_pass", torch._inductor.config.post_grad_custom_post_pass)
    patches["post_grad_custom_post_pass"] = ours if theirs is None else _Chain((theirs, ours))
    if options.dump_dir:
        # A cache hit would skip our pass and write no dump: a user who asks for dumps gets a real compile.
        patches["fx_graph_cache"] = False
    return patches


def rubin_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: Optional[Mapping[str, Any]] = None,
    mode: Optional[str] = None,
) -> Callable:
    """Compile ``gm`` with Inductor plus the rubin pipeline; ``options`` as in ``RubinOptions``."""
    from torch._inductor.compile_fx import compile_fx

    opts = with_mode(RubinOptions.resolve(options), mode)
    return compile_fx(gm, example_inputs, config_patches=inductor_config_patches(opts, mode))


def with_mode(options: RubinOptions, mode: Optional[str]) -> RubinOptions:
    """``options`` with what ``mode`` implies: "reduce-overhead" and "max-autotune" run under CUDA graphs."""
    from torch._inductor import list_mode_options

    if mode not in (None, "default") and list_mode_options(mode).get("triton.cudagraphs") and not options.cudagraphs:
        return dataclasses.replace(options, cudagraphs=True)
    return options


class _Chain(torch._inductor.custom_graph_pass.CustomGraphPass):
    """A user's own post-grad pass followed by ours (torch 2.11 takes only one pass object)."""

    def __init__(self, passes: tuple) -> None:
        self.passes = passes

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> Any:
        keys = tuple(p.uuid() if hasattr(p, "uuid") else None for p in self.passes)
        return None if None in keys else keys  # None: a pass without a uuid makes the graph uncacheable


def register() -> None:
    """Make ``backend="rubin"`` known to Dynamo when the package is used without being installed
    (e.g. from ``PYTHONPATH``); an installed package is found through its entry point instead, and
    registering it twice would be an error."""
    from importlib.metadata import entry_points

    from torch._dynamo.backends import registry

    if entry_points(group="torch_dynamo_backends", name="rubin"):
        return
    if "rubin" not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=rubin_backend, name="rubin")
