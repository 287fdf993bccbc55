"""rubin-compile: a torch.compile backend for LLM inference.

Public API: ``backend`` (also registered as ``torch.compile(backend="rubin")``), ``RubinOptions``, and
``vllm_pass`` (vLLM resolves ``"rubin_compile.vllm_pass"`` from the package top).
"""

from rubin_compile import ops  # noqa: F401  (registers torch.ops.rubin.*)
from rubin_compile.backend import register as _register
from rubin_compile.backend import rubin_backend as backend
from rubin_compile.integrations.vllm import vllm_pass
from rubin_compile.options import RubinOptions

__all__ = ["backend", "RubinOptions", "vllm_pass"]

_register()
