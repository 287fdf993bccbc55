"""Launching our Triton kernels at a low host cost, and the host-side integer helpers the adapters use.

Why this is hand-rolled: Triton's ``kernel[grid](*args)`` (``JITFunction.run``) binds and specialises every
argument on every call, looks the compiled binary up, checks the kernel's globals, then calls the binary's launcher.
For our kernels of 10-50 arguments that cost 40-50 us a launch on the H200 (Triton 3.6; ``benchmarks/host_cost.py``,
2026-12-03), where Inductor's own launches cost about 10 us: Inductor binds each binary once and launches it with its
static launcher (``torch._inductor.runtime.static_triton_launcher``, internal to torch, without PDL launches). Outside
CUDA graphs a decode step pays the launch cost of every kernel (issue 16: six of ours a layer), so rubin's kernels,
though faster on the GPU, made the uncaptured step slower than Inductor's.

``launcher(fn)[grid](*args, **kwargs)`` does what ``fn[grid](*args, **kwargs)`` does, with the binary bound once per
*key*: the first call of a key runs Triton's own path (which finds or compiles the binary and launches it) and keeps
the ``CompiledKernel`` it returns; later calls of that key call its launcher directly, the way ``JITFunction.run``
ends (``kernel.run(grid..., stream, function, packed_metadata, launch_metadata, hooks, *bound_args)``, the same in
Triton 3.6 through 3.9).

The key is finer than Triton's specialisation, never coarser, so a bound binary is always the one Triton would pick:
each tensor argument's dtype and whether its address is 16-byte aligned (what Triton specialises pointers on), each
int / bool / None / str by value (Triton specialises ints on 1, on divisibility by 16 and on 32 / 64 bits), floats by
type (not specialised), every keyword argument (constexprs and launch options: ``num_warps``, ``launch_pdl``, ...)
by value, and the current device. What the key cannot hold takes Triton's path on every call: a tensor passed by
keyword, a tuple argument, an unhashable value, a callable grid. So does everything when Triton's interpreter runs
(``TRITON_INTERPRET=1``), when a launch hook is set (a non-empty hook chain: profilers such as proton use them), and on a Triton without this
launcher convention (below 3.6). Not repeated on the fast path: Triton's check that the globals a kernel reads have
not changed since it was compiled (ours read module constants only) and its ``debug`` / instrumentation knobs
(part of the key Triton computes; changing them at run time needs a new process).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, Optional

import torch

from rubin_compile.kernels.triton.pdl import INTERPRET as _INTERPRET

_MAX_KEYS = 4096  # bound binaries per kernel before the cache starts again (a guard against unbounded keys)

# While passes/inline_kernels.py traces an adapter into the graph: the launches recorded there (None: not tracing).
_recording: Optional[list[str]] = None


@contextlib.contextmanager
def into_graph() -> Iterator[list[str]]:
    """While active, every ``launcher(fn)[grid](...)`` is recorded into the graph being traced (make_fx) through
    ``torch.library.wrap_triton`` instead of launched: Inductor then generates the launch itself, as for its own
    kernels (passes/inline_kernels.py). Yields the names of the kernels recorded so far."""
    global _recording
    outer, _recording = _recording, []
    try:
        yield _recording
    finally:
        _recording = outer


def tracing_into_graph() -> bool:
    """Whether launches are being recorded into a traced graph (``into_graph``) rather than launched."""
    return _recording is not None


def aligned16(t: torch.Tensor) -> bool:
    """Whether ``t``'s first element is 16-byte aligned. For a fake tensor (an adapter traced into the graph) its
    storage offset decides: storages are allocated aligned, and Inductor copies a graph input that is not
    (``copy_misaligned_inputs``)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(t, FakeTensor):
        return (t.storage_offset() * t.element_size()) % 16 == 0
    return t.data_ptr() % 16 == 0


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints on the host (``triton.cdiv`` is a constexpr function in Triton 3.9, ~4 us a call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` on the host, as ``triton.next_power_of_2`` (0 for 0)."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


try:  # what Triton's NVIDIA driver and Inductor's generated code call: no Stream object made per launch
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except ImportError:  # pragma: no cover - a torch without CUDA bindings never takes the fast path

    def _raw_stream(device: int) -> int:
        """The current CUDA stream's handle, as Triton's driver reads it (``get_current_stream``)."""
        return torch.cuda.current_stream(device).cuda_stream


def no_hooks(*hooks: Any) -> bool:
    """Whether no launch hook is set: each is ``None`` or an empty ``knobs.HookChain`` (Triton 3.6+ keeps the hooks
    in chains, empty by default). The fast path then passes ``None`` for the hooks and the launch metadata, as
    Triton's launcher skips them."""
    return all(h is None or (hasattr(h, "calls") and not h.calls) for h in hooks)


def _runtime_knobs() -> Optional[Any]:
    """Triton's ``knobs.runtime`` (where the launch hooks live) when the fast path can run here, else ``None``."""
    if _INTERPRET or not torch.cuda.is_available():
        return None
    try:
        import triton
        from triton import knobs  # Triton >= 3.4
    except ImportError:  # pragma: no cover - depends on the installed Triton
        return None
    major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    return knobs.runtime if (major, minor) >= (3, 6) else None


class Launcher:
    """``fn`` (a ``@triton.jit`` function) launched with its binary bound once per key (see the module docstring).

    ``hits`` / ``misses`` count the launches that took the bound binary and those that took Triton's path."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self._names = tuple(getattr(fn, "arg_names", ()))
        sig = getattr(fn, "signature", None)
        self._defaults = (
            {n: p.default for n, p in sig.parameters.items() if p.default is not p.empty} if sig is not None else {}
        )
        self._bound: dict[tuple, tuple] = {}
        self._runtime = None  # decided on the first launch (needs CUDA initialised): Triton's knobs.runtime, or False
        self.hits = self.misses = 0

    def __getitem__(self, grid) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def key(self, args: tuple, kwargs: dict, device: int) -> Optional[tuple]:
        """The bound binary's key for these arguments on CUDA device ``device``, or ``None`` when the call must take
        Triton's path."""
        parts = []
        for a in args:
            if isinstance(a, torch.Tensor):
                parts.append((a.dtype, not a.data_ptr() & 15))
            elif type(a) is float:
                parts.append(float)
            elif a is None or type(a) in (int, bool, str):
                parts.append(a)
            else:  # a tuple, a constexpr object, ...: not keyed here
                return None
        kw = tuple(kwargs.items())
        if any(isinstance(v, torch.Tensor) for _, v in kw):
            return None
        try:
            hash(kw)
        except TypeError:
            return None
        return (device, tuple(parts), kw)

    def tail(self, n_args: int, kwargs: dict) -> Optional[tuple]:
        """The values of the parameters after the first ``n_args``, as ``JITFunction.run`` binds them (the keyword,
        else the parameter's default); ``None`` when one has neither."""
        rest = self._names[n_args:]
        if any(n not in kwargs and n not in self._defaults for n in rest):
            return None
        return tuple(kwargs[n] if n in kwargs else self._defaults[n] for n in rest)

    def launch(self, grid, args: tuple, kwargs: dict) -> None:
        if _recording is not None:
            self.record(grid, args, kwargs)
            return
        runtime = self._runtime
        if runtime is None:
            runtime = self._runtime = (bool(self._names) and _runtime_knobs()) or False
        key = None
        if runtime and not callable(grid) and no_hooks(runtime.launch_enter_hook, runtime.launch_exit_hook):
            key = self.key(args, kwargs, torch.cuda.current_device())
        if key is not None:
            bound = self._bound.get(key)
            if bound is not None:
                run, function, packed, tail = bound
                g1 = grid[1] if len(grid) > 1 else 1
                g2 = grid[2] if len(grid) > 2 else 1
                try:
                    run(grid[0], g1, g2, _raw_stream(key[0]), function, packed, None, None, None, *args, *tail)
                except TypeError as exc:  # the launcher refused the arguments before launching: Triton's path from now
                    self._runtime, key = False, None
                    self._bound.clear()
                    warnings.warn(
                        f"rubin: {self.fn}: bound launch refused ({exc}); using Triton's launch path", stacklevel=3
                    )
                else:
                    self.hits += 1
                    return
        self.misses += 1
        kernel = self.fn[grid](*args, **kwargs)  # Triton's own path: finds or compiles the binary, and launches it
        if key is None or kernel is None or hasattr(kernel, "result"):
            return
        tail = self.tail(len(args), kwargs)
        if tail is None:
            return
        if len(self._bound) >= _MAX_KEYS:
            self._bound.clear()
        self._bound[key] = (kernel.run, kernel.function, kernel.packed_metadata, tail)

    def record(self, grid, args: tuple, kwargs: dict) -> None:
        """Record the launch into the graph being traced (``into_graph``). ``launch_pdl`` is dropped: Inductor's
        launcher takes no PDL launch, and inline_kernels traces only nodes chain_pdl launches without it (their
        ``gdc_wait`` is then a no-op)."""
        from torch.library import wrap_triton

        if getattr(self.fn, "is_gluon", lambda: False)():
            # wrap_triton traces @triton.jit kernels; a Gluon one (host-side TMA descriptors among its arguments)
            # leaves its adapter an op call, with this reason in the plan
            raise NotImplementedError(
                f"{getattr(self.fn, '__name__', self.fn)} is a Gluon kernel (wrap_triton traces Triton ones)"
            )
        options = {k: v for k, v in kwargs.items() if k != "launch_pdl"}
        wrap_triton(self.fn)[tuple(grid)](*args, **options)
        _recording.append(getattr(self.fn, "__name__", str(self.fn)))


_LAUNCHERS: dict[int, Launcher] = {}


def launcher(fn: Any) -> Launcher:
    """The ``Launcher`` of ``fn`` (one per kernel, made on first use)."""
    found = _LAUNCHERS.get(id(fn))
    if found is None or found.fn is not fn:
        found = _LAUNCHERS[id(fn)] = Launcher(fn)
    return found
