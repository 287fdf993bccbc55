"""Locality domains: SM partitions with their own streams, and the weight shards each one reads.

A ``Domains`` object is what the split-N MoE (``passes/place_locality.py``, kernels/triton/moe.py) runs on:
one stream per domain, each confined to its domain's SMs, and, where the GPU has HBM locality domains,
an allocator for each domain's memory. It is built for the machine the graph runs on:

* **sm_107 (Rubin, CUDA 13.4)**: FlashInfer's locality-domain support,
  ``flashinfer.locality_domain.get_localized_domains(device, sm_split="strict" | "backfill")``: its green
  contexts are the HBM domains, and its ``empty(domain, ...)`` places a weight shard in that domain's memory.
* **other GPUs (sm_90 here)**: green contexts that split the SMs evenly (groups in multiples of 8 on sm_90);
  ``"default"`` leaves the remainder idle, ``"backfill"`` gives it to the last domain so every SM is used.
  Memory is uniform there, so shards are views of the weights (no copy, no extra memory).
* **CPU** (and the Triton interpreter): one domain, the current stream.

Streams come from ``cuGreenCtxStreamCreate`` (cuda-python), which keep their SM partition when a CUDA graph
captures them; a context switch (``cuCtxSetCurrent`` on a green context) would not. Hand-rolled rather than
``flashinfer.green_ctx.split_device_green_ctx``, which makes the same driver calls, because that would
make FlashInfer (and its JIT machinery) a requirement on GPUs where no FlashInfer kernel is used.

``plan(target, mode, n)`` answers, without a GPU, what a target's domains would be (for plans and reports:
``RUBIN_TARGET=sm107`` shows two domains of 106 SMs in backfill mode and 100 in strict mode).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from rubin_compile import target as target_mod
from rubin_compile.errors import RubinError
from rubin_compile.ops.weights import VersionedCache
from rubin_compile.target import Target, locality_mode

SM_GRANULARITY_SM90 = 8  # cuDevSmResourceSplitByCount: groups of a multiple of 8 SMs on sm_90 and newer


class LocalityError(RubinError, RuntimeError):
    """Locality domains cannot be made on this machine (the message says why and what to do)."""


# ------------------------------------------------------------------------------------------------
# split-N: each domain's share of a GEMM's output columns (the placement itself: ops/registry.py Placement)
# ------------------------------------------------------------------------------------------------

SPLIT_N_ALIGN = 128  # each domain's share of I and of H is a multiple of this (FP8 scale blocks, tiles)


def split_bounds(n: int, parts: int, align: int = SPLIT_N_ALIGN) -> Optional[list[tuple[int, int]]]:
    """``parts`` contiguous ranges covering [0, n), each a multiple of ``align`` long (the last takes the
    rest); None when ``n`` cannot give every part at least ``align``."""
    share = (n // parts) // align * align
    if share < align or n % align:
        return None
    return [(d * share, (d + 1) * share if d < parts - 1 else n) for d in range(parts)]


def split_n_unsupported(T: Optional[int], I: int, H: int, parts: int, block_shape) -> Optional[str]:
    """Why a call cannot run split-N over ``parts`` domains (None when it can)."""
    if parts < 2:
        return f"{parts} domain(s): nothing to split"
    for name, n in (("I", I), ("H", H)):
        if split_bounds(n, parts) is None:
            return f"{name}={n} does not split into {parts} shares of a multiple of {SPLIT_N_ALIGN}"
    if block_shape is not None and (SPLIT_N_ALIGN % int(block_shape[0]) or I % int(block_shape[0])):
        return f"block scales of {list(block_shape)} do not align with the {SPLIT_N_ALIGN}-row shards"
    return None


@dataclass(frozen=True)
class DomainPlan:
    """What a target's domains are, as data (no GPU needed)."""

    count: int
    mode: str  # "default" | "backfill"
    sm_counts: tuple[int, ...]
    idle_sms: int
    localized_memory: bool  # HBM locality domains (sm_107): shards live in their domain's memory
    source: str  # where the split comes from, for reports

    def describe(self) -> str:
        mem = "localised memory" if self.localized_memory else "memory un-localised"
        idle = f", {self.idle_sms} SMs idle" if self.idle_sms else ""
        return (
            f"{self.count} domains x {'/'.join(map(str, self.sm_counts))} SMs ({self.mode}{idle}; {mem}; {self.source})"
        )


def plan(target: Target, mode: str = "backfill", count: Optional[int] = None) -> DomainPlan:
    """The domains ``target`` would run with in ``mode`` (``count``: how many; default the target's
    locality-domain count, else 2)."""
    mode = locality_mode(mode)
    if not target.is_cuda:
        return DomainPlan(1, mode, (0,), 0, False, "CPU: one domain, the current stream")
    ld = target.locality_domains
    if ld is not None and (count is None or count == ld.count):
        counts = ld.backfill if mode == "backfill" else ld.strict
        return DomainPlan(
            len(counts),
            mode,
            tuple(counts),
            target.sm_count - sum(counts),
            True,
            "HBM locality domains (FlashInfer locality_domain, CUDA 13.4)",
        )
    n = count if count is not None else (ld.count if ld is not None else 2)
    if n < 1:
        raise ValueError(f"locality domains: count must be >= 1, got {n}")
    counts = green_context_split(target.sm_count, n, mode)
    return DomainPlan(
        n,
        mode,
        counts,
        target.sm_count - sum(counts),
        False,
        "green contexts (SM partitions)" + (" not matching the HBM domains" if ld is not None else ""),
    )


def green_context_split(sm_count: int, n: int, mode: str, granularity: int = SM_GRANULARITY_SM90) -> tuple[int, ...]:
    """SMs per green-context domain: an even share rounded down to the granularity; in backfill mode the
    last domain also takes the remainder (so every SM is used)."""
    share = (sm_count // n) // granularity * granularity
    if share < granularity:
        raise ValueError(f"cannot split {sm_count} SMs into {n} green-context domains of at least {granularity}")
    counts = [share] * n
    if locality_mode(mode) == "backfill":
        counts[-1] += sm_count - share * n
    return tuple(counts)


@dataclass
class Domains:
    """Live domains on one device: streams (``None``: the current stream) and SM counts."""

    plan: DomainPlan
    device: torch.device
    streams: tuple[Optional[torch.cuda.Stream], ...]
    _allocator: Any = None  # sm_107: FlashInfer LocalizedDomains (empty(domain, shape, dtype))
    _events: list = field(default_factory=list, repr=False)
    _keep: list = field(default_factory=list, repr=False)  # green contexts: alive as long as their streams

    @property
    def count(self) -> int:
        return self.plan.count

    def empty(self, domain: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor in ``domain``'s memory (uniform memory: a plain allocation)."""
        if self._allocator is not None:
            return self._allocator.empty(domain, tuple(shape), dtype)
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def events(self, n: int) -> list:
        """``n`` reusable CUDA events (a wait binds to the record issued before it, so reuse across calls
        and inside CUDA-graph capture is safe)."""
        while len(self._events) < n:
            self._events.append(torch.cuda.Event())
        return self._events[:n]


def sequential(count: int, device: torch.device, localized_memory: bool = False) -> Domains:
    """``count`` domains that all run on the current stream, one after another: the split-N form without
    its concurrency (the Triton interpreter, CPU tests). ``localized_memory`` makes shards copies, as on
    sm_107, so a test can check that path too."""
    p = DomainPlan(count, "default", (0,) * count, 0, localized_memory, "sequential (one stream)")
    return Domains(p, device, (None,) * count)


_LIVE: dict[tuple[str, int, str, int], Domains] = {}
_LOCK = threading.Lock()


def get(device: torch.device, mode: str, count: int) -> Domains:
    """The (cached) ``Domains`` of ``device`` in ``mode`` with ``count`` domains."""
    mode = locality_mode(mode)
    key = (device.type, device.index if device.index is not None else 0, mode, count)
    with _LOCK:
        dom = _LIVE.get(key)
        if dom is None:
            dom = _create(device, mode, count)
            _LIVE[key] = dom
    return dom


def _create(device: torch.device, mode: str, count: int) -> Domains:
    if device.type != "cuda":
        return Domains(DomainPlan(1, mode, (0,), 0, False, "CPU: one domain, the current stream"), device, (None,))
    index = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device("cuda", index)
    here = target_mod.detect(index)
    if here.locality_domains is not None and count == here.locality_domains.count:
        return _flashinfer_domains(device, mode, here)
    return _green_context_domains(device, mode, count, here)


def _flashinfer_domains(device: torch.device, mode: str, here: Target) -> Domains:
    try:
        from flashinfer.locality_domain import get_localized_domains
    except ImportError as exc:
        raise LocalityError(
            f"{here.name} has HBM locality domains, which rubin places through FlashInfer >= 0.7.2 "
            f"(flashinfer.locality_domain), and it cannot be imported: {exc}. Install flashinfer-python, or "
            "compile with options={'locality': 'off'}."
        ) from exc
    ld = get_localized_domains(device, sm_split="strict" if mode == "default" else "backfill")
    p = DomainPlan(
        ld.domain_count,
        mode,
        tuple(ld.sm_counts),
        ld.remainder_sm_count,
        True,
        "HBM locality domains (FlashInfer locality_domain)",
    )
    return Domains(p, device, tuple(ld.streams), _allocator=ld)


def _check(result: tuple, what: str) -> Any:
    err, *rest = result
    if int(err) != 0:
        raise LocalityError(f"{what} failed: {err!r}")
    return rest[0] if len(rest) == 1 else tuple(rest)


def _green_context_domains(device: torch.device, mode: str, count: int, here: Target) -> Domains:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise LocalityError(
            "locality domains on this GPU are green contexts, made with cuda-python (cuda.bindings), which is "
            f"not installed ({exc}); pip install cuda-python, or compile with options={{'locality': 'off'}}"
        ) from exc
    torch.cuda.init()
    total = torch.cuda.get_device_properties(device).multi_processor_count
    counts = green_context_split(total, count, mode)
    cu_dev = _check(driver.cuDeviceGet(device.index), "cuDeviceGet")
    resource = _check(
        driver.cuDeviceGetDevResource(cu_dev, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM),
        "cuDeviceGetDevResource(SM)",
    )
    # One split of the whole device: cuDevSmResourceSplitByCount returns disjoint groups of the even
    # share and what is left (two independent GreenContext.create calls overlap: seen on the H200, torch 2.11). In
    # backfill mode the last domain is "what is left": the share plus the remainder.
    backfill = counts[-1] != counts[0]
    got, _, rest = _check(
        driver.cuDevSmResourceSplitByCount(count - 1 if backfill else count, resource, 0, counts[0]),
        "cuDevSmResourceSplitByCount",
    )
    groups = list(got)[: count - 1 if backfill else count] + ([rest] if backfill else [])
    streams, keep, actual = [], [], []
    for group in groups:
        desc = _check(driver.cuDevResourceGenerateDesc([group], 1), "cuDevResourceGenerateDesc")
        gctx = _check(
            driver.cuGreenCtxCreate(desc, cu_dev, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM),
            "cuGreenCtxCreate",
        )
        stream = _check(
            driver.cuGreenCtxStreamCreate(gctx, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, 0),
            "cuGreenCtxStreamCreate",
        )
        keep += [gctx, stream]
        streams.append(torch.cuda.ExternalStream(int(stream), device=device))
        actual.append(int(group.sm.smCount))
    p = DomainPlan(count, mode, tuple(actual), total - sum(actual), False, "green contexts (cuGreenCtxStreamCreate)")
    return Domains(p, device, tuple(streams), _keep=keep)


# ------------------------------------------------------------------------------------------------
# weight shards: made once per weight, never per call
# ------------------------------------------------------------------------------------------------

_SHARDS = VersionedCache()
SHARD_STATS = _SHARDS.stats


def shards(
    weight: Optional[torch.Tensor], dom: Domains, kind: str, bounds: Sequence[tuple[int, int]], up: int = 0
) -> Optional[tuple[torch.Tensor, ...]]:
    """Each domain's rows of ``weight`` ([E, N, K] or a matching bias / scale tensor, rows on dim 1).

    ``bounds[d] = (lo, hi)``: domain ``d``'s rows. ``up`` > 0 (FC1): the rows ``[up + lo, up + hi)`` (the up
    projection's) go with them. With localised memory each shard is copied once into its domain's memory
    and reused while ``weight`` is the same live tensor at the same ``_version`` (an in-place update makes
    new shards; ops/weights.py:VersionedCache); with uniform memory a shard is a view into ``weight`` (no
    copy) and FC1 reads the up rows at their place in the full tensor.
    """
    if weight is None or weight.dim() < 2:
        return None
    if not dom.plan.localized_memory:
        return tuple(weight[:, lo:] for lo, _ in bounds)  # the kernels bound the row count themselves

    def make() -> tuple[torch.Tensor, ...]:
        out = []
        for d, (lo, hi) in enumerate(bounds):
            rows = weight[:, lo:hi] if not up else torch.cat([weight[:, lo:hi], weight[:, up + lo : up + hi]], dim=1)
            shard = dom.empty(d, rows.shape, rows.dtype)
            shard.copy_(rows)
            out.append(shard)
        return tuple(out)

    return _SHARDS.get((weight,), (kind, tuple(bounds), up, id(dom)), make)
