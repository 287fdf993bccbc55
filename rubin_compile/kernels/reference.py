"""The ``reference`` kernel: plain PyTorch, every op, every device. Its results define the semantics.

It is registered onto every canonical op (each op brings its own ``reference``, ops/<op>.py), with the lowest
priority on GPUs; on the CPU target it is the choice (every other kernel rejects the CPU, so CPU runs keep
exact numerics).
"""

from __future__ import annotations

from typing import Callable, Optional

from rubin_compile.ops.registry import CANONICAL_OPS, KernelSpec
from rubin_compile.target import Target


def _supports(target: Target, spec: KernelSpec) -> Optional[str]:
    return None


def _entry(op: str) -> Callable[[KernelSpec], str]:
    return lambda spec: f"rubin_compile.kernels.reference ({op})"


for _op in CANONICAL_OPS.values():
    _op.register_kernel(
        "reference",
        supports=_supports,
        priority={"*": 0},
        layouts=("*",),
        entry=_entry(_op.name),
        module=__name__,
        features=("*",),
    )(_op.reference)
