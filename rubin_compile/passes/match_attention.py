"""match_attention: a stage of the pipeline that a later issue builds (see DESIGN.md).

Until then it changes nothing and says so in every report: attention ops stay as they are and Inductor (or vLLM's attention backend) runs them.
"""

import torch

from rubin_compile.passes.base import PassContext, PassResult, not_implemented

NAME = "match_attention"


def run(graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
    return not_implemented(NAME, "attention ops stay as they are and Inductor (or vLLM's attention backend) runs them")
