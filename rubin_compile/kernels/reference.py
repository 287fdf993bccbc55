"""The reference provider: plain PyTorch, every op, every device. Its results define the semantics."""

from rubin_compile.ops.attention import attention_reference
from rubin_compile.ops.gemm import gemm_reference
from rubin_compile.ops.moe import moe_reference

IMPLEMENTATIONS = {"moe": moe_reference, "gemm": gemm_reference, "attention": attention_reference}
