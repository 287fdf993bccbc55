"""Reading calls of ops in an FX graph: arguments by schema name, the fake values on nodes, dtype names.

The canonical ops read their own nodes with these (each op's spec builder, the registry's ``bound_kernel``);
the passes import them from here too (through ``passes/fx.py``), so each exists once.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)


def known_sizes(*sizes) -> bool:
    """All sizes are plain ints (an op's argument checks skip symbolic sizes: checking one would add a guard)."""
    for s in sizes:  # a loop, not all(generator): the ops' checks run on every call
        if not isinstance(s, int):
            return False
    return True


def dtype_name(dtype: torch.dtype) -> str:
    """``"bfloat16"`` for ``torch.bfloat16``: how reports, specs and tables name a dtype."""
    return str(dtype).replace("torch.", "")


def node_val(node: Any) -> Optional[Any]:
    """The fake value (tensor, or tuple of tensors) recorded on a node; ``None`` for anything else."""
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def tensor_val(node: Any) -> Optional[torch.Tensor]:
    """The fake tensor recorded on a node, or ``None``."""
    val = node_val(node)
    return val if isinstance(val, torch.Tensor) else None


def val_dtype(node: Any) -> str:
    """The dtype name of the tensor on a node, ``"unknown"`` when none is recorded."""
    val = tensor_val(node)
    return dtype_name(val.dtype) if val is not None else "unknown"


def static_size(val: Any, dim: int) -> Optional[int]:
    """Size ``dim`` of a fake tensor when it is a plain int; ``None`` for symbolic sizes (dynamic shapes)
    and missing values."""
    if not isinstance(val, torch.Tensor) or val.dim() <= dim:
        return None
    size = val.shape[dim]
    return size if isinstance(size, int) else None


def bound_arguments(node: torch.fx.Node) -> dict[str, Any]:
    """A call of an ``OpOverload``: its arguments by schema name, defaults filled in."""
    schema = node.target._schema
    out = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    out.update(zip((a.name for a in schema.arguments), node.args))
    out.update(node.kwargs)
    return out


def schema_name(op: Any) -> Optional[str]:
    """``"namespace::name"`` of an ``OpOverload`` (``None`` for anything else), without importing the library
    that defines it."""
    return getattr(getattr(op, "_schema", None), "name", None)


def device_type(node: torch.fx.Node) -> Optional[str]:
    """The device type of the node's first tensor input (``None`` when it has none)."""
    for arg in node.args:
        val = tensor_val(arg)
        if val is not None:
            return val.device.type
    return None
