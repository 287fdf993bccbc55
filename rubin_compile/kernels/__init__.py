"""The kernels. Each module registers its kernels onto the canonical ops they run (ops/registry.py);
importing this package registers them all, in the order below (which breaks ties of equal priority).

    reference.py       plain PyTorch, every op, every device: the semantics; the choice on the CPU
    triton/            our fused MoE Triton kernels (PDL, split-N over locality domains)
    torch_provider.py  cuBLAS (torch.mm, torch._scaled_mm) and SDPA, where they are the best available
    vllm_cpu.py        vLLM's own CPU MoE kernel on the weights vLLM prepacked for it
    flashinfer.py      FlashInfer 0.7.2 MoE / GEMM / attention entry points, gated by FlashInfer's own
                       capability declarations (plans only: no adapter yet)

Adding a kernel is one new module listed here (docs/contributing.md).
"""

from rubin_compile.kernels import reference  # noqa: F401
from rubin_compile.kernels import triton  # noqa: F401
from rubin_compile.kernels import torch_provider  # noqa: F401
from rubin_compile.kernels import vllm_cpu  # noqa: F401
from rubin_compile.kernels import flashinfer  # noqa: F401
