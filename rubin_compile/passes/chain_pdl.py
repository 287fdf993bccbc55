"""chain_pdl: a stage of the pipeline that a later issue builds (see DESIGN.md).

Until then it changes nothing and says so in every report: no kernel is launched with Programmatic Dependent Launch.
"""

import torch

from rubin_compile.passes.base import PassContext, PassResult, not_implemented

NAME = "chain_pdl"


def run(graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
    return not_implemented(NAME, "no kernel is launched with Programmatic Dependent Launch")
