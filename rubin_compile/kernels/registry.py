"""Kernel registry: which implementation runs a canonical op, by kernel name.

A kernel name is what ``select_kernels`` writes into a canonical node's ``kernel`` argument (the dumps
show it). Each provider module declares its implementations as data, ``IMPLEMENTATIONS = {op: callable}``,
and is imported only when one of its kernels is asked for, so optional packages (Triton, FlashInfer,
CuTe-DSL) are never imported at package import time.
"""

from __future__ import annotations

import importlib
from typing import Callable

# kernel name -> module that provides it. Kernel names are the provider names for now; a provider with
# several kernels per op registers them as "<provider>_<variant>".
PROVIDERS: dict[str, str] = {
    "reference": "rubin_compile.kernels.reference",
}


class KernelUnavailableError(RuntimeError):
    """A compiled graph asks for a kernel this machine cannot run."""


def implementation(op: str, kernel: str) -> Callable:
    """Return the callable that runs canonical op ``op`` with kernel ``kernel``; a clear error if none."""
    module_name = PROVIDERS.get(kernel)
    if module_name is None:
        raise KernelUnavailableError(
            f"rubin.{op}: unknown kernel {kernel!r}; known kernels are {sorted(PROVIDERS)}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:  # an optional package of that provider is missing here
        raise KernelUnavailableError(
            f"rubin.{op}: kernel {kernel!r} cannot run on this machine: {exc}. "
            "Recompile for this machine (leave options['target'] unset) or install the package."
        ) from exc
    impls = getattr(module, "IMPLEMENTATIONS", {})
    if op not in impls:
        raise KernelUnavailableError(f"rubin.{op}: kernel {kernel!r} has no implementation of {op}")
    return impls[op]
