"""Canonical ops (torch.library namespace ``rubin``). Importing this package registers them."""

from rubin_compile.ops import moe  # noqa: F401  (registers torch.ops.rubin.moe)
from rubin_compile.ops import gemm  # noqa: F401  (registers torch.ops.rubin.gemm)
from rubin_compile.ops import attention  # noqa: F401  (registers torch.ops.rubin.attention)
from rubin_compile.ops import weights  # noqa: F401  (registers torch.ops.rubin.stacked_weights)
from rubin_compile.ops import vllm_moe  # noqa: F401  (rubin.vllm_moe_layer*, defined once vLLM is imported)
