"""match_gemm: a stage of the pipeline that a later issue builds (see DESIGN.md).

Until then it changes nothing and says so in every report: matrix products stay with Inductor's own lowering (cuBLAS / its templates).
"""

import torch

from rubin_compile.passes.base import PassContext, PassResult, not_implemented

NAME = "match_gemm"


def run(graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
    return not_implemented(NAME, "matrix products stay with Inductor's own lowering (cuBLAS / its templates)")
