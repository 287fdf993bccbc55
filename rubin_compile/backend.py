"""The ``rubin`` torch.compile backend: Inductor, with the rubin pass pipeline as its post-grad pass.

``torch.compile(model, backend="rubin", options={...}, mode=...)`` works without importing this package
(entry point ``torch_dynamo_backends``). Whatever the pipeline does not rewrite, Inductor compiles as it
always does.

A rubin error raised while a graph compiles (a bad option, ``strict=True``) reaches the user as a
``RubinCompileError`` (``torch._dynamo.exc.BackendCompilerFailed``, which Dynamo passes through as it is) that is
also an instance of the rubin error's own class, and whose message starts with that error: ``except
RubinStrictError`` catches it, and so do ``except RubinError`` and ``except BackendCompilerFailed``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch._dynamo.exc import BackendCompilerFailed

from rubin_compile.errors import RubinError
from rubin_compile.integrations.vllm.engine import VllmEngine
from rubin_compile.options import RubinOptions
from rubin_compile.passes.manager import PassManager


def inductor_config_patches(options: RubinOptions, mode: Optional[str], gradients: bool = False) -> dict[str, Any]:
    """The Inductor settings of one compile: the mode's (as backend="inductor" takes it), the user's
    ``options["inductor"]``, and our post-grad pass (``gradients``: the compile is a training one)."""
    from torch._inductor import list_mode_options

    patches: dict[str, Any] = dict(list_mode_options(mode)) if mode not in (None, "default") else {}
    if options.cudagraphs is True:
        # Inductor's own CUDA graphs (cudagraph trees), as mode="reduce-overhead" turns on: our kernels, their
        # PDL edges and the locality domains' streams are captured inside the graph with everything else.
        # ("external": the caller captures the graph; cudagraph trees stay off.)
        patches["triton.cudagraphs"] = True
    # Inductor's shape padding (fx_passes/pad_mm.py) runs before our post-grad pass and, on a GPU, rewrites an mm
    # whose M, K or N is not a multiple of 8 into constant_pad_nd + mm + slice *where a benchmark at compile time says
    # so*: the graph match_moe / match_gemm see then depended on timing (on the H200 an expert loop of 5 tokens went
    # unmatched now and then under a loaded GPU). rubin picks GEMM kernels from its own measured tables, so the
    # padding is off unless the user sets it in options["inductor"].
    patches["shape_padding"] = False
    patches.update(options.inductor)
    # vLLM's backend route hands us its graphs through torch.compile too: the adapter asks vLLM about a layer only
    # when a graph holds vLLM's ops, so standalone compiles never import it.
    ours = PassManager(options, source="backend", engine=VllmEngine(route="backend"), gradients=gradients)
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

    try:
        opts = with_mode(RubinOptions.resolve(options), mode)
        patches = inductor_config_patches(opts, mode, computes_gradients(example_inputs))
        return compile_fx(gm, example_inputs, config_patches=patches)
    except Exception as exc:
        error = _rubin_error_in(exc)
        if error is None:
            raise
        raise compile_error(error) from exc


def computes_gradients(example_inputs: Sequence[Any]) -> bool:
    """Whether Dynamo hands us a training graph: grad mode is on and an input (the parameters are inputs) needs a
    gradient. AOTAutograd then splits it into a forward that keeps tensors for the backward, and a backward."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)


class RubinCompileError(RubinError, BackendCompilerFailed):
    """A rubin error raised while ``torch.compile`` compiled a graph with the rubin backend. The message starts
    with that error; ``inner_exception`` is it; ``compile_error`` makes the instance also one of its class."""

    def __init__(self, error: RubinError) -> None:
        # BackendCompilerFailed writes its own first line ("backend='rubin' raised:"); ours is the error itself.
        Exception.__init__(
            self,
            f"{type(error).__name__}: {error}\n(raised while compiling with backend='rubin'; "
            "the error is also this exception's inner_exception)",
        )
        self.backend_name = "rubin"
        self.inner_exception = error
        self.first_useful_frame = None


@functools.lru_cache(maxsize=None)
def _compile_error_class(cls: type) -> type:
    return type(cls.__name__, (RubinCompileError, cls), {"__module__": cls.__module__, "__doc__": cls.__doc__})


def compile_error(error: RubinError) -> RubinCompileError:
    """``error`` as the exception Dynamo passes through to the user unchanged (see the module docstring)."""
    if isinstance(error, RubinCompileError):
        return error
    return _compile_error_class(type(error))(error)


def _rubin_error_in(exc: BaseException) -> Optional[RubinError]:
    """The rubin error behind ``exc`` (Inductor wraps what a post-grad pass raises), or None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, RubinError):
            return exc
        seen.add(id(exc))
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return None


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
