"""How rubin's ops are defined in the ``rubin`` torch.library namespace: ``@op("moe")`` on the Python function.

Why not ``torch.library.custom_op``: it puts Python layers around every call (an autograd kernel in Python that
redispatches, a ``torch._disable_dynamo`` wrapper, an output-aliasing check), and a compiled graph calls our ops on
every step. Measured on this project's CPU machine (torch 2.13, ``rubin.moe``'s 21 arguments, the kernel stubbed): 14 us
per call of custom_op's layers under ``no_grad``, 4 us for the same schema defined through ``torch.library.Library``;
on the H200's host the whole dispatch of a decode op cost 58-82 us (``benchmarks/host_cost.py``). Outside CUDA graphs
a decode step pays it per op (issue 16).

``op(name)`` keeps what custom_op gave us: the schema is inferred from the function's annotations
(``torch.library.infer_schema``, the function custom_op uses), the function is the op's one implementation for every
device (``CompositeExplicitAutograd``), ``register_fake`` registers the fake (shape) implementation, and calling
the returned object calls ``torch.ops.rubin.<name>``. Our ops have no autograd formula (rubin rewrites inference
graphs only); as with custom_op, a call on inputs that require grad, with grad mode on, runs and returns outputs whose
backward raises (``RubinGradError``, naming the fix). What it leaves out: the per-call check that an output does not
alias an input (every op of ours returns tensors it made).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from rubin_compile.errors import RubinError

NAMESPACE = "rubin"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_OPS: dict[str, "RubinOp"] = {}


class RubinGradError(RubinError, RuntimeError):
    """A rubin op was called on inputs that require grad, with grad mode on: it has no backward."""


def _first_requiring_grad(values):
    for v in values:
        if isinstance(v, torch.Tensor) and v.requires_grad:
            return v
        if isinstance(v, (list, tuple)):
            found = _first_requiring_grad(v)
            if found is not None:
                return found
    return None


class _NoBackward(torch.autograd.Function):
    """Outputs of a rubin op called on inputs that require grad: they require grad, and their backward raises."""

    @staticmethod
    def forward(ctx, name: str, anchor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        ctx.op_name = name
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise RubinGradError(
            f"rubin.{ctx.op_name} has no backward: rubin compiles inference; run the model compiled with "
            "backend='rubin' under torch.no_grad() or torch.inference_mode() (a graph that computes gradients is "
            "compiled as Inductor compiles it)"
        )


def _without_backward(name: str, fn: Callable[..., Any], anchor: torch.Tensor, args: tuple, kwargs: dict) -> Any:
    with torch.no_grad():
        result = fn(*args, **kwargs)
    wrap = lambda t: _NoBackward.apply(name, anchor, t) if isinstance(t, torch.Tensor) else t  # noqa: E731
    return tuple(wrap(t) for t in result) if isinstance(result, tuple) else wrap(result)


class RubinOp:
    """An op of the ``rubin`` namespace made by ``op``: call it like the function it was made from."""

    def __init__(self, name: str, fn: Callable[..., Any]) -> None:
        self.name = name
        self.fn = fn
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    @property
    def default(self) -> torch._ops.OpOverload:
        return getattr(getattr(torch.ops, NAMESPACE), self.name).default

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.default(*args, **kwargs)

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        """Register ``fake`` as the op's fake (meta) implementation; returns it (usable as a decorator)."""
        torch.library.register_fake(f"{NAMESPACE}::{self.name}", fake, lib=_LIB)
        return fake

    def __repr__(self) -> str:
        return f"RubinOp({NAMESPACE}::{self.name})"


def op(name: str) -> Callable[[Callable[..., Any]], RubinOp]:
    """Decorator: define ``rubin::<name>`` with the decorated function's schema (no argument is mutated) and the
    function as its implementation on every device."""

    def define(fn: Callable[..., Any]) -> RubinOp:
        schema = torch.library.infer_schema(fn, mutates_args=())
        _LIB.define(f"{name}{schema}")

        def impl(*args: Any, **kwargs: Any) -> Any:
            if torch.is_grad_enabled():
                anchor = _first_requiring_grad((*args, *kwargs.values()))
                if anchor is not None:
                    return _without_backward(name, fn, anchor, args, kwargs)
            return fn(*args, **kwargs)

        _LIB.impl(name, impl, "CompositeExplicitAutograd")
        # not differentiable: autograd passes the call through (what torch's fallback asks such ops to declare)
        _LIB.impl(name, torch.library.fallthrough_kernel, "Autograd")
        made = _OPS[name] = RubinOp(name, fn)
        return made

    return define


def python_impl(target: Any) -> Optional[Callable[..., Any]]:
    """The Python function behind ``target`` (``torch.ops.rubin.<name>.default``) when it is one of ours, else
    ``None``: what passes/inline_kernels.py traces into the graph."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != NAMESPACE:
        return None
    made = _OPS.get(target._schema.name.split("::", 1)[-1])
    return made.fn if made is not None else None
