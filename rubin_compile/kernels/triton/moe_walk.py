"""The order in which the persistent MoE path's programs walk their work items, shared by its Triton kernels
(moe_prefill.py) and its Gluon ones (moe_prefill_gluon.py), so both compute every item in the same place of the walk."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_of(tile, num_m, num_n, GROUP: tl.constexpr):
    """(M tile, N tile) of work item ``tile``: GROUP M tiles per N tile, then the next N tile."""
    per_group = GROUP * num_n
    first_m = (tile // per_group) * GROUP
    rows = tl.minimum(num_m - first_m, GROUP)
    m = first_m + (tile % per_group) % rows
    n = (tile % per_group) // rows
    return m, n
