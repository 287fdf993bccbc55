"""The rubin pass pipeline: one module per pass, run in the order of ``PIPELINE`` by manager.py.

    canonicalize -> match_moe -> match_routing -> match_attention -> match_gemm -> fuse_projections
        -> select_kernels -> place_locality -> chain_pdl -> inline_kernels

Matchers turn source idioms into canonical ops (match_*; match_routing fuses the router ahead of each rubin.moe
where a routing kernel takes it); fuse_projections joins rubin.gemm nodes that read
one input (q / k / v, gate / up) into one over stacked weights; selection binds each canonical node to a kernel for
the target (select_kernels); the next two decide how kernels are launched (locality placement, PDL), and
inline_kernels traces the launches of our Triton kernels into the graph where Inductor should launch them. Each
entry is a ``Pass`` (base.py): its name, its ``run(graph, ctx)``, and what it reads from the context.
"""

from __future__ import annotations

from rubin_compile.passes import (
    canonicalize,
    chain_pdl,
    fuse_projections,
    inline_kernels,
    match_attention,
    match_gemm,
    match_moe,
    match_routing,
    place_locality,
    select_kernels,
)
from rubin_compile.passes.base import Pass

PIPELINE: tuple[Pass, ...] = (
    canonicalize.PASS,
    match_moe.PASS,
    match_routing.PASS,
    match_attention.PASS,
    match_gemm.PASS,
    fuse_projections.PASS,
    select_kernels.PASS,
    place_locality.PASS,
    chain_pdl.PASS,
    inline_kernels.PASS,
)

PASS_NAMES: tuple[str, ...] = tuple(p.name for p in PIPELINE)
