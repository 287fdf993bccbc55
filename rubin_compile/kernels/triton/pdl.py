"""What a PDL-aware Triton kernel of ours shares: the ``griddepcontrol`` intrinsics where this Triton has them, whether
a launch can use them, and the L2 prefetch a kernel issues before ``griddepcontrol.wait``.

Programmatic Dependent Launch (docs/pdl_locality.md): a kernel launched with ``launch_pdl=True`` may start while the
kernel before it drains; it must call ``gdc_wait()`` before it reads what an earlier kernel writes or writes what one
reads. What it does before the wait overlaps its predecessor's tail: index math, and requests that pull data no
kernel of this step writes (weights; the filled part of a KV cache) into L2. ``l2_prefetch`` is such a request
(``cp.async.bulk.prefetch.L2``): a hint with no result, so it is correct whatever memory it names -- L2 is where
the GPU's memory is coherent, a later write by another kernel lands there too -- and costs only bandwidth.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4 ships the PDL intrinsics; older versions run without PDL.
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the installed Triton
    gdc_wait = gdc_launch_dependents = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
PREFETCH_CHUNK = 4096  # bytes per cp.async.bulk.prefetch.L2 instruction


def has_gdc() -> bool:
    """Whether kernels can be built with ``gdc_wait`` / ``gdc_launch_dependents`` and launched with PDL here (a GPU,
    a Triton that has them, not the interpreter)."""
    return gdc_wait is not None and not INTERPRET and torch.cuda.is_available()


@triton.jit
def l2_prefetch(ptrs, sizes):
    """Ask the copy engine to pull ``sizes[i]`` bytes at ``ptrs[i]`` into L2 (``ptrs`` 16-byte aligned ``int8``
    pointers, ``sizes`` int32 multiples of 16; a size of 0 issues nothing). Same shapes, any rank."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptrs, sizes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def l2_prefetch_range(ptr, nbytes, CHUNK: tl.constexpr, NCHUNK: tl.constexpr):
    """``l2_prefetch`` of the ``nbytes`` at ``ptr`` (16-byte aligned), in at most ``NCHUNK`` requests of ``CHUNK`` bytes
    (each rounded down to whole 16 bytes; the ones past ``nbytes`` issue nothing)."""
    offs = tl.arange(0, NCHUNK) * CHUNK
    size = tl.minimum(tl.maximum(nbytes - offs, 0), CHUNK).to(tl.int32)
    l2_prefetch(ptr.to(tl.pointer_type(tl.int8)) + offs, (size // 16) * 16)
