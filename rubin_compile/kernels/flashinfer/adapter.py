"""What an adapter from a canonical op to one FlashInfer entry point is, and how it runs.

An adapter turns the op's argument dataclass (``MoEArgs``, ``GemmArgs``, ``AttentionArgs``) into one call of a
FlashInfer function. It has three parts, kept apart so that the call can be built and checked without a GPU:

* ``prepare(args) -> dict[str, Tensor]``: the weights in the layout the entry point wants (shuffles,
  interleaving, scale-factor swizzles, stacking). It depends on the weights only, so it runs once per weight
  tensors and is kept (``PREPARED``, a ``VersionedCache`` like ``rubin.stacked_weights``: an in-place update of
  a weight makes it again). ``prepared_bytes(args)`` is the memory it keeps, for the report.
* ``call(args, prepared, launch) -> Call``: the function's dotted path, its positional and keyword arguments
  (``enable_pdl`` from ``launch.pdl`` where the function takes it) and ``finish``, which turns FlashInfer's result
  into the canonical op's result (layout, dtype, the slice of padded output).
* ``check(call) -> None``: what the FlashInfer function requires of those arguments beyond its signature (the
  dtypes and shapes its docstring and its own checks name), raised as ``AdapterCheckError``. It runs on meta
  tensors: tests/cpu/kernels/test_flashinfer_*.py build every call of the sm_100 / sm_107 plans of the example
  models on meta tensors, bind it against the installed function's signature (``bind``) and check it.

``run(adapter, args, launch)`` is what the kernel's ``run`` does on a GPU: prepare (cached), call, check,
invoke, finish. ``ADAPTERS`` maps ``(op, kernel, quant)`` to the adapter that runs it; tables.py's entry points
without one stay plans only, and selection says so.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from rubin_compile.errors import RubinError
from rubin_compile.kernels.flashinfer.tables import resolve
from rubin_compile.ops.attention import AttentionArgs
from rubin_compile.ops.gemm import GemmArgs, scale_kind
from rubin_compile.ops.moe import MoEArgs
from rubin_compile.ops.nodes import bound_arguments
from rubin_compile.ops.registry import KernelSpec, Launch
from rubin_compile.ops.weights import VersionedCache, made_outside_cudagraph_pools
from rubin_compile.target import Target


class AdapterCheckError(RubinError, ValueError):
    """The arguments an adapter built do not meet what the FlashInfer function requires."""


@dataclass
class Call:
    """One call of a FlashInfer function: ``resolve(function)(*args, **kwargs)``, then ``finish`` on its result."""

    function: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    finish: Callable[[Any], torch.Tensor] = lambda out: out

    def bound(self) -> inspect.BoundArguments:
        """The call bound to the installed function's signature, defaults applied (``TypeError`` if it does not
        bind: a parameter renamed or removed in FlashInfer)."""

        bound = inspect.signature(resolve(self.function)).bind(*self.args, **self.kwargs)
        bound.apply_defaults()
        return bound


class Adapter:
    """Base class; subclasses set ``name`` (shown in the plan) and ``function`` (the FlashInfer function the call
    names, dotted) and override ``call`` and, where the entry point needs another weight layout, ``sources`` /
    ``prepare`` / ``prepared_bytes``."""

    name: str = ""
    function: str = ""
    # more FlashInfer functions the call may name (e.g. a decode and a prefill entry point chosen per call)
    functions: tuple[str, ...] = ()
    # GPUs where this adapter's GPU tests ran and passed against the op's reference (docs/kernels/selection.md's
    # marks; benchmarks/results/flashinfer-h200.log holds the run)
    tested_on: tuple[str, ...] = ()

    def supports(self, target: Target, spec: KernelSpec) -> Optional[str]:
        """Limits of this adapter beyond the entry point's rule (e.g. a layout it cannot build); ``None`` if none."""
        return None

    def sources(self, args: Any) -> Sequence[torch.Tensor]:
        """The tensors ``prepare`` reads (the cache key); ``()``: nothing to prepare."""
        return ()

    def prepare(self, args: Any) -> dict[str, torch.Tensor]:
        return {}

    def prepared_bytes(self, args: Any) -> int:
        """Bytes ``prepare`` keeps for ``args`` (what the report shows)."""
        return 0

    def call(self, args: Any, prepared: dict[str, torch.Tensor], launch: Launch) -> Call:
        raise NotImplementedError

    def check(self, call: Call) -> None:
        """Raise ``AdapterCheckError`` where ``call`` breaks a requirement of the function."""


ADAPTERS: dict[tuple[str, str, str], Adapter] = {}


def register(op: str, kernel: str, *quants: str) -> Callable[[Adapter], Adapter]:
    """Class decorator: an instance of the adapter runs ``op`` on ``kernel`` for each of ``quants``."""

    def add(cls):
        adapter = cls() if isinstance(cls, type) else cls
        for quant in quants:
            key = (op, kernel, quant)
            if key in ADAPTERS and type(ADAPTERS[key]).__module__ != type(adapter).__module__:
                raise ValueError(f"two adapters for {key}: {ADAPTERS[key].name!r} and {adapter.name!r}")
            ADAPTERS[key] = adapter
        return cls

    return add


def adapter_for(op: str, kernel: str, quant: str) -> Optional[Adapter]:
    return ADAPTERS.get((op, kernel, quant))


# ------------------------------------------------------------------------------------------------
# the quantisation of a call (the same classification as the ops' spec builders, on real tensors)
# ------------------------------------------------------------------------------------------------

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp4_kind(scale: Optional[torch.Tensor]) -> str:
    """``"nvfp4"`` (e4m3 scales per 16 elements) or ``"mxfp4"`` (E8M0 exponents, uint8, per 32) for packed FP4
    weights with ``scale``."""
    return "nvfp4" if scale is not None and scale.dtype == torch.float8_e4m3fn else "mxfp4"


def quant_of(op: str, args: Any) -> str:
    """The ``KernelSpec.quant`` of a call's arguments."""
    if op == "moe":
        if args.w13.dtype == torch.uint8:
            return fp4_kind(args.w13_scale)
        if args.w13.dtype in FP8:
            return "fp8_block" if args.block_shape else "fp8_tensor"
        return "none"
    if op == "gemm":
        if args.b.dtype == torch.uint8:
            return fp4_kind(args.b_scale)
        if args.b.dtype in FP8:
            kind = scale_kind(args.b_scale, args.N, "b", args.K) if args.b_scale is not None else "tensor"
            return {"tensor": "fp8_tensor", "block": "fp8_block"}.get(kind, "fp8_rowwise")
        return "none"
    if op == "attention":
        return "fp8_tensor" if args.key.dtype in FP8 else "none"
    raise ValueError(f"unknown op {op!r}")


# ------------------------------------------------------------------------------------------------
# running
# ------------------------------------------------------------------------------------------------

PREPARED = VersionedCache()


def prepared_weights(adapter: Adapter, args: Any) -> dict[str, torch.Tensor]:
    """``adapter.prepare(args)``, made once per set of source weights and kept while they are unchanged."""
    sources = tuple(adapter.sources(args))
    if not sources:
        return {}
    if sources[0].is_meta:  # the CPU checks build calls on meta tensors: nothing to keep
        return adapter.prepare(args)
    on_gpu = sources[0].is_cuda
    make = (
        (lambda: made_outside_cudagraph_pools(lambda: adapter.prepare(args), sources[0].device))
        if on_gpu
        else (lambda: adapter.prepare(args))
    )
    return PREPARED.get(sources, adapter.name, make)


def build(adapter: Adapter, args: Any, launch: Launch) -> Call:
    """The checked call ``adapter`` makes for ``args`` (weights prepared and cached)."""
    call = adapter.call(args, prepared_weights(adapter, args), launch)
    if call.function not in (adapter.function,) + tuple(adapter.functions):
        raise AssertionError(f"{adapter.name}: call names {call.function}, adapter declares {adapter.function}")
    adapter.check(call)
    return call


def run(adapter: Adapter, args: Any, launch: Launch) -> torch.Tensor:
    call = build(adapter, args, launch)
    return call.finish(resolve(call.function)(*call.args, **call.kwargs))


def require(condition: bool, adapter: Adapter, what: str) -> None:
    """``AdapterCheckError`` naming the adapter and the requirement when ``condition`` is false."""
    if not condition:
        raise AdapterCheckError(f"{adapter.name}: {what}")


_BUFFERS: dict[tuple, torch.Tensor] = {}


def buffer(key: tuple, device: torch.device, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A long-lived buffer (a kernel's workspace, a counter array), made once per ``key`` and device and kept
    for the process; made outside cudagraph trees' pool like prepared weights. Meta devices get a fresh one."""
    if device.type == "meta":
        return make()
    full = (key, str(device))
    if full not in _BUFFERS:
        _BUFFERS[full] = made_outside_cudagraph_pools(make, device) if device.type == "cuda" else make()
    return _BUFFERS[full]


def meta_args(op: str, node: torch.fx.Node) -> Any:
    """The op's argument dataclass for a canonical ``node``, its tensors as meta tensors of the node's fake values'
    shapes, strides and dtypes: what the plan test builds calls from, and what ``prepared_bytes`` is asked with."""
    cls = {"moe": MoEArgs, "gemm": GemmArgs, "attention": AttentionArgs}[op]
    fields = {f.name for f in dataclasses.fields(cls) if f.init}

    def meta(value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            v = value.meta.get("val")
            if not isinstance(v, torch.Tensor):
                raise ValueError(f"{value.name} has no fake tensor")
            return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="meta")
        return value

    return cls(**{k: meta(v) for k, v in bound_arguments(node).items() if k in fields})


def prepared_bytes_of(op: str, kernel: str, node: torch.fx.Node) -> Optional[int]:
    """The bytes the adapter that runs ``node`` on ``kernel`` keeps prepared (its ``prepared_bytes``), or None."""
    args = meta_args(op, node)
    adapter = adapter_for(op, kernel, quant_of(op, args))
    return adapter.prepared_bytes(args) if adapter is not None else None


def cache_info() -> dict[str, Any]:
    return PREPARED.info()
