"""select_kernels: a stage of the pipeline that a later issue builds (see DESIGN.md).

Until then it changes nothing and says so in every report: every canonical op runs its reference implementation (plain PyTorch).
"""

import torch

from rubin_compile.passes.base import PassContext, PassResult, not_implemented

NAME = "select_kernels"


def run(graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
    return not_implemented(NAME, "every canonical op runs its reference implementation (plain PyTorch)")
