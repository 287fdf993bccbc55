"""``torch.ops.rubin.stacked_weights``: per-expert weights concatenated once, not on every call.

A MoE written as a loop over expert modules keeps each expert's weights in its own parameters, while
``rubin.moe`` takes them stacked ([E, 2I, H] and [E, H, I]). Concatenating them in the graph would copy
every expert's weights on every call: on a GPU at decode that is twice the bytes of the loop it replaces
(which reads each weight once), so the rewrite would make the model slower. This op returns
``torch.cat(parts)`` and keeps the result for the next call as long as every part is the same tensor,
unchanged (same object, alive, same ``_version``, so an in-place update such as ``load_state_dict``
invalidates it). The price is one stacked copy of those weights kept in memory; the rewrite's report says
how many bytes.

Schema::

    rubin::stacked_weights(Tensor[] parts) -> Tensor        # torch.cat(parts, dim=0)

Why hand-rolled: Inductor's constant folding would do this only with ``freezing`` on (parameters as
constants), which is off by default and runs before post-grad passes, where the rewrite inserts the cat.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

# id(part) for every part -> (weak references to the parts, their versions, the concatenation)
_CACHE: dict[tuple[int, ...], tuple[tuple[weakref.ref, ...], tuple[int, ...], torch.Tensor]] = {}
_STATS = {"hits": 0, "misses": 0}


def _prune() -> None:
    for key in [k for k, (refs, _, _) in _CACHE.items() if any(r() is None for r in refs)]:
        del _CACHE[key]


@torch.library.custom_op("rubin::stacked_weights", mutates_args=())
def stacked_weights(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``, reused across calls while the parts are the same, unchanged tensors."""
    key = tuple(id(p) for p in parts)
    entry = _CACHE.get(key)
    versions = tuple(p._version for p in parts)
    if entry is not None:
        refs, seen, value = entry
        if all(r() is p for r, p in zip(refs, parts)) and seen == versions:
            _STATS["hits"] += 1
            return value
    _STATS["misses"] += 1
    _prune()
    value = torch.cat(parts, dim=0)
    try:
        _CACHE[key] = (tuple(weakref.ref(p) for p in parts), versions, value)
    except TypeError:  # a part that cannot be weakly referenced: no reuse, still correct
        pass
    return value


@stacked_weights.register_fake
def _stacked_weights_fake(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts, dim=0)


def cache_info() -> dict[str, Any]:
    """Hits, misses, entries and bytes held (for tests and reports)."""
    return {**_STATS, "entries": len(_CACHE),
            "bytes": sum(v.numel() * v.element_size() for _, _, v in _CACHE.values())}


def clear_cache() -> None:
    _CACHE.clear()
