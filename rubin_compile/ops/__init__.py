"""Canonical ops (torch.library namespace ``rubin``). Importing this package registers them."""

from rubin_compile.ops import moe  # noqa: F401  (registers torch.ops.rubin.moe)
