"""FlashInfer's sm_90 kernels beside rubin's alternatives for the same call, each called through its canonical op.

    PYTHONPATH=. python benchmarks/flashinfer_kernels.py --out benchmarks/results          # every table (~5 min with JIT)
    PYTHONPATH=. python benchmarks/flashinfer_kernels.py --quick --ops gemm               # one shape per table: a smoke test
    python benchmarks/flashinfer_kernels.py --dry-run                                      # no GPU: build every call, time none

What is timed is what a compiled graph runs: ``torch.ops.rubin.attention(..., impl="<kernel>@sm90")`` and
``torch.ops.rubin.gemm(..., impl=...)``, i.e. the registered kernel's adapter (for FlashInfer: the weights
prepared once, the call built and checked, FlashInfer called, its result finished into the op's layout). Every
FlashInfer kernel registered on the op is asked for every shape (``Kernel.check(target, spec)``, the registry's
answer); one that declines (sm_100-only entry points, a package missing, FA3 with an FP8 KV cache) is a "not
run" line with its reason, never an abort.

Tables:

* attention, Qwen3-30B-A3B heads (32 query / 4 KV heads of 128), bf16 queries:
  - prefill: B = 1, S = Skv in {512, 2048, 8192}, causal; q / k / v as Hugging Face's projections give them
    ([B, S, H, D] memory seen as [B, H, S, D]);
  - decode: S = 1, no mask, Skv in {4096, 16384, 32768}, B in {1, 8}; k / v the slices [:, :, :Skv] of a
    contiguous static cache of 32768 + 256 positions (what Hugging Face's StaticCache holds);
  - decode over an FP8 e4m3 cache (k_scale / v_scale one float32 element each);
  impls: flashinfer_fa2 / flashinfer_fa3 (single_prefill_with_kv_cache), torch (repeat_kv + SDPA: the op's
  ATen form), triton (rubin's split-KV decode kernel; decode only), reference (FP8: dequantise, then the same)
  and ``sdpa_gqa``: plain ``F.scaled_dot_product_attention(..., enable_gqa=True)``, no op impl (what a model
  without repeat_kv calls).
* gemm, (N, K) in {(4096, 2048) Qwen3 q-proj-ish, (2048, 4096) o_proj, (6144, 4096) Llama qkv, (7168, 2048)
  DeepSeek-V3 TP8 o}, M in {1, 16, 128, 1024}, weights as ``nn.Linear`` holds them (``b = W.t()``):
  - W8A8 FP8 per tensor (e4m3 a and b, one float32 scale each, bf16 out): flashinfer_cublas (bmm_fp8),
    flashinfer_cudnn (mm_fp8), torch (torch._scaled_mm), triton;
  - FP8 128 x 128 block weights with bf16 a (weight-only): flashinfer_deepgemm (fp8_blockscale_gemm_sm90: it
    quantises a per 1 x 128 group itself, so FP8 tolerance), triton, reference (the float32 dequantise-and-
    multiply, what rubin lowers it to without a kernel);
  - bf16: flashinfer_cudnn (mm_bf16), torch (cuBLAS), triton.
  The triton GEMM decides per call (kernels/triton/gemm.py:choose): ours where the tuned table says it beats
  cuBLAS, cuBLAS otherwise (always for M > 64 unless weight-only FP8); a row whose call runs cuBLAS says so and
  is not counted for "fastest" (it is the torch row again).

Per row: the median device time per call (us) of CUDA-graph replays (16 calls captured in one graph over
rotating input copies, several times L2, so that each call reads from HBM as in a decode step; a call that
cannot be captured is timed eagerly with events and says so); the first call's wall time ("first call s": the
JIT compile, cuDNN's graph build, DeepGEMM's per-shape kernel); the max relative error max|out - ref| / max|ref|
against the op's reference on float32 copies of the same inputs (FP8: dequantised with the same scales); bytes
(each input read once, the output written once) and FLOPs (2MNK; attention 4 * B * Hq * D per attended pair,
causal counting the attended half); % of the copy bandwidth measured at the start (2 GiB device-to-device,
read + write) and % of the dense tensor peak (989 TFLOP/s bf16, 1979 FP8: benchmarks/gemm.py's constants); the
fastest impl per shape (bold). A kernel that raises is a FAILED row with its message; the rest still run.

JIT: before timing, the FlashInfer variants of every table (FA2 / FA3 bf16, FA2 FP8 KV, bmm_fp8, cuDNN,
fp8_blockscale_gemm_sm90) are built at once in threads, one per variant (``--serial-jit``: each at its first
row instead); their build times are the "first call" table. Writes flashinfer-<gpu>.{md,json} (gpu_names.py) under ``--out``
after every shape, so a run cut short keeps what it measured.

``--dry-run`` (no GPU needed): builds every row's arguments on meta tensors, asks the registry, builds and checks
each FlashInfer call (``adapter.build``) and binds it to the installed function's signature, calls each op with
its impl string (the op's fake kernel: argument validation and output shape) and the float32 reference, times
nothing; exits 1 if any row's construction raised.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import math
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))  # gpu_names

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import rubin_compile  # noqa: E402, F401  (registers torch.ops.rubin.* and every kernel onto the ops)
from rubin_compile import target as target_mod  # noqa: E402
from rubin_compile.kernels.flashinfer import adapter as fi  # noqa: E402
from rubin_compile.ops import attention as attn_ops  # noqa: E402
from rubin_compile.ops import gemm as gemm_ops  # noqa: E402
from rubin_compile.ops.attention import AttentionArgs  # noqa: E402
from rubin_compile.ops.gemm import SCALE_BLOCK, GemmArgs  # noqa: E402
from rubin_compile.ops.nodes import dtype_name  # noqa: E402
from gpu_names import gpu_slug  # noqa: E402  (benchmarks/gpu_names.py)
from rubin_compile.ops.registry import CANONICAL_OPS, KernelSpec, Launch, UnknownKernelError  # noqa: E402

CALLS = 16  # calls captured per graph
L2_BYTES = 50e6  # the H200's L2; inputs rotate over at least 3x this
PEAK_TFLOPS = {"bf16": 989.0, "fp8": 1979.0}  # H200 dense, without sparsity (benchmarks/gemm.py's constants)
HQ, HKV, D = 32, 4, 128  # Qwen3-30B-A3B attention
MAX_LEN = 32768 + 256  # the static cache the decode k / v are slices of
PREFILL_S = (512, 2048, 8192)
DECODE_SKV = (4096, 16384, 32768)
DECODE_B = (1, 8)
GEMM_NK = {
    (4096, 2048): "Qwen3 q-proj-ish",
    (2048, 4096): "o_proj",
    (6144, 4096): "Llama qkv",
    (7168, 2048): "DeepSeek-V3 TP8 o",
}
GEMM_MS = (1, 16, 128, 1024)
KV8_SCALES = (1 / 32, 1 / 16)  # k_scale, v_scale of the FP8 cache: its values are N(0, 1) / scale
E4M3, BF16 = torch.float8_e4m3fn, torch.bfloat16
SDPA_GQA = "sdpa_gqa"  # not an op impl: plain F.scaled_dot_product_attention(..., enable_gqa=True)
TRITON_GEMM_MAX_M = 64  # kernels/triton/gemm.py:MAX_M (not imported: that imports Triton)


@dataclass(frozen=True)
class Group:
    """One table: an op in one format, the rubin alternatives timed beside every FlashInfer kernel of the op."""

    op: str
    name: str
    title: str
    alternatives: tuple[str, ...]
    peak: str  # key of PEAK_TFLOPS
    tol: float  # max relative error a row may have and still count


GROUPS = {
    "attention": (
        Group(
            "attention", "prefill", "prefill, B = 1, S = Skv, causal, bf16", ("torch", "triton", SDPA_GQA), "bf16", 2e-2
        ),
        Group(
            "attention",
            "decode",
            "decode, S = 1, static-cache slices, bf16",
            ("torch", "triton", SDPA_GQA),
            "bf16",
            2e-2,
        ),
        Group("attention", "decode_fp8", "decode, FP8 e4m3 KV cache", ("triton", "reference", "torch"), "bf16", 3e-2),
    ),
    "gemm": (
        Group("gemm", "w8a8", "W8A8 FP8 per tensor (e4m3 a and b, bf16 out)", ("torch", "triton"), "fp8", 2e-2),
        Group(
            "gemm",
            "fp8_block",
            "FP8 128x128 block weights, bf16 a (weight-only)",
            ("triton", "reference", "torch"),
            "fp8",
            2e-2,
        ),
        Group("gemm", "bf16", "bf16", ("torch", "triton"), "bf16", 2e-2),
    ),
}
# Rows that compute something else by design get their own tolerance: DeepGEMM quantises the bf16 activations to
# e4m3 per 1 x 128 group (kernels/flashinfer/gemm.py:DeepGemmFp8Block), the reference does not.
TOL = {("fp8_block", "flashinfer_deepgemm"): 1e-1}
NOTES = {
    ("attention", "torch"): "repeat_kv + SDPA (the op's ATen form)",
    ("attention", "reference"): "dequantise + repeat_kv + SDPA",
    ("attention", SDPA_GQA): "F.sdpa(enable_gqa=True), no op",
    ("gemm", "reference"): "float32 dequantise + matmul",
}


def shapes(group: Group, quick: bool) -> list[dict[str, int]]:
    if group.name == "prefill":
        return [dict(B=1, S=s, Skv=s) for s in (PREFILL_S[:1] if quick else PREFILL_S)]
    if group.op == "attention":
        if quick:
            return [dict(B=1, S=1, Skv=DECODE_SKV[0])]
        return [dict(B=b, S=1, Skv=skv) for b in DECODE_B for skv in DECODE_SKV]
    if quick:
        return [dict(M=16, N=4096, K=2048)]
    return [dict(M=m, N=n, K=k) for (n, k) in GEMM_NK for m in GEMM_MS]


def shape_label(group: Group, s: dict[str, int]) -> str:
    if group.op == "gemm":
        return f"N={s['N']} K={s['K']} M={s['M']}"
    if group.name == "prefill":
        return f"B={s['B']} S=Skv={s['S']}"
    return f"B={s['B']} Skv={s['Skv']}"


SKIP: set[str] = set()  # --skip: kernels not run (e.g. one that aborts the process on this machine)


def candidates(group: Group) -> list[str]:
    """Every FlashInfer kernel of the op (the registry's order), then the group's alternatives; without --skip's."""
    names = [k.name for k in CANONICAL_OPS[group.op].kernels() if k.name.startswith("flashinfer_")]
    return [n for n in names + list(group.alternatives) if n not in SKIP]


# ------------------------------------------------------------------------------------------------
# inputs, floors, references
# ------------------------------------------------------------------------------------------------


def to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor e4m3: (x / scale) in e4m3 and the dequantising float32 scale [] (no host sync)."""
    scale = (x.abs().amax().float() / 448.0).clamp(min=1e-12)
    return (x.float() / scale).to(E4M3), scale


def block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] in e4m3 with 128 x 128 block scales; returns W and rubin's b_scale [K/128, N/128] (W's, .t())."""
    N, K = w.shape
    blocks = w.float().reshape(N // SCALE_BLOCK, SCALE_BLOCK, K // SCALE_BLOCK, SCALE_BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)  # [N/128, K/128]
    q = (blocks / scale[:, None, :, None]).reshape(N, K).to(E4M3)
    return q, scale.t().contiguous()


def read_bytes(group: Group, s: dict[str, int]) -> float:
    """Bytes one call must read (what the copies rotate over)."""
    if group.op == "gemm":
        return s["N"] * s["K"] * (2 if group.name == "bf16" else 1)
    kv = 1 if group.name == "decode_fp8" else 2
    return 2 * s["B"] * HKV * s["Skv"] * D * kv + s["B"] * HQ * s["S"] * D * 2


def floor(group: Group, s: dict[str, int]) -> tuple[float, float]:
    """(FLOPs, bytes) of one call at the floor: each input read once, the output written once."""
    if group.op == "gemm":
        M, N, K = s["M"], s["N"], s["K"]
        a_bytes = 1 if group.name == "w8a8" else 2
        w_bytes = 2 if group.name == "bf16" else 1
        scales = 4 * math.ceil(K / SCALE_BLOCK) * math.ceil(N / SCALE_BLOCK) if group.name == "fp8_block" else 8
        return 2.0 * M * N * K, M * K * a_bytes + N * K * w_bytes + scales + M * N * 2
    B, S, Skv = s["B"], s["S"], s["Skv"]
    pairs = S * (S + 1) / 2 if group.name == "prefill" else S * Skv
    return 4.0 * B * HQ * D * pairs, read_bytes(group, s) + B * HQ * S * D * 2


def copies_for(group: Group, s: dict[str, int]) -> int:
    return max(1, min(CALLS, math.ceil(3 * L2_BYTES / read_bytes(group, s))))


def make_args(group: Group, s: dict[str, int], copies: int, device: str, weights: Optional[dict] = None) -> list:
    """``copies`` argument dataclasses of one shape, random data. GEMM weights come from ``weights`` (a cache the
    caller keeps per (N, K), so that the rows of one weight at every M read the same tensors)."""
    if group.op == "attention":
        return [_attention_args(group, s, device) for _ in range(copies)]
    M, N, K = s["M"], s["N"], s["K"]
    key = (group.name, N, K)
    if weights is None:
        weights = {}
    have = weights.get(key, [])
    while len(have) < copies:
        have.append(_gemm_weight(group, N, K, device))
    weights[key] = have
    x = torch.randn(M, K, device=device)
    if group.name == "w8a8":
        a, sa = to_fp8(x)
        return [GemmArgs(a, w["b"], a_scale=sa, b_scale=w["b_scale"], out_dtype=BF16) for w in have[:copies]]
    a = x.to(BF16)
    return [GemmArgs(a, w["b"], b_scale=w.get("b_scale")) for w in have[:copies]]


def _gemm_weight(group: Group, N: int, K: int, device: str) -> dict[str, torch.Tensor]:
    w = torch.randn(N, K, device=device) / K**0.5  # W [N, K] as nn.Linear stores it; the op takes b = W.t()
    if group.name == "w8a8":
        q, scale = to_fp8(w)
        return {"b": q.t(), "b_scale": scale}
    if group.name == "fp8_block":
        q, scale = block_fp8(w)
        return {"b": q.t(), "b_scale": scale}
    return {"b": w.to(BF16).t()}


def _attention_args(group: Group, s: dict[str, int], device: str) -> AttentionArgs:
    B, S, Skv = s["B"], s["S"], s["Skv"]
    q = torch.randn(B, S, HQ, D, device=device, dtype=BF16).transpose(1, 2)
    if group.name == "prefill":  # Hugging Face projections: [B, S, H, D] memory seen as [B, H, S, D]
        k = torch.randn(B, Skv, HKV, D, device=device, dtype=BF16).transpose(1, 2)
        v = torch.randn(B, Skv, HKV, D, device=device, dtype=BF16).transpose(1, 2)
        return AttentionArgs(q, k, v, is_causal=True)
    cache = (B, HKV, MAX_LEN, D)  # a static cache; the call reads its first Skv positions
    if group.name == "decode":
        k = torch.randn(cache, device=device, dtype=BF16)[:, :, :Skv]
        v = torch.randn(cache, device=device, dtype=BF16)[:, :, :Skv]
        return AttentionArgs(q, k, v)
    ks, vs = KV8_SCALES
    k = (torch.randn(cache, device=device, dtype=BF16) / ks).to(E4M3)[:, :, :Skv]
    v = (torch.randn(cache, device=device, dtype=BF16) / vs).to(E4M3)[:, :, :Skv]
    k_scale = torch.full((), ks, device=device, dtype=torch.float32)
    v_scale = torch.full((), vs, device=device, dtype=torch.float32)
    return AttentionArgs(q, k, v, k_scale=k_scale, v_scale=v_scale)


def reference_fp32(op: str, args) -> torch.Tensor:
    """The op's reference on float32 copies of ``args`` (FP8 dequantised with its scales): what rows are checked
    against."""
    if op == "gemm":
        if args.fp8:
            fa, fb = gemm_ops.dequantized(args)
            return fa @ fb
        return gemm_ops.reference(GemmArgs(args.a.float(), args.b.float()))
    key = args.key.float() * (args.k_scale if args.k_scale is not None else 1.0)
    value = args.value.float() * (args.v_scale if args.v_scale is not None else 1.0)
    return attn_ops.reference(AttentionArgs(args.query.float(), key, value, args.attn_mask, args.is_causal, args.scale))


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if tuple(out.shape) != tuple(ref.shape):
        raise AssertionError(f"result shape {tuple(out.shape)} != the reference's {tuple(ref.shape)}")
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


# ------------------------------------------------------------------------------------------------
# the registry's answer, and the calls
# ------------------------------------------------------------------------------------------------


def spec_of(op: str, args) -> KernelSpec:
    """The KernelSpec a rubin.<op> node of these arguments gets (ops/<op>.py:<op>_spec, from tensors)."""
    if op == "attention":
        activation = "mask" if args.attn_mask is not None else "causal" if args.is_causal else None
        names = ("D", "Dv", "Hq", "Hkv", "S", "Skv", "B")
        return KernelSpec(
            op="attention",
            quant=fi.quant_of("attention", args),
            act_dtype=dtype_name(args.query.dtype),
            weight_dtype=dtype_name(args.key.dtype),
            shape=tuple((n, getattr(args, n)) for n in names),
            activation=activation,
        )
    quant = fi.quant_of("gemm", args)
    return KernelSpec(
        op="gemm",
        quant=quant,
        block_shape=(SCALE_BLOCK, SCALE_BLOCK) if quant == "fp8_block" else None,
        act_dtype=dtype_name(args.a.dtype),
        weight_dtype=dtype_name(args.b.dtype),
        shape=(("M", args.M), ("N", args.N), ("K", args.K)),
        activation=None if args.epilogue == "none" else args.epilogue,
    )


def soft_decline(group: str, kernel: str) -> bool:
    """Rows that run although the registry declines them, their answer kept beside the time:

    * the triton GEMM declines shapes where the tuned table says cuBLAS is faster, off the table, and M > 64, yet
      its adapter runs any call (falling back to cuBLAS itself): the row says what the call runs;
    * torch declines W8A8 (torch_provider._gemm_supports tests ``act_dtype in ("bfloat16", "float16")`` before its
      FP8 branch), yet its adapter (ops/gemm.py:aten) runs it with ``torch._scaled_mm``, the per-tensor FP8 GEMM a
      graph lowered to ATen gets: the alternative the FlashInfer FP8 GEMMs are measured against.
    """
    return (kernel == "triton" and group in ("w8a8", "fp8_block", "bf16")) or (group, kernel) == ("w8a8", "torch")


def registry(op: str, kernel: str, spec: KernelSpec, target, here) -> tuple[Optional[str], Optional[str]]:
    """(why the kernel declines ``spec`` on ``target``, why this machine cannot run it); ``None`` where not."""
    try:
        k = CANONICAL_OPS[op].kernel(kernel)
    except UnknownKernelError as exc:
        return str(exc), None
    return k.check(target, spec), (k.unavailable_here(here) if here is not None else None)


def op_call(op: str, impl: str, args) -> Callable[[], torch.Tensor]:
    """The op called as a compiled graph calls it (``impl``: "<kernel>@<target>"), or plain SDPA with GQA."""
    if impl == SDPA_GQA:
        return lambda: F.scaled_dot_product_attention(
            args.query, args.key, args.value, is_causal=args.is_causal, scale=args.scale, enable_gqa=True
        )
    if op == "attention":
        return lambda: torch.ops.rubin.attention(
            args.query,
            args.key,
            args.value,
            attn_mask=args.attn_mask,
            is_causal=args.is_causal,
            scale=args.scale,
            k_scale=args.k_scale,
            v_scale=args.v_scale,
            impl=impl,
        )
    return lambda: torch.ops.rubin.gemm(
        args.a,
        args.b,
        bias=args.bias,
        epilogue=args.epilogue,
        residual=args.residual,
        a_scale=args.a_scale,
        b_scale=args.b_scale,
        out_dtype=args.out_dtype,
        impl=impl,
    )


def triton_gemm_runs(args: GemmArgs, device_name: str, sms: int) -> tuple[str, bool, Any]:
    """What ``triton`` runs for this call (kernels/triton/gemm.py:choose, as its adapter decides), whether that is
    cuBLAS, and our config for it."""
    from rubin_compile.kernels.triton import gemm as tg

    choice = tg.choose(args.M, args.N, args.K, tg.weight_format(args), device_name, sms)
    if choice.kernel == "triton":
        return f"ours, {choice.config.describe()}: {choice.describe()}", False, choice.config
    return f"runs cuBLAS: {choice.describe()}", True, choice.config


def dry_build(op: str, kernel: str, args) -> str:
    """For a FlashInfer kernel: its adapter's checked call on these (meta) arguments, bound to the installed
    function's signature; what it calls."""
    adapter = fi.adapter_for(op, kernel, fi.quant_of(op, args))
    if adapter is None:
        raise AssertionError(f"the registry accepts {kernel} but no adapter is registered for it")
    call = fi.build(adapter, args, Launch())
    call.bound()
    backend = call.kwargs.get("backend")
    return call.function.rpartition(".")[2] + (f"(backend={backend!r})" if backend else "")


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------


def graph_us(fns: list[Callable[[], Any]], reps: int) -> tuple[float, str]:
    """Median device time per call of ``fns`` (CALLS calls, rotating over them) captured in one CUDA graph and
    replayed; eager event timing, said so, where the capture fails."""
    seq = [fns[i % len(fns)] for i in range(CALLS)]
    for fn in seq:  # every copy once outside the capture: FlashInfer prepares its weights here (never in a capture)
        fn()
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for fn in seq:
                fn()
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
    except Exception as exc:
        torch.cuda.synchronize()
        return eager_us(seq, reps), f"eager (capture failed: {type(exc).__name__}: {str(exc)[:120]})"
    ts = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end) * 1e3 / CALLS)
    del g
    return statistics.median(ts), "graph"


def eager_us(seq: list[Callable[[], Any]], reps: int) -> float:
    ts = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for fn in seq:
            fn()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end) * 1e3 / len(seq))
    return statistics.median(ts)


def short(exc: BaseException, n: int = 400) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:n]}"


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------


@dataclass
class Context:
    target: Any
    here: Any  # this machine's target; None in a dry run (the registry is asked about the target alone)
    dry: bool
    reps: int
    bw: float  # copy bandwidth GB/s (0 in a dry run)
    device_name: str
    sms: int


def run_shape(group: Group, s: dict[str, int], ctx: Context, weights: dict) -> list[dict]:
    device = "meta" if ctx.dry else "cuda"
    copies = 1 if ctx.dry else copies_for(group, s)
    flops, nbytes = floor(group, s)
    base = dict(op=group.op, group=group.name, shape=s, shape_label=shape_label(group, s), flops=flops, bytes=nbytes)
    try:
        args = make_args(group, s, copies, device, weights)
        ref = reference_fp32(group.op, args[0])
        spec = spec_of(group.op, args[0])
    except Exception as exc:  # the inputs themselves (out of memory, a lost CUDA context): every row says so
        return [dict(base, impl=k, kernel=k, status="FAILED", error=f"inputs: {short(exc)}") for k in candidates(group)]
    base["quant"] = spec.quant
    rows = []
    for kernel in candidates(group):
        impl = kernel if kernel == SDPA_GQA else f"{kernel}@{ctx.target.name}"
        tol = TOL.get((group.name, kernel), group.tol)
        row = dict(base, impl=impl, kernel=kernel, status="", note=NOTES.get((group.op, kernel), ""), tol=tol)
        rows.append(row)
        declined, unavailable = (
            (None, None) if kernel == SDPA_GQA else registry(group.op, kernel, spec, ctx.target, ctx.here)
        )
        if unavailable or (declined and not soft_decline(group.name, kernel)):
            row.update(status="unsupported", reason=unavailable or declined)
            continue
        if declined:  # run anyway (soft_decline says why), the registry's answer kept
            row.update(registry=declined, note=f"registry declines: {declined}")
        forced = None
        if group.op == "gemm" and kernel == "triton":
            runs, cublas, config = triton_gemm_runs(args[0], ctx.device_name, ctx.sms)
            row.update(note=runs, duplicate=cublas)
            if cublas and s["M"] <= TRITON_GEMM_MAX_M:
                forced = dict(
                    base,
                    impl="triton kernel (forced)",
                    kernel="triton_forced",
                    status="",
                    tol=tol,
                    not_graph=True,
                    note=f"no op impl: kernels/triton/gemm.py:launch with choose()'s config {config.describe()}",
                )
        measure(row, [op_call(group.op, impl, a) for a in args], ref, group, ctx, copies, args[0])
        if forced is not None:
            rows.append(forced)
            if ctx.dry:
                forced["status"] = "dry-run"
                continue
            from rubin_compile.kernels.triton import gemm as tg

            measure(forced, [lambda a=a, c=config: tg.launch(a, c) for a in args], ref, group, ctx, copies, args[0])
    ok = [r for r in rows if counts(r)]
    if ok:
        best = min(ok, key=lambda r: r["us"])
        best["fastest"] = True
        for r in rows:
            if "us" in r:
                r["vs_fastest"] = r["us"] / best["us"]
    return rows


def counts(row: dict) -> bool:
    """Whether ``row`` competes for "fastest": timed, within its tolerance, and what a graph runs (not the torch row
    again under another name, not a kernel forced outside the op)."""
    return row["status"] == "ok" and not row.get("duplicate") and not row.get("not_graph")


def measure(row: dict, fns: list, ref: torch.Tensor, group: Group, ctx: Context, copies: int, args0: Any) -> None:
    """Fill ``row``: the first call (timed), its check against ``ref``, the graph-replay time and what follows from
    it; a dry run calls the op's fake kernel and, for FlashInfer, builds and binds the adapter's call. An exception
    makes the row FAILED with its message."""
    try:
        if ctx.dry:
            if row["kernel"].startswith("flashinfer_"):
                row["call"] = dry_build(group.op, row["kernel"], args0)
            out = fns[0]()
            if tuple(out.shape) != tuple(ref.shape):
                raise AssertionError(f"result shape {tuple(out.shape)} != the reference's {tuple(ref.shape)}")
            row["status"] = "dry-run"
            return
        t0 = time.perf_counter()
        out = fns[0]()
        torch.cuda.synchronize()
        row["first_call_s"] = time.perf_counter() - t0
        err = max_rel_err(out, ref)
        del out
        row["max_rel_err"] = err
        us, timing = graph_us(fns, ctx.reps)
        flops, nbytes = row["flops"], row["bytes"]
        row.update(us=us, timing=timing, copies=copies, GBps=nbytes / us / 1e3, TFLOPs=flops / us / 1e6)
        row["pct_copy_bw"] = 100 * row["GBps"] / ctx.bw
        row["pct_peak"] = 100 * row["TFLOPs"] / PEAK_TFLOPS[group.peak]
        row["status"] = "ok" if err <= row["tol"] else "WRONG"  # NaN is WRONG too
    except Exception as exc:
        row.update(status="FAILED", error=short(exc))
        try:
            torch.cuda.synchronize()
        except Exception as lost:  # a sticky error: the rows after this one will fail as well
            row["error"] += f" (CUDA context lost: {short(lost, 120)})"


def prebuild(groups: list[Group], ctx: Context) -> dict[str, dict]:
    """Every FlashInfer variant's JIT build at once, in threads (one per variant: each compiles a few translation
    units, so one build alone leaves most cores idle): for each (op, kernel, quantisation), the smallest shape of
    its first table, called once. A failure here is recorded and the row's own first call tries again."""
    jobs: dict[str, Callable[[], Any]] = {}
    for group in groups:
        s = shapes(group, quick=True)[0]
        args = make_args(group, s, 1, "cuda")[0]
        spec = spec_of(group.op, args)
        for kernel in candidates(group):
            key = jit_key(group.op, kernel, spec.quant)
            if not kernel.startswith("flashinfer_") or key in jobs:
                continue
            declined, unavailable = registry(group.op, kernel, spec, ctx.target, ctx.here)
            if not (declined or unavailable):
                jobs[key] = op_call(group.op, f"{kernel}@{ctx.target.name}", args)

    def work(fn: Callable[[], Any]) -> dict:
        t0 = time.perf_counter()
        try:
            fn()
            torch.cuda.synchronize()
            return {"s": time.perf_counter() - t0}
        except Exception as exc:
            return {"s": time.perf_counter() - t0, "error": short(exc)}

    if not jobs:
        return {}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {name: pool.submit(work, fn) for name, fn in jobs.items()}
        out = {name: f.result() for name, f in futures.items()}
    print(f"JIT builds ({len(jobs)} concurrent): {time.perf_counter() - t0:.0f} s", flush=True)
    for name, r in out.items():
        print(f"  {name}: {r['s']:.1f} s" + (f"  {r['error']}" if "error" in r else ""), flush=True)
    torch.cuda.empty_cache()
    return out


def jit_key(op: str, kernel: str, quant: str) -> str:
    return f"{op} {kernel} {quant}"


def versions() -> dict[str, str]:
    out = {"torch": torch.__version__}
    for key, dist in (
        ("triton", "triton"),
        ("flashinfer", "flashinfer-python"),
        ("cudnn_frontend", "nvidia-cudnn-frontend"),
    ):
        try:
            out[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            try:  # a carried source tree rather than an installed wheel
                out[key] = str(importlib.import_module(key.split("_")[0]).__version__)
            except Exception:
                out[key] = "not installed"
    if torch.cuda.is_available() and torch.backends.cudnn.is_available():
        out["cudnn"] = str(torch.backends.cudnn.version())
    return out


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=20, check=True).stdout

    try:  # the device machine's copy of the tree may have no .git: "?" (or --commit)
        rev = git("rev-parse", "--short", "HEAD").strip()
        return rev + ("+dirty" if git("status", "--porcelain", "--untracked-files=no").strip() else "")
    except Exception:
        return "?"


# ------------------------------------------------------------------------------------------------
# output
# ------------------------------------------------------------------------------------------------


def _f(v: Optional[float], fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def render(res: dict) -> str:
    meta = res["meta"]
    v = meta["versions"]
    lines = [
        f"# FlashInfer on {meta['gpu']}: every sm_90 candidate beside rubin's alternatives, through the canonical ops",
        "",
        f"torch {v['torch']}, Triton {v['triton']}, FlashInfer {v['flashinfer']}, cuDNN frontend {v['cudnn_frontend']}"
        + (f" (cuDNN {v['cudnn']})" if "cudnn" in v else "")
        + f"; {meta['gpu']} ({meta['target']}, {meta['sms']} SMs), copy bandwidth {meta['copy_GBps']:.0f} GB/s; "
        f"commit {meta['commit']}; `{meta['command']}`" + (" **(dry run: nothing timed)**" if meta["dry_run"] else ""),
        "",
        f"Times: us per call, median of {meta['reps']} replays of a CUDA graph of {CALLS} calls over rotating input "
        "copies (>= 3x L2), through `torch.ops.rubin.<op>(..., impl=...)`. `first call s`: the first call on that "
        "shape (JIT, cuDNN graph build), after the concurrent FlashInfer builds below. `max rel err`: "
        "max|out - ref| / max|ref| against the op's reference on float32 copies of the inputs. `% BW`: floor bytes / "
        f"time / copy bandwidth; `% peak`: FLOPs / time / dense peak ({PEAK_TFLOPS['bf16']:.0f} TFLOP/s bf16, "
        f"{PEAK_TFLOPS['fp8']:.0f} FP8). Bold: the fastest row of the shape that passed its check (triton GEMM rows "
        "that run cuBLAS are not counted: they are the torch row; nor are `triton kernel (forced)` rows, our GEMM launched "
        "with its heuristic config where the op's triton row runs cuBLAS: no graph runs them today).",
    ]
    rows = res["rows"]
    for op, groups in GROUPS.items():
        for group in groups:
            mine = [r for r in rows if r["group"] == group.name]
            if not mine:
                continue
            lines += ["", f"## {op}: {group.title}", ""]
            if op == "gemm":
                lines += ["Shapes: " + "; ".join(f"N={n} K={k} {what}" for (n, k), what in GEMM_NK.items()) + ".", ""]
            table = summary(mine)
            lines += [*table, ""] if table else []
            lines += [
                "| shape | impl | us | vs fastest | first call s | max rel err | GB/s | % BW | TFLOP/s | % peak | note |",
                "|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for r in mine:
                if r["status"] == "unsupported":
                    continue
                impl, us = f"`{r['impl']}`", _f(r.get("us"), ".2f")
                if r.get("fastest"):
                    impl, us = f"**{impl}**", f"**{us}**"
                note = [r.get("note", "")]
                if r["status"] == "FAILED":
                    note.insert(0, f"FAILED: {r['error']}")
                elif r["status"] == "WRONG":
                    note.insert(0, f"WRONG (tolerance {r['tol']:g})")
                elif r["status"] == "dry-run":
                    note.insert(0, f"built {r['call']}" if r.get("call") else "built")
                if r.get("timing", "graph") != "graph":
                    note.append(r["timing"])
                err = r.get("max_rel_err")
                lines.append(
                    f"| {r['shape_label']} | {impl} | {us} | {_f(r.get('vs_fastest'), '.2f')} | "
                    f"{_f(r.get('first_call_s'), '.2f')} | {_f(err, '.1e')} | {_f(r.get('GBps'), '.0f')} | "
                    f"{_f(r.get('pct_copy_bw'), '.0f')} | {_f(r.get('TFLOPs'), '.1f')} | {_f(r.get('pct_peak'), '.1f')} | "
                    f"{cell('; '.join(n for n in note if n), 240)} |"
                )
            not_run: dict[tuple[str, str], list[str]] = {}
            for r in mine:
                if r["status"] == "unsupported":
                    not_run.setdefault((r["impl"], r["reason"]), []).append(r["shape_label"])
            if not_run:
                lines += ["", "Not run (the registry's answer):", ""]
                every = len({r["shape_label"] for r in mine})
                for (impl, reason), where in not_run.items():
                    at = "every shape" if len(where) == every else ", ".join(where)
                    lines.append(f"- `{impl}` ({at}): {reason}")
    lines += ["", *first_calls(res)]
    return "\n".join(lines) + "\n"


def cell(text: str, n: int = 160) -> str:
    """``text`` fit for a table cell: one line, pipes escaped, at most ``n`` characters."""
    return " ".join(str(text).split())[:n].replace("|", "\\|")


def first_calls(res: dict) -> list[str]:
    """Per table and impl: the concurrent JIT build (FlashInfer, unless --serial-jit), the first call of its first
    shape (the JIT itself with --serial-jit, and for Triton) and its slowest first call."""
    out = [
        "## First calls (JIT) per impl",
        "",
        "| table | impl | JIT build s (concurrent) | first call s, first shape | slowest first call s (shape) |",
        "|---|---|---|---|---|",
    ]
    seen: dict[tuple[str, str], list[dict]] = {}
    for r in res["rows"]:
        if r.get("first_call_s") is not None:
            seen.setdefault((r["group"], r["kernel"]), []).append(r)
    for (group, kernel), rs in seen.items():
        build = res.get("prebuild", {}).get(jit_key(rs[0]["op"], kernel, rs[0].get("quant", "")))
        jit = (
            "-"
            if build is None
            else f"{build['s']:.1f}" + (f" ({cell(build['error'], 80)})" if "error" in build else "")
        )
        slow = max(rs, key=lambda r: r["first_call_s"])
        out.append(
            f"| {group} | `{rs[0]['impl']}` | {jit} | {rs[0]['first_call_s']:.2f} | "
            f"{slow['first_call_s']:.2f} ({slow['shape_label']}) |"
        )
    return out if len(out) > 4 else []


def summary(rows: list[dict]) -> list[str]:
    """Per shape: the fastest row, the best FlashInfer row and the best of the rest."""
    out = ["| shape | fastest | us | best FlashInfer | us | best other | us |", "|---|---|---|---|---|---|---|"]
    for label in dict.fromkeys(r["shape_label"] for r in rows):
        ok = [r for r in rows if r["shape_label"] == label and counts(r)]
        if not ok:
            continue
        best = min(ok, key=lambda r: r["us"])
        fl = [r for r in ok if r["kernel"].startswith("flashinfer_")]
        other = [r for r in ok if not r["kernel"].startswith("flashinfer_")]
        cells = [f"`{best['impl']}`", f"{best['us']:.2f}"]
        for part in (fl, other):
            b = min(part, key=lambda r: r["us"]) if part else None
            cells += [f"`{b['impl']}`", f"{b['us']:.2f}"] if b else ["-", "-"]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out if len(out) > 2 else []


def write(res: dict, out: Optional[Path]) -> None:
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / f"flashinfer-{gpu_slug()}.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    (out / f"flashinfer-{gpu_slug()}.md").write_text(render(res))


def log_row(r: dict) -> None:
    if r["status"] == "unsupported":
        text = f"not run: {r['reason'][:140]}"
    elif r["status"] == "FAILED":
        text = f"FAILED {r['error'][:200]}"
    elif r["status"] == "dry-run":
        text = "dry-run ok" + (f": {r['call']}" if r.get("call") else "")
    else:
        text = (
            f"{r['us']:9.2f} us  first {r['first_call_s']:6.2f} s  err {r['max_rel_err']:.1e} {r['status']:5s} "
            f"{r['pct_copy_bw']:5.1f}% BW {r['pct_peak']:5.1f}% peak{'  FASTEST' if r.get('fastest') else ''}"
        )
    note = f"  [{r['note']}]" if r.get("note") and r["status"] != "unsupported" else ""
    print(f"{r['group']:10s} {r['shape_label']:22s} {r['impl']:28s} {text}{note}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="attention,gemm", help="comma-separated: attention, gemm")
    ap.add_argument("--quick", action="store_true", help="one shape per table (a smoke test of every impl)")
    ap.add_argument("--reps", type=int, default=20, help="graph replays per row (the median is reported)")
    ap.add_argument("--out", default=None, help="directory for flashinfer-<gpu>.{md,json} (gpu_names.py)")
    ap.add_argument("--dry-run", action="store_true", help="build every call on meta tensors, time nothing (no GPU)")
    ap.add_argument("--serial-jit", action="store_true", help="build each FlashInfer variant at its first row")
    ap.add_argument("--commit", default=None, help="the commit to report (default: git rev-parse --short HEAD)")
    ap.add_argument("--skip", default="", help="comma-separated kernels not to run (they are left out of the tables)")
    a = ap.parse_args()
    SKIP.update(k.strip() for k in a.skip.split(",") if k.strip())
    ops = [o.strip() for o in a.ops.split(",") if o.strip()]
    unknown = [o for o in ops if o not in GROUPS]
    if unknown:
        ap.error(f"unknown op(s) {unknown}; choose from {list(GROUPS)}")
    if not a.dry_run and not torch.cuda.is_available():
        raise SystemExit("benchmarks/flashinfer_kernels.py needs a CUDA GPU (or --dry-run)")
    out = Path(a.out) if a.out else None
    if a.dry_run:
        target, here, bw, name, sms = target_mod.resolve("sm90"), None, 0.0, "", 132
    else:
        from rubin_compile.kernels.triton.tune_moe import copy_bandwidth_gbs

        torch.manual_seed(0)
        target = here = target_mod.detect()
        props = torch.cuda.get_device_properties(0)
        name, sms = props.name, props.multi_processor_count
        bw = copy_bandwidth_gbs()
    ctx = Context(target, here, a.dry_run, a.reps, bw, name, sms)
    groups = [g for op in ops for g in GROUPS[op]]
    meta = dict(
        gpu=name or "(dry run: no GPU)",
        target=target.name,
        sms=sms,
        copy_GBps=bw,
        versions=versions(),
        commit=a.commit or commit(),
        command="python benchmarks/flashinfer_kernels.py " + shlex.join(sys.argv[1:]),
        reps=a.reps,
        calls=CALLS,
        dry_run=a.dry_run,
    )
    print(json.dumps(meta), flush=True)
    res: dict[str, Any] = {"meta": meta, "prebuild": {}, "rows": []}
    t0 = time.time()
    if not a.dry_run and not a.serial_jit:
        res["prebuild"] = prebuild(groups, ctx)
    for group in groups:
        weights: dict = {}  # GEMM weights per (N, K), shared by the rows of every M
        for s in shapes(group, a.quick):
            for r in run_shape(group, s, ctx, weights):
                log_row(r)
                res["rows"].append(r)
            write(res, out)
            if not a.dry_run:
                torch.cuda.empty_cache()
        del weights
        if not a.dry_run:
            torch.cuda.empty_cache()
    res["meta"]["wall_s"] = time.time() - t0
    write(res, out)
    counts: dict[str, int] = {}
    for r in res["rows"]:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print(f"{len(res['rows'])} rows in {res['meta']['wall_s']:.0f} s: {counts}", flush=True)
    if not a.dry_run:
        print(render(res), flush=True)
    elif counts.get("FAILED"):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
