"""The reference provider: plain PyTorch, every op, every device. Its results define the semantics."""

from rubin_compile.ops.moe import moe_reference

IMPLEMENTATIONS = {"moe": moe_reference}
