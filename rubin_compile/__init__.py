"""rubin-compile: a torch.compile backend for LLM inference.

Public API: ``backend`` (also registered as ``torch.compile(backend="rubin")``), ``RubinOptions``, ``vllm_pass``
(vLLM resolves ``"rubin_compile.vllm_pass"`` from the package top), and the errors a user may catch:
``RubinError`` (the base of all of them), ``RubinOptionsError`` (a bad option), ``RubinStrictError``
(``strict=True`` and something recognised was left unchanged), ``KernelUnavailableError`` (a compiled plan asks
for a kernel this machine cannot run). README.md's "Errors" says how they reach you.
Architecture: docs/architecture.md.
"""

from rubin_compile import ops  # noqa: F401  (registers torch.ops.rubin.*)
from rubin_compile import kernels  # noqa: F401  (registers every kernel onto its op)
from rubin_compile.backend import register as _register
from rubin_compile.backend import rubin_backend as backend
from rubin_compile.errors import RubinError
from rubin_compile.integrations.vllm import vllm_pass
from rubin_compile.ops.registry import KernelUnavailableError
from rubin_compile.options import RubinOptions, RubinOptionsError
from rubin_compile.passes.base import RubinStrictError

__all__ = [
    "backend",
    "RubinOptions",
    "vllm_pass",
    "RubinError",
    "KernelUnavailableError",
    "RubinOptionsError",
    "RubinStrictError",
]

_register()
