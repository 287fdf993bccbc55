"""place_locality: a stage of the pipeline that a later issue builds (see DESIGN.md).

Until then it changes nothing and says so in every report: everything runs on the current stream; no locality-domain placement.
"""

import torch

from rubin_compile.passes.base import PassContext, PassResult, not_implemented

NAME = "place_locality"


def run(graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
    return not_implemented(NAME, "everything runs on the current stream; no locality-domain placement")
