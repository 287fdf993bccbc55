"""``torch.ops.rubin.stacked_weights``: per-expert weights concatenated once, not on every call.

A MoE written as a loop over expert modules keeps each expert's weights in its own parameters, while
``rubin.moe`` takes them stacked ([E, 2I, H] and [E, H, I]). Concatenating them in the graph would copy
every expert's weights on every call: on a GPU at decode that is twice the bytes of the loop it replaces
(which reads each weight once), so the rewrite would make the model slower. This op returns
``torch.cat(parts)`` and keeps the result for the next call as long as every part is the same tensor,
unchanged (same object, alive, same ``_version``, so an in-place update such as ``load_state_dict``
invalidates it; inference tensors have no ``_version``: see ``tensor_version``). The price is one stacked copy
of those weights kept in memory; the rewrite's report says how many bytes. passes/fuse_projections.py stacks the
weights (and biases) of linears that share an input the same way (q / k / v, gate / up).

On a GPU the copy is made outside cudagraph trees' memory pool (``made_outside_cudagraph_pools``): under
``mode="reduce-overhead"`` the first call is cudagraph trees' warm-up, whose allocations land in their pool, and a
cached copy alive there made the recording fail.

Schema::

    rubin::stacked_weights(Tensor[] parts) -> Tensor        # torch.cat(parts, dim=0); torch.stack for 0-d parts
                                                             # (per-expert scales)

Why hand-rolled: Inductor's constant folding would do this only with ``freezing`` on (parameters as
constants), which is off by default and runs before post-grad passes, where the rewrite inserts the cat.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from rubin_compile.ops.library import op


_INFERENCE_NOTE = (
    "rubin: weights that are inference tensors (made under torch.inference_mode()) carry no version counter, so "
    "rubin keeps what it made from them (stacked expert weights, locality-domain shards) while they are the same "
    "tensors and cannot see an in-place update of them: after changing such weights, call torch._dynamo.reset() "
    "and compile again, or build the model under torch.no_grad() instead"
)


def tensor_state(t: torch.Tensor) -> tuple:
    """What must not have changed for a value made from ``t`` to be reused: its ``_version`` (``tensor_version``) and
    its storage, dtype and shape. ``Module.to(dtype)`` and ``param.data = ...`` swap a parameter's data without a
    new object or a version bump (before: a model compiled in bf16, cast to fp32 and compiled again got the bf16
    stacked weights, and rubin.gemm refused the mixed dtypes)."""
    return (tensor_version(t), t.data_ptr(), t.dtype, tuple(t.shape), t.device)


def tensor_version(t: torch.Tensor) -> Optional[int]:
    """``t._version``, or ``None`` for an inference tensor, which has none (with a warning, which Python's
    warning filters show once)."""
    if t.is_inference():
        warnings.warn(_INFERENCE_NOTE, stacklevel=3)
        return None
    return t._version


class VersionedCache:
    """Values made from tensors, kept while every source is the same live tensor at the same ``_version``, with the
    same data (an in-place update such as ``load_state_dict``, or ``Module.to(dtype)``, makes the value again; a
    source that dies drops its entries; ``tensor_state``). Serves ``stacked_weights`` here and the locality-domain weight shards
    (runtime/locality.py). ``stats`` counts hits and misses. Inference tensors have no version: for them the
    value is kept while they are the same live tensors (``tensor_version``)."""

    def __init__(self) -> None:
        # (id of every source, key) -> (weak references to the sources, their tensor_state, the value)
        self.entries: dict[tuple, tuple[tuple[weakref.ref, ...], tuple[Optional[int], ...], Any]] = {}
        self.stats = {"hits": 0, "misses": 0}

    def get(self, sources: Sequence[torch.Tensor], key: Any, make: Callable[[], Any]) -> Any:
        """The value cached for ``sources`` and ``key``, or ``make()`` (kept for the next call)."""
        full = (tuple(id(s) for s in sources), key)
        versions = tuple(tensor_state(s) for s in sources)
        entry = self.entries.get(full)
        if entry is not None:
            refs, seen, value = entry
            if all(r() is s for r, s in zip(refs, sources)) and seen == versions:
                self.stats["hits"] += 1
                return value
        self.stats["misses"] += 1
        for k in [k for k, (refs, _, _) in self.entries.items() if any(r() is None for r in refs)]:
            del self.entries[k]
        value = make()
        try:
            self.entries[full] = (tuple(weakref.ref(s) for s in sources), versions, value)
        except TypeError:  # a source that cannot be weakly referenced: no reuse, still correct
            pass
        return value

    def info(self) -> dict[str, Any]:
        """Hits, misses, entries and bytes held (for tests and reports)."""

        def nbytes(v: Any) -> int:
            return sum(map(nbytes, v)) if isinstance(v, tuple) else v.numel() * v.element_size()

        return {
            **self.stats,
            "entries": len(self.entries),
            "bytes": sum(nbytes(v) for _, _, v in self.entries.values()),
        }


_CACHE = VersionedCache()


def made_outside_cudagraph_pools(make: Callable[[], Any], device: Optional[torch.device] = None) -> Any:
    """``make()`` in a thread of its own, for GPU values kept across calls (stacked weights, FlashInfer's prepared
    weights and workspaces). cudagraph trees route the allocations of the thread that runs a graph's warm-up into
    their memory pool (``_cuda_beginAllocateCurrentThreadToPool``); a value kept from there sits in that pool and
    makes the recording fail ("tensors in the cudagraph pool not tracked as outputs"). Another thread allocates
    from the ordinary caching allocator (its work is synchronised before the value is returned). Refused during a
    capture itself, where the copy could not be made outside the captured graph. ``device``: the CUDA device the
    value is made on (the thread's current device otherwise starts as device 0)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "rubin: weights kept across calls (stacked projections or experts, FlashInfer's prepared weights) must "
            "be made before a CUDA graph is captured; run the compiled model once outside the capture first "
            "(cudagraph trees and vLLM do this warm-up themselves)"
        )
    out: dict[str, Any] = {}

    def work() -> None:
        try:
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)
            with torch.no_grad():  # grad mode is per thread: the caller's no_grad / inference_mode is not inherited
                out["value"] = make()
            if torch.cuda.is_available():
                torch.cuda.current_stream().synchronize()
        except BaseException as exc:  # re-raised in the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=work, name="rubin-weights")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


@op("stacked_weights")
def stacked_weights(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``, reused across calls while the parts are the same, unchanged tensors (made outside
    cudagraph trees' pool on a GPU: ``made_outside_cudagraph_pools``)."""
    if parts and parts[0].is_cuda:
        return _CACHE.get(parts, None, lambda: made_outside_cudagraph_pools(lambda: _stack(parts), parts[0].device))
    return _CACHE.get(parts, None, lambda: _stack(parts))


def _stack(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(parts) if parts[0].dim() == 0 else torch.cat(parts, dim=0)


@stacked_weights.register_fake
def _stacked_weights_fake(parts: list[torch.Tensor]) -> torch.Tensor:
    return _stack(parts)


def cache_info() -> dict[str, Any]:
    """Hits, misses, entries and bytes held (for tests and reports)."""
    return _CACHE.info()


def clear_cache() -> None:
    _CACHE.entries.clear()
