"""Targets: what the passes and the kernel registry need to know about the GPU a graph is compiled for.

A target is plain data. What differs between Hopper, Blackwell and Rubin lives here and in the providers'
``supports()`` (kernels/), never as ``if sm == 107`` in a pass. A graph may be compiled for a target this
machine does not have (``RUBIN_TARGET=sm107`` on a laptop): matching and kernel selection run as they would
on that GPU and the plan is written to the dumps; executing the plan here raises
``KernelUnavailableError`` (ops/registry.py).

Named targets::

    cpu     no GPU: every canonical op runs its reference implementation
    sm90    Hopper (H100 / H200)
    sm100   Blackwell (B200)
    sm103   Blackwell Ultra (B300)
    sm107   Rubin (two HBM locality domains)

``resolve("auto")`` is ``detect()``: the current CUDA device, or ``cpu`` when there is none.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Optional

from rubin_compile.errors import RubinError


class UnknownTargetError(RubinError, ValueError):
    """A target name that is neither a named target nor ``auto``."""


# How SMs split into locality domains: "default" (FlashInfer's and the announcement's "strict": equal domains,
# the odd SMs idle) or "backfill" (every SM used).
LOCALITY_MODES: tuple[str, ...] = ("default", "backfill")


def locality_mode(mode: str) -> str:
    """``mode`` as one of ``LOCALITY_MODES`` ("strict" is read as "default"); ``ValueError`` otherwise."""
    text = str(mode).strip().lower()
    text = "default" if text == "strict" else text
    if text not in LOCALITY_MODES:
        raise ValueError(f"unknown locality mode {mode!r}; use one of {LOCALITY_MODES} ('strict' = 'default')")
    return text


@dataclass(frozen=True)
class LocalityDomains:
    """How the SMs of a GPU split into HBM locality domains (CUDA 13.4, Rubin).

    ``strict`` leaves the odd SMs out so every domain has the same count and thread-block clusters can
    launch (2-CTA GEMMs need this); ``backfill`` (``cudaDevSmResourceGroupBackfill``) gives each domain an
    even share of all SMs but its groups cannot launch clusters.
    """

    strict: tuple[int, ...]
    backfill: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.strict)


@dataclass(frozen=True)
class Target:
    """A GPU (or the CPU) that a graph is compiled for, as data.

    Parameters
    ----------
    name:
        ``"sm90"``, ``"sm100"``, ``"sm103"``, ``"sm107"``, ``"cpu"``, or ``"sm<cc>"`` for a detected GPU
        that has no named target.
    description:
        The products it stands for, for reports.
    compute_capability:
        ``(major, minor)``; ``None`` for the CPU.
    sm_count:
        Streaming multiprocessors of the whole GPU (0 for the CPU).
    locality_domains:
        HBM locality domains and their SM counts; ``None`` where the GPU has none (memory is uniform).
    pdl:
        Programmatic Dependent Launch (``griddepcontrol``), sm_90 and newer.
    green_contexts:
        SM partitions with their own streams (``cuGreenCtxCreate``).
    fp8:
        FP8 (e4m3 / e5m2) tensor cores.
    nvfp4, mxfp4:
        Block-scaled FP4 tensor cores for the NVFP4 (16-element blocks, e4m3 scales) and MXFP4
        (32-element blocks, e8m0 scales) formats.
    tcgen05:
        The Blackwell-family tensor-core instructions (``tcgen05.mma``, tensor memory).
    two_cta_clusters:
        One MMA across a pair of CTAs in a cluster (``tcgen05`` ``cta_group::2``).
    """

    name: str
    description: str
    compute_capability: Optional[tuple[int, int]]
    sm_count: int
    locality_domains: Optional[LocalityDomains] = None
    pdl: bool = False
    green_contexts: bool = False
    fp8: bool = False
    nvfp4: bool = False
    mxfp4: bool = False
    tcgen05: bool = False
    two_cta_clusters: bool = False

    @property
    def is_cuda(self) -> bool:
        return self.compute_capability is not None

    @property
    def cc(self) -> Optional[int]:
        """Compute capability as one integer, major * 10 + minor (FlashInfer's encoding: 90, 100, 107)."""
        if self.compute_capability is None:
            return None
        major, minor = self.compute_capability
        return major * 10 + minor

    def features(self) -> dict[str, Any]:
        """The feature flags and SM layout, for reports."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("name", "description")}
        if self.locality_domains is not None:
            out["locality_domains"] = dataclasses.asdict(self.locality_domains)
        return out

    def __str__(self) -> str:
        return self.name


_HOPPER = dict(pdl=True, green_contexts=True, fp8=True)
_BLACKWELL = dict(_HOPPER, nvfp4=True, mxfp4=True, tcgen05=True, two_cta_clusters=True)

TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("cpu", "no GPU (reference kernels; vLLM's own CPU MoE kernel for vLLM's CPU MoE layers)", None, 0),
        # 132 SMs: H100 SXM and H200 (seen on the H200 of benchmarks/results). An H100 PCIe has 114; detect()
        # reports the device's own count.
        Target("sm90", "Hopper (H100 / H200)", (9, 0), 132, **_HOPPER),
        # 148 SMs (74 enabled per die, two dies): public B200 spec sheets.
        Target("sm100", "Blackwell (B200)", (10, 0), 148, **_BLACKWELL),
        # Unverified: public sources give 160 SMs for the full Blackwell Ultra part; 148 enabled SMs on a
        # shipping B300 is unverified as well. detect() reports the device's own count.
        Target("sm103", "Blackwell Ultra (B300)", (10, 3), 148, **_BLACKWELL),
        # The vLLM-on-Rubin announcement: 212 SMs in two locality domains; strict mode uses
        # 200 of them (100 + 100), backfill 106 + 106.
        Target(
            "sm107",
            "Rubin",
            (10, 7),
            212,
            locality_domains=LocalityDomains(strict=(100, 100), backfill=(106, 106)),
            **_BLACKWELL,
        ),
    )
}

# Other spellings people use for the named targets.
ALIASES: dict[str, str] = {
    "sm_90": "sm90",
    "sm90a": "sm90",
    "h100": "sm90",
    "h200": "sm90",
    "hopper": "sm90",
    "sm_100": "sm100",
    "sm100a": "sm100",
    "b200": "sm100",
    "blackwell": "sm100",
    "sm_103": "sm103",
    "sm103a": "sm103",
    "b300": "sm103",
    "sm_107": "sm107",
    "sm107a": "sm107",
    "rubin": "sm107",
    "none": "cpu",
}


def names() -> list[str]:
    """Every name ``resolve`` accepts besides aliases: the named targets and ``auto``."""
    return ["auto", *TARGETS]


def resolve(name: Optional[str | Target] = "auto") -> Target:
    """The target called ``name`` (``"auto"`` or ``None``: ``detect()``); a clear error for an unknown name."""
    if isinstance(name, Target):
        return name
    key = "auto" if name is None else str(name).strip().lower()
    if key in ("auto", ""):
        return detect()
    key = ALIASES.get(key, key)
    if key in TARGETS:
        return TARGETS[key]
    raise UnknownTargetError(
        f"unknown rubin target {name!r}; valid targets are {names()} "
        f"(also {sorted(ALIASES)}); set RUBIN_TARGET or options={{'target': ...}}"
    )


@functools.lru_cache(maxsize=None)
def detect(device_index: int = 0) -> Target:
    """The target of CUDA device ``device_index``, or ``cpu`` when CUDA is not available.

    A device with a named target gets that target's features with the device's own SM count and name; a
    device without one (e.g. sm_120) gets a target named ``sm<cc>`` with features by architecture family.
    """
    import torch

    if not torch.cuda.is_available():
        return TARGETS["cpu"]
    props = torch.cuda.get_device_properties(device_index)
    cc = (props.major, props.minor)
    name = f"sm{props.major}{props.minor}"
    base = TARGETS.get(name)
    if base is None:
        # sm_110 is Blackwell-family (tcgen05); sm_12x has FP4 tensor cores but no tcgen05.
        family = (
            _BLACKWELL
            if props.major in (10, 11)
            else dict(_HOPPER, nvfp4=True, mxfp4=True)
            if props.major >= 12
            else _HOPPER
            if props.major == 9
            else {}
        )
        base = Target(name, props.name, cc, props.multi_processor_count, **family)
    return dataclasses.replace(
        base, description=f"{props.name} ({base.description})", sm_count=props.multi_processor_count
    )
