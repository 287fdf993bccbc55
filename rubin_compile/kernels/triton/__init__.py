"""The ``triton`` kernel provider: fused MoE Triton kernels (see moe.py).

Importing this package fails with an ImportError that names the reason when Triton is not installed or
no CUDA device is visible, so the registry reports the kernel as "cannot run on this machine". With
``TRITON_INTERPRET=1`` the kernels run (slowly) on CPU tensors through Triton's interpreter; the CPU
tests use that to check indexing.
"""

import importlib.util
import os

if importlib.util.find_spec("triton") is None:
    raise ImportError("the Triton MoE kernels need the 'triton' package, which is not installed")

import torch  # noqa: E402

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
    raise ImportError(
        "the Triton MoE kernels need a CUDA GPU and torch.cuda.is_available() is False "
        "(set TRITON_INTERPRET=1 only to run them slowly on the CPU for tests)"
    )

from rubin_compile.kernels.triton.moe import fused_moe  # noqa: E402

IMPLEMENTATIONS = {"moe": fused_moe}
