"""Fused MoE routing for decode (T <= 64 tokens): router GEMM, scoring, (group-limited) top-k, renormalisation
and scaling in two Triton kernels, for the routing idioms of rubin_compile/passes/match_moe/routing.py.

The kernels of ``rubin.route`` (rubin_compile/ops/route.py, whose reference is the semantics; ``run`` is the
adapter, which sends a call of more than 64 tokens to that reference).

Contract. ``route(hidden_states, router_weight, top_k=..., ...)`` returns ``(topk_weights [T, k] (float32 unless
``weights_dtype`` says otherwise), topk_ids int32 [T, k])`` as ``route_reference`` defines them (below), for bf16 /
fp16 / fp32 hidden states and
router weights (mixed dtypes are multiplied in fp32), ``T <= 64``, ``E <= 512``, ``H <= 8192``,
``k <= 16``, any E (60, 160: not a power of two) and H (not a multiple of the tile). No host synchronisation
(every decision is taken from shapes, so the call is capturable in a CUDA graph), no atomics: deterministic,
and bitwise the same with ``pdl`` on and off. Within float32 rounding of the reference: the logits are summed
in another order (ids equal wherever no two selection values are within that rounding; weights within 1e-5 in
float32, 1e-3 relative for bf16 inputs). Arguments that are not valid raise ``RouteArgumentError`` (a
``ValueError``) naming the argument and the limit, before anything is launched.

Semantics (``route_reference``, plain torch; the idioms of passes/match_moe/routing.py)::

    logits = x.float() @ W.float().T (+ router_bias)  [.to(logits_dtype)]   # float32, [T, E]
    order "score_then_topk" (default):
        scores = softmax(logits) (Mixtral, Qwen3-MoE) | sigmoid(logits) (DeepSeek-V3)
        sel = scores (+ correction_bias)                                     # DeepSeek's e_score_correction_bias
        n_group > 1 (DeepSeek-V3: 8 groups of 32, keep 4): a group's score is the sum of its two largest
            sel values; the topk_group best groups are kept; the other groups' experts get sel = -inf
            (group_fill "-inf", vLLM's) or 0.0 (group_fill "0", transformers')
        ids = top-k of sel;  w = scores[ids]                                 # the unbiased scores
    order "topk_then_softmax" (GPT-OSS): ids = top-k of logits;  w = softmax(logits[ids])
    renormalize: w / (w.sum(-1) + renorm_eps), or w / max(w.sum(-1), renorm_eps) with renorm_floor; renorm_eps
        None: 1e-20 with sigmoid scoring (DeepSeek-V3's code), 0 otherwise
    w = (w * routed_scaling_factor).to(weights_dtype)                        # a float, or a 0-d tensor

Tie rule: equal values are resolved towards the LOWER id, for experts and for groups alike, and the k ids of a
token are listed in descending value order (equal values: lower id first). ``torch.topk`` promises neither,
so the reference sorts with ``torch.sort(stable=True)``. The two group fills agree whenever the kept experts'
selection values are positive (sigmoid scores plus a small bias). NaN logits give unspecified (but in-range,
distinct) ids.

Why this shape. At decode the routing is a few microseconds of launches around a tiny amount of work (the
DeepSeek-V3 router is 3.7 MB, 0.9 us of HBM; Qwen3-30B-A3B's 0.5 MB; Mixtral's 64 KB): cuBLAS's GEMM plus
softmax / top-k / renormalisation kernels cost about 10 us per layer on an H200 (an estimate; benchmarks/route.py
measures both). Two kernels, chained with PDL:

- ``_router_logits_kernel``, grid (E / BE, H / BK): every program owns one [BE, BK] tile of the router weight,
  loaded whole into registers *before* ``griddepcontrol.wait`` (weights never depend on the previous kernel,
  so their DRAM round trip overlaps its tail), then reads the [T, BK] activations and writes float32 partial
  logits [SPLIT, T, E] (SPLIT = H / BK): fp32 multiply-adds with ``tl.sum`` for one token (a GEMV: no padding
  to the tensor cores' 16 rows), ``tl.dot`` from two (``FMA_MAX_T``). The tile is sized so the grid
  covers the SMs about once or twice for the large routers (``heuristic``) and stays a handful of programs
  for the small ones; splitting H rather than E is what gives a 256 x 7168 router 224 programs.
- ``_route_topk_kernel``, one program per token: sums the SPLIT partials in split order (deterministic),
  adds the router bias, scores, and selects over the E experts held in registers as [groups, experts per
  group] (padded to powers of two with dead lanes, which never win). Every choice is made on (value, lower id)
  packed into an int64 key, by Triton's bitonic ``tl.topk``: the group scores from each row's top 2, the kept
  groups from the group keys sorted, then the k best keys of all lanes at once; the weights (the unbiased
  scores, where a correction bias or a group fill made the selection values differ) are read back by id. Then
  renormalised, scaled. Until 2026-12-06 the choices were k rounds of one int64 argmax reduction each: a chain
  of dependent reductions that made the top-k kernel most of the call (DeepSeek-V3 at T = 1 on an H100: 5.9 of
  9.1 us; benchmarks/route_profile.py).

One kernel, in which the last programs to write their partials take a ticket and route the tokens, was built and
measured on an H100 the same day: slower than the two PDL-chained kernels at every router and T (DeepSeek-V3 at T =
1: 5.73 against 4.85 us, Qwen3-30B-A3B 3.77 against 3.10): the ticket's round trip to L2 costs more than the
second launch, whose programs are resident and waiting before the first kernel ends. Not kept.

PDL. With sm_90+ and Triton's ``gdc_wait`` (not under TRITON_INTERPRET) both kernels hold the PDL
instructions: kernel 1 waits before reading the hidden states (the previous kernel's output) and lets kernel 2
launch right after its wait; kernel 2 is always launched with PDL on kernel 1 (our own pair: always safe), waits
before reading the partials and lets the next kernel (the MoE's first GEMM) launch right after. ``pdl=True``
launches kernel 1 with PDL too; the router weight is then read before the previous kernel has finished, so it
must not be that kernel's output (it is a parameter). The biases are read before kernel 2's wait, which is safe:
kernel 2 starts only once every program of kernel 1 has passed its wait, i.e. once everything before the call
has finished.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from rubin_compile.kernels.triton.launch import cdiv, launcher, next_power_of_2
from rubin_compile.ops.route import ORDERS, SCORINGS, RouteArgs, RouteArgumentError, reference

__all__ = ["ORDERS", "SCORINGS", "RouteArgumentError", "route", "route_reference", "run"]

try:  # Triton >= 3.4 ships the PDL intrinsics; older versions run without PDL.
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the installed Triton
    gdc_wait = gdc_launch_dependents = None

MAX_T = 64  # tokens per call: decode and small batches (the partials and per-token programs are sized for it)
MAX_E = 512  # experts: the top-k kernel holds a token's E logits in registers
MAX_H = 8192  # hidden size: at most 128 H slices, summed by unrolled loads in the top-k kernel
MAX_K = 16  # experts per token: the bitonic top-k's width (a power of two >= k)
# up to this many tokens the logits kernel uses multiply-adds (a loop over the tokens), above it tl.dot (T padded to
# 16 rows): on an H100 tl.dot made the call 4-8% faster at T = 2, 20-31% at 4, 64-82% at 8 (the best tile of each
# form; benchmarks/results/route-h100-2026-12-06)
FMA_MAX_T = 1
SIGMOID_RENORM_EPS = 1e-20  # DeepSeek-V3's ``topk_weights.sum(-1, keepdim=True) + 1e-20``
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _fail(msg: str) -> None:
    raise RouteArgumentError(f"route: {msg}")


# ------------------------------------------------------------------------------------------------
# arguments and the reference
# ------------------------------------------------------------------------------------------------


def route_args(
    hidden_states: torch.Tensor,
    router_weight: torch.Tensor,
    *,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = False,
    router_bias: Optional[torch.Tensor] = None,
    correction_bias: Optional[torch.Tensor] = None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: Union[float, torch.Tensor] = 1.0,
    order: str = "score_then_topk",
    renorm_eps: Optional[float] = None,
    renorm_floor: bool = False,
    group_fill: str = "-inf",
    logits_dtype: Optional[torch.dtype] = None,
    weights_dtype: torch.dtype = torch.float32,
) -> RouteArgs:
    """The op's ``RouteArgs`` (validated: ``RouteArgumentError`` naming the problem) from this module's keyword
    form: ``routed_scaling_factor`` a float or a 0-d tensor; ``renorm_eps`` None means DeepSeek-V3's 1e-20 with
    sigmoid scoring and 0 with softmax."""
    scale, scale_tensor = routed_scaling_factor, None
    if isinstance(scale, torch.Tensor):
        if scale.dim() != 0 or not scale.is_floating_point():
            _fail(
                f"routed_scaling_factor as a tensor must be a 0-d float tensor, got {tuple(scale.shape)} {scale.dtype}"
            )
        if scale.device != hidden_states.device and scale.device.type != "cpu":
            _fail(f"routed_scaling_factor is on {scale.device}, hidden_states on {hidden_states.device}")
        scale, scale_tensor = 1.0, routed_scaling_factor
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        _fail(f"routed_scaling_factor must be a float or a 0-d tensor, got {type(scale).__name__}")
    if renorm_eps is None:
        renorm_eps = SIGMOID_RENORM_EPS if scoring == "sigmoid" else 0.0
    return RouteArgs(
        hidden_states, router_weight, top_k, scoring, order, bool(renormalize), float(renorm_eps), bool(renorm_floor),
        router_bias, correction_bias, n_group, topk_group, group_fill, float(scale), scale_tensor, logits_dtype,
        weights_dtype,
    )  # fmt: skip


def route_reference(
    hidden_states: torch.Tensor, router_weight: torch.Tensor, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing's semantics in plain torch (ops/route.py's ``reference``; ``route_args``' keywords):
    ``(topk_weights [T, k], topk_ids int32 [T, k])``; any T, E, H, k (the kernel's limits do not apply), any device."""
    return reference(route_args(hidden_states, router_weight, **kwargs))


# ------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouteConfig:
    """The logits kernel's tile (each program holds one [block_e, block_k] weight tile), its form and the warps of
    both kernels. ``heuristic`` chooses it; tests pass one to force H splits, E tiles and either form."""

    block_e: int = 16  # experts per program (a power of two; >= 16 for the tl.dot form)
    block_k: int = 512  # hidden positions per program (a power of two): SPLIT = cdiv(H, block_k) partials
    num_warps: int = 4  # the logits kernel
    topk_warps: int = 4  # the top-k kernel's warps a token (its bitonic stages spread over them)
    mma: Optional[bool] = None  # the logits by tl.dot (rows padded to 16) or by multiply-adds; None: by T


def heuristic(T: int, E: int, H: int, num_sms: int = 132) -> RouteConfig:
    """A tile of 2048-8192 weight elements (4-16 KB in bf16, 16-64 fp32 registers a thread) such that the grid
    holds about one program per SM for the large routers (DeepSeek-V3: 16 x 512 tiles, 16 x 14 = 224
    programs); BK as long as that allows (fewer partials to sum; each expert row read in 1 KB runs). Within 6% of
    the best of the tiles tried on an H100 at T = 1-16 for the three benchmark routers, 5-17% off at T = 32
    (benchmarks/route_profile.py's sweep, benchmarks/results/route-h100-2026-12-06)."""
    lo = 8 if T <= FMA_MAX_T else 16
    tile = max(2048, min(8192, next_power_of_2(max(1, E * H // num_sms))))
    bk = min(512, tile // lo, max(64, next_power_of_2(H)))
    be = max(lo, min(tile // bk, next_power_of_2(E)))
    # the top-k over 256+ lanes on 4 warps (DeepSeek-V3: 2.5 against 3.7 us with one on an H100), fewer on one
    # (Qwen3-30B-A3B's 128: 1.80 against 1.89 us)
    return RouteConfig(block_e=be, block_k=bk, topk_warps=4 if next_power_of_2(E) >= 256 else 1)


# ------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["T"])  # one binary for every T (T == 1 would specialise)
def _router_logits_kernel(
    x_ptr,
    w_ptr,
    part_ptr,
    T,
    E,
    H,
    stride_xt,
    stride_xh,
    stride_we,
    stride_wh,
    BE: tl.constexpr,
    BK: tl.constexpr,
    T_PAD: tl.constexpr,
    MMA: tl.constexpr,
    COMPUTE: tl.constexpr,
    GDC: tl.constexpr,
):
    """Partial logits ``part[s, t, e] = sum over h in slice s of x[t, h] * W[e, h]`` (float32) for the BE experts
    of program 0's index and the BK hidden positions of program 1's index."""
    pid_e = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_e = pid_e * BE + tl.arange(0, BE)
    e_ok = offs_e < E
    rows = tl.where(e_ok, offs_e, 0)  # masked-off experts read row 0 (in bounds), never stored
    offs_k = pid_s * BK + tl.arange(0, BK)
    k_ok = offs_k < H
    # The router weight never depends on the previous kernel: this program's whole tile is requested now, so its
    # DRAM round trip overlaps the previous kernel's tail under PDL.
    w = tl.load(w_ptr + rows[:, None] * stride_we + offs_k[None, :] * stride_wh, mask=k_ok[None, :], other=0.0)
    if GDC:
        gdc_wait()  # the hidden states are the previous kernel's output
        gdc_launch_dependents()  # the top-k kernel's programs may take free SM slots now (they wait for us)
    part = part_ptr + pid_s * T * E
    if MMA:
        offs_t = tl.arange(0, T_PAD)
        t_ok = offs_t < T
        x = tl.load(
            x_ptr + offs_t[:, None] * stride_xt + offs_k[None, :] * stride_xh,
            mask=t_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        if COMPUTE == tl.float32:  # fp32 inputs (and the interpreter): exact products, as the reference's
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:  # 16-bit products are exact in the fp32 accumulator
            acc = tl.dot(x.to(COMPUTE), tl.trans(w.to(COMPUTE)))
        tl.store(part + offs_t[:, None] * E + offs_e[None, :], acc, mask=t_ok[:, None] & e_ok[None, :])
    else:
        wf = w.to(tl.float32)
        for t in range(T):
            xt = tl.load(x_ptr + t * stride_xt + offs_k * stride_xh, mask=k_ok, other=0.0).to(tl.float32)
            tl.store(part + t * E + offs_e, tl.sum(wf * xt[None, :], axis=1), mask=e_ok)


@triton.jit
def _max2d(v):
    return tl.max(tl.max(v, axis=1), axis=0)


@triton.jit
def _key(v, ids, BIG: tl.constexpr):
    """(value, id) packed into one int64 whose order is the value's, then the LOWER id: one max-reduction is an
    argmax with the tie rule. The float's bits map to an int32 of the same order (negative floats: magnitude
    bits flipped; -0.0 taken as +0.0, which it equals); the low word is ``BIG - id``."""
    bits = tl.where(v == 0.0, 0, v.to(tl.int32, bitcast=True))
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return ordered.to(tl.int64) * 4294967296 + (BIG - ids).to(tl.int64)


@triton.jit
def _key_value(key):
    """The float32 value of a ``_key`` (exact)."""
    ordered = (key >> 32).to(tl.int32)
    return tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(tl.float32, bitcast=True)


@triton.jit
def _key_id(key, BIG: tl.constexpr):
    return (BIG - (key & 4294967295)).to(tl.int32)


@triton.jit(do_not_specialize=["T"])
def _route_topk_kernel(
    part_ptr, bias_ptr, corr_ptr, scale_ptr, w_out_ptr, id_out_ptr, T, scale, renorm_eps, stride_wt, stride_it,
    SPLIT: tl.constexpr, NG: tl.constexpr, GS: tl.constexpr, NG_PAD: tl.constexpr, GS_PAD: tl.constexpr,
    K: tl.constexpr, K_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, SIGMOID: tl.constexpr, TOPK_FIRST: tl.constexpr,
    RENORM: tl.constexpr, RENORM_FLOOR: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_CORR: tl.constexpr,
    SCALE_PTR: tl.constexpr, ROUND: tl.constexpr, FILL_ZERO: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """One token: logits from the partials, scores, (grouped) top-k, weights. The E = NG * GS experts are held
    as [NG_PAD, GS_PAD] (expert ``g * GS + j``); lanes past GS or NG are dead and never selected. The choices are
    made on packed (value, lower id) keys (``_key``) by Triton's bitonic ``tl.topk`` (groups: the top 2 of each
    row, then the group keys sorted), which sorts every lane at once instead of a chain of k dependent argmax
    reductions: 2x faster for the k = 8 of 256 / 128 experts on an H100 (benchmarks/h200/route_topk_probe.py)."""
    # Float arguments in fp32 whoever launches: Triton's launcher passes a Python float as fp32, Inductor's (the
    # kernel traced into the graph, passes/inline_kernels.py) as fp64.
    scale = tl.cast(scale, tl.float32)
    renorm_eps = tl.cast(renorm_eps, tl.float32)
    E: tl.constexpr = NG * GS
    BIG: tl.constexpr = 2 * NG_PAD * GS_PAD  # above every lane's id: BIG - id > 0
    DEAD: tl.constexpr = -(2**63)  # the key of dead and taken lanes: below every value's (-inf's, NaN's too)
    NEG = float("-inf")
    t = tl.program_id(0)
    g = tl.arange(0, NG_PAD)[:, None]
    j = tl.arange(0, GS_PAD)[None, :]
    valid = (g < NG) & (j < GS)
    flat = g * GS + j  # the expert id (dead lanes alias other ids: always masked with ``valid``)
    # Parameters, read before the wait: kernel 1 lets this grid launch only after its own wait, i.e. once every
    # kernel before the call has finished.
    bias = tl.zeros((NG_PAD, GS_PAD), tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + flat, mask=valid, other=0.0).to(tl.float32)
    corr = tl.zeros((NG_PAD, GS_PAD), tl.float32)
    if HAS_CORR:
        corr = tl.load(corr_ptr + flat, mask=valid, other=0.0).to(tl.float32)
    if GDC:
        gdc_wait()  # the partial logits are kernel 1's output
        gdc_launch_dependents()
    ptrs = part_ptr + t * E + flat
    acc = tl.load(ptrs, mask=valid, other=0.0)
    for s in tl.static_range(1, SPLIT):  # in split order: deterministic
        acc += tl.load(ptrs + s * T * E, mask=valid, other=0.0)
    logits = acc
    if HAS_BIAS:
        logits = logits + bias
    if ROUND == 1:  # the source graph's router wrote bf16 logits (a bf16 nn.Linear): the same values
        logits = logits.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        logits = logits.to(tl.float16).to(tl.float32)
    if TOPK_FIRST:
        scores = logits
    elif SIGMOID:
        scores = tl.sigmoid(logits)
    else:
        ex = tl.where(valid, tl.exp(logits - _max2d(tl.where(valid, logits, NEG))), 0.0)
        scores = ex / tl.sum(tl.sum(ex, axis=1), axis=0)
    sel = scores
    if HAS_CORR:
        sel = scores + corr
    key = tl.where(valid, _key(sel, flat, BIG), DEAD)
    if NG > 1:
        # A group's score: the sum of its two largest selection values (the top 2 keys of its row: a group holding
        # two equal maxima scores twice it, as the reference's top-2 sum does; a sum of two is the same either way).
        top2 = tl.topk(key, 2)
        gi = tl.arange(0, NG_PAD)
        gkey = tl.where(gi < NG, _key(tl.sum(_key_value(top2), axis=1), gi, BIG), DEAD)
        # the topk_group best groups (equal scores: the lower group id): those at or above the topk_group-th key of
        # the group keys sorted (descending; a handful of them)
        ranked = tl.sort(gkey, descending=True)
        keep = gkey >= tl.min(tl.where(tl.arange(0, NG_PAD) < TOPK_GROUP, ranked, 2**63 - 1), axis=0)
        if FILL_ZERO:  # the dropped groups' experts compete with selection value 0.0 (Hugging Face's masked_fill)
            key = tl.where(keep[:, None], key, tl.where(valid, _key(tl.zeros_like(sel), flat, BIG), DEAD))
        else:
            key = tl.where(keep[:, None], key, DEAD)
    # The k best keys, in descending order (equal values: the lower expert id first): Triton's bitonic top-k over
    # every lane at once -- a few compare-exchange stages, no chain of k dependent reductions.
    top = tl.topk(tl.reshape(key, (NG_PAD * GS_PAD,)), K_PAD)
    kk = tl.arange(0, K_PAD)
    k_ok = kk < K
    ids = _key_id(top, BIG)
    READ_BACK: tl.constexpr = HAS_CORR or (FILL_ZERO and NG > 1)  # a chosen selection value may not be its score
    if READ_BACK:
        # the weights are the unbiased scores of the ids chosen: written over this token's first partial row (read
        # by this program only, and by every thread of it before the first barrier) and read back by id
        tl.debug_barrier()
        tl.store(ptrs, scores, mask=valid)
        tl.debug_barrier()
        wts = tl.load(part_ptr + t * E + ids, mask=k_ok, other=0.0)
    else:  # the value chosen is the weight
        wts = _key_value(top)
    if TOPK_FIRST:  # softmax over the k selected logits (the first is the largest)
        ex = tl.where(k_ok, tl.exp(wts - tl.max(tl.where(k_ok, wts, NEG), axis=0)), 0.0)
        wts = ex / tl.sum(ex, axis=0)
    if RENORM:
        total = tl.sum(tl.where(k_ok, wts, 0.0), axis=0)
        if RENORM_FLOOR:
            total = tl.maximum(total, renorm_eps)
        else:
            total = total + renorm_eps
        wts = wts / total
    if SCALE_PTR:
        wts = wts * tl.load(scale_ptr).to(tl.float32)
    else:
        wts = wts * scale
    tl.store(w_out_ptr + t * stride_wt + kk, wts, mask=k_ok)
    tl.store(id_out_ptr + t * stride_it + kk, ids, mask=k_ok)


# ------------------------------------------------------------------------------------------------
# launch
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _device_facts(index: int) -> tuple[int, bool]:
    """(SM count, has PDL: sm_90+) of a CUDA device."""
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, props.major >= 9


def _has_gdc(dev: torch.device) -> bool:
    """Whether the kernels hold the PDL instructions: sm_90+, a Triton with them, not the interpreter."""
    if gdc_wait is None or _INTERPRET or dev.type != "cuda":
        return False
    return _device_facts(dev.index if dev.index is not None else torch.cuda.current_device())[1]


def _num_sms(dev: torch.device) -> int:
    if dev.type != "cuda":
        return 132
    return _device_facts(dev.index if dev.index is not None else torch.cuda.current_device())[0]


def _check_limits(T: int, H: int, E: int, top_k: int) -> None:
    if T > MAX_T:
        _fail(f"T={T} tokens exceeds the kernel's limit of {MAX_T} (MAX_T): it is for decode; use the ATen routing")
    if E > MAX_E:
        _fail(f"E={E} experts exceeds the kernel's limit of {MAX_E} (MAX_E)")
    if H > MAX_H:
        _fail(f"H={H} exceeds the kernel's limit of {MAX_H} (MAX_H)")
    if H < 1:
        _fail("H=0: an empty hidden dimension")
    if top_k > MAX_K:
        _fail(f"top_k={top_k} exceeds the kernel's limit of {MAX_K} (MAX_K)")


def _check_out(name: str, buf: Optional[torch.Tensor], T: int, k: int, dtype: torch.dtype, dev: torch.device):
    if buf is None:
        return torch.empty((T, k), dtype=dtype, device=dev)
    if not isinstance(buf, torch.Tensor) or tuple(buf.shape) != (T, k) or buf.dtype != dtype:
        _fail(
            f"{name} must be a [{T}, {k}] {dtype} tensor, got {getattr(buf, 'shape', None)} {getattr(buf, 'dtype', None)}"
        )
    if buf.device != dev:
        _fail(f"{name} is on {buf.device}, hidden_states on {dev}")
    if k > 1 and buf.stride(1) != 1:
        _fail(f"{name} must have unit stride along k, got strides {buf.stride()}")
    return buf


def route(
    hidden_states: torch.Tensor,
    router_weight: torch.Tensor,
    *,
    top_k: int,
    pdl: bool = False,
    out_weights: Optional[torch.Tensor] = None,
    out_ids: Optional[torch.Tensor] = None,
    config: Optional[RouteConfig] = None,
    **semantics,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``route_reference``'s result from the two kernels (the module docstring): ``(out_weights [T, k] in
    ``weights_dtype`` (float32 by default), out_ids int32 [T, k])``, written into the given buffers when passed
    (unit stride along k). ``semantics``: ``route_args``' keywords. ``pdl``: launch the first kernel with
    Programmatic Dependent Launch (sm_90+; no effect elsewhere). ``config``: the logits kernel's tile
    (``heuristic`` when None)."""
    args = route_args(hidden_states, router_weight, top_k=top_k, **semantics)
    return launch(args, pdl=pdl, out_weights=out_weights, out_ids=out_ids, config=config)


def run(args: RouteArgs, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The adapter of ``rubin.route``: the two kernels for a decode-sized call (``T <= MAX_T``); a larger call (a
    graph compiled with a symbolic T, run at prefill) runs the op's reference, whose tie rule is the same."""
    if args.T > MAX_T:
        return reference(args)
    return launch(args, pdl=pdl)


_ROUND = {None: 0, torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def launch(
    args: RouteArgs,
    pdl: bool = False,
    out_weights: Optional[torch.Tensor] = None,
    out_ids: Optional[torch.Tensor] = None,
    config: Optional[RouteConfig] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the two kernels on validated arguments (``route``'s contract)."""
    x, w = args.hidden_states, args.router_weight
    T, H, E, top_k = args.T, args.H, args.E, args.top_k
    _check_limits(T, H, E, top_k)
    dev = x.device
    out_w = _check_out("out_weights", out_weights, T, top_k, args.weights_dtype, dev)
    out_i = _check_out("out_ids", out_ids, T, top_k, torch.int32, dev)
    if dev.type != "cuda" and not _INTERPRET:
        _fail(f"the kernels need CUDA tensors, got {dev} (TRITON_INTERPRET=1 runs them on the CPU, for tests)")
    if T == 0:
        return out_w, out_i
    cfg = config or heuristic(T, E, H, _num_sms(dev))
    for name in ("block_e", "block_k"):
        v = getattr(cfg, name)
        if v < 8 or v & (v - 1):
            _fail(f"config.{name}={v} must be a power of two >= 8")
    mma = T > FMA_MAX_T if cfg.mma is None else cfg.mma
    if mma and cfg.block_e < 16:
        cfg = replace(cfg, block_e=16)  # tl.dot's smallest N
    if _INTERPRET:
        compute = tl.float32  # the interpreter's dot takes no bf16
    elif x.dtype == w.dtype and x.dtype != torch.float32:
        compute = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16
    else:
        compute = tl.float32
    t_pad = max(16, next_power_of_2(T)) if mma else 1
    if mma:  # the dot's operands go through shared memory: at most 96 KB of it (fp32 at T = 64 would take 160)
        esize = 4 if compute == tl.float32 else 2
        bk = cfg.block_k
        while (t_pad + cfg.block_e) * bk * esize > 96 * 1024 and bk > 64:
            bk //= 2
        cfg = replace(cfg, block_k=bk)
    split = cdiv(H, cfg.block_k)
    if split > MAX_H // 64:
        _fail(f"config.block_k={cfg.block_k} cuts H={H} into {split} slices; at most {MAX_H // 64} are summed")
    gdc = _has_gdc(dev)
    part = torch.empty((split, T, E), dtype=torch.float32, device=dev)
    launcher(_router_logits_kernel)[(cdiv(E, cfg.block_e), split)](
        x,
        w,
        part,
        T,
        E,
        H,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        BE=cfg.block_e,
        BK=cfg.block_k,
        T_PAD=t_pad,
        MMA=mma,
        COMPUTE=compute,
        GDC=gdc,
        num_warps=cfg.num_warps,
        num_stages=1,
        **({"launch_pdl": True} if pdl and gdc else {}),
    )
    ng = args.n_group if args.order == "score_then_topk" else 1
    gs = E // ng
    st, scale = args.scale_tensor, float(args.scale)
    if st is not None and st.device != dev:  # a 0-d CPU tensor (Dynamo's wrapped float): its value, read on the host
        st, scale = None, float(st)
    launcher(_route_topk_kernel)[(T,)](
        part,
        args.router_bias if args.router_bias is not None else part,
        args.correction_bias if args.correction_bias is not None else part,
        st if st is not None else part,
        out_w,
        out_i,
        T,
        scale,
        float(args.renorm_eps),
        out_w.stride(0),
        out_i.stride(0),
        SPLIT=split,
        NG=ng,
        GS=gs,
        NG_PAD=next_power_of_2(ng),
        GS_PAD=next_power_of_2(gs),
        K=top_k,
        K_PAD=min(max(2, next_power_of_2(top_k)), next_power_of_2(ng) * next_power_of_2(gs)),  # tl.topk: <= its lanes
        TOPK_GROUP=args.topk_group if ng > 1 else 1,
        SIGMOID=args.scoring == "sigmoid",
        TOPK_FIRST=args.order == "topk_then_softmax",
        RENORM=bool(args.renormalize),
        RENORM_FLOOR=bool(args.renorm_floor),
        HAS_BIAS=args.router_bias is not None,
        HAS_CORR=args.correction_bias is not None,
        SCALE_PTR=st is not None,
        ROUND=_ROUND[args.logits_dtype],
        FILL_ZERO=args.group_fill == "0",
        GDC=gdc,
        num_warps=cfg.topk_warps,
        num_stages=1,
        **({"launch_pdl": True} if gdc else {}),  # our own second kernel: PDL on the first is always safe
    )
    return out_w, out_i
