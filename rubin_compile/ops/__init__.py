"""Canonical ops (torch.library namespace ``rubin``). Importing this package registers them.

    registry.py    CanonicalOp, KernelSpec, Kernel, Launch, Placement: what kernels register onto, and how
                   one is chosen for a target
    moe.py         rubin.moe        (MoEArgs, WeightLayout, the reference semantics, the spec builder)
    gemm.py        rubin.gemm       (GemmArgs, the reference, the ATen form, the spec builder)
    attention.py   rubin.attention  (AttentionArgs, the reference, the ATen form, the spec builder)
    route.py       rubin.route      (RouteArgs, the reference: an MoE router to the ids and weights rubin.moe reads)
    weights.py     rubin.stacked_weights (expert weights concatenated once, not per call)
    quantized.py   rubin.dequantize (a quantised weight as a plain PyTorch model holds it; matchers fold it)
    fp4.py         NVFP4 / MXFP4: packing, dequantisation, a quantiser for examples and tests
    nodes.py       reading calls of ops in FX graphs (arguments by name, fake values, dtype names)

Every canonical op lives in one module; adding one is docs/contributing.md's recipe.
"""

# In this order: CANONICAL_OPS lists the ops as they are defined (moe, gemm, attention, route).
from rubin_compile.ops import moe  # noqa: F401
from rubin_compile.ops import gemm  # noqa: F401
from rubin_compile.ops import attention  # noqa: F401
from rubin_compile.ops import route  # noqa: F401
from rubin_compile.ops import weights  # noqa: F401
from rubin_compile.ops import quantized  # noqa: F401
