"""Where batch-1 decode attention's time goes (issue 16's goal: >= 80% of copy bandwidth at >= 16k positions).

    PYTHONPATH=. python benchmarks/decode_attention_probe.py --out /tmp/out

At batch 1 the kernel of kernels/triton/attention.py reads the filled K / V at 49-61% of the copy bandwidth on
the H200 (16k / 32k), at batch 8 at 84-95%. This prints, per shape (benchmarks/decode_attention.py's inputs and
timing: 16 calls per CUDA graph over caches larger than L2, median per call):

- ``call``: the call as selection launches it (bf16 additive mask as transformers' SDPA path makes it), then with
  a bool mask and with no mask (what the mask scan and the per-tile mask loads cost);
- ``split only`` / ``combine only``: the call with the other kernel's launch skipped (only the time means anything);
- other split counts (``splits=N`` per KV head);
- ``stream``: a Triton kernel with the split kernel's grid, tiles and pipelined K / V loads that does only the two
  products (no mask, no softmax, no partials, no combine): what this structure costs without the attention's
  per-tile work; and ``copy``: ``torch.Tensor.copy_`` of the filled K and V (the same bytes read, and written) in the
  same graph -- a bandwidth kernel's own fixed cost at this size;
- the per-kernel device time from torch.profiler over replays of the call's graph.

Writes decode-attention-probe-<gpu>.{md,json} under ``--out``. A diagnostic: nothing in rubin reads its output.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from rubin_compile.kernels.triton import attention as kernel
from rubin_compile.kernels.triton.launch import cdiv, launcher
from rubin_compile.kernels.triton.tune_moe import copy_bandwidth_gbs
from rubin_compile.ops.attention import AttentionArgs

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: decode_attention, gpu_names
from decode_attention import CALLS, D, HKV, Shape, graph_us  # noqa: E402
from gpu_names import write_results  # noqa: E402
from graph_profile import per_kernel  # noqa: E402


@triton.jit
def _stream(Q, K, V, Out, sk_h, split_len, Skv, ROWS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    split = tl.program_id(0)
    hk = tl.program_id(1)
    rows = tl.arange(0, ROWS)
    d = tl.arange(0, D)
    start = split * split_len
    end = tl.minimum(start + split_len, Skv)
    q = tl.load(Q + rows[:, None] * D + d[None, :])
    acc = tl.zeros([ROWS, D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        ok = cols < end
        k = tl.load(K + hk * sk_h + cols[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(V + hk * sk_h + cols[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k))
        acc += tl.dot(qk.to(tl.bfloat16), v)
    tl.store(Out + ((hk * tl.num_programs(0) + split) * ROWS + rows[:, None]) * D + d[None, :], acc)


@triton.jit
def _stream_tma(
    Q, Kd, Vd, Out, skv, split_len, Skv,
    ROWS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, ZERO_TAIL: tl.constexpr,
):  # fmt: skip
    """``_stream`` with the K / V tiles loaded by TMA (host descriptors over the caches as [B * Hkv * skv, D]).
    ``ZERO_TAIL``: the positions past the split's end zeroed in K and V (in registers: what a kernel reading caches
    with unwritten positions needs); otherwise only their scores are."""
    split = tl.program_id(0)
    hk = tl.program_id(1)
    rows = tl.arange(0, ROWS)
    d = tl.arange(0, D)
    start = split * split_len
    end = tl.minimum(start + split_len, Skv)
    q = tl.load(Q + rows[:, None] * D + d[None, :])
    acc = tl.zeros([ROWS, D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        ok = n0 + tl.arange(0, BLOCK_N) < end
        k = Kd.load([hk * skv + n0, 0])
        v = Vd.load([hk * skv + n0, 0])
        if ZERO_TAIL:
            k = tl.where(ok[:, None], k, 0.0)
            v = tl.where(ok[:, None], v, 0.0)
        qk = tl.where(ok[None, :], tl.dot(q, tl.trans(k)), 0.0)
        acc += tl.dot(qk.to(tl.bfloat16), v)
    tl.store(Out + ((hk * tl.num_programs(0) + split) * ROWS + rows[:, None]) * D + d[None, :], acc)


@triton.jit
def _read(K, V, Out, sk_h, chunk, n, BLOCK: tl.constexpr):
    """Reads ``n`` contiguous elements of K and of V per head (the filled positions x D) in chunks of ``chunk``, one
    per program (chunk, head), and writes one sum: the bytes the attention reads, with no work on them."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    start = c * chunk
    end = tl.minimum(start + chunk, n)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(start, end, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        ok = offs < end
        acc += tl.load(K + h * sk_h + offs, mask=ok, other=0.0).to(tl.float32)
        acc += tl.load(V + h * sk_h + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + h * tl.num_programs(0) + c, tl.sum(acc, 0))


@contextlib.contextmanager
def skip(name: str):
    """Launches of the kernel named ``name`` (``_split_kv`` / ``_combine``) skipped in kernel.run."""
    real = kernel.launcher

    def fake(fn):
        if fn.fn.__name__ == name:
            return _NoLaunch()
        return real(fn)

    kernel.launcher = fake
    try:
        yield
    finally:
        kernel.launcher = real


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *a, **k: None


def stream_variants(args, context: int, cfg, nsplit: int, add) -> None:
    """A kernel that only reads the filled cache (the floor of these bytes in one kernel), then the streaming kernel
    (the split kernel's structure without the attention's per-tile work: filled part, no mask) with pointer and with
    TMA loads, at the call's own Config (``nsplit`` splits) and at other split counts / stages / tiles / warps: whether
    another way of reading the cache (not another Config of today's loads) is worth building into the split
    kernel."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    batch, skv = args[0].key.shape[0], args[0].key.shape[2]
    q16 = torch.randn(16, D, device="cuda", dtype=torch.bfloat16)
    # the floor for these bytes in these places: a kernel that only reads them, over 1-8 programs per SM
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = context * D
    sums = torch.empty(8 * sms + batch * HKV, device="cuda", dtype=torch.float32)
    for per_sm, block in ((1, 8192), (2, 8192), (4, 4096), (8, 2048)):  # 4-16 KB of K and V in flight per program
        chunk = cdiv(cdiv(n, max(1, per_sm * sms // (batch * HKV))), block) * block
        for warps in (4, 8):

            def read(a, chunk=chunk, block=block, warps=warps):
                launcher(_read)[(cdiv(n, chunk), batch * HKV)](
                    a.key, a.value, sums, a.key.stride(1), chunk, n, BLOCK=block, num_warps=warps
                )

            add(
                f"read only ({cdiv(n, chunk) * batch * HKV} programs of {warps} warps, {block}-element loads)",
                [lambda a=a: read(a) for a in args],
            )
    for block_n, warps, stages, splits in (
        (cfg.block_n, cfg.num_warps, cfg.num_stages, nsplit),
        (cfg.block_n, cfg.num_warps, 4, nsplit),
        (cfg.block_n, cfg.num_warps, cfg.num_stages, 2 * nsplit),
        (128, 8, 3, nsplit),
        (128, 4, 2, nsplit),
    ):
        split_len = cdiv(cdiv(context, splits), block_n) * block_n
        n = cdiv(context, split_len)
        part = torch.empty(batch * HKV * n * 16 * D, device="cuda", dtype=torch.float32)
        descs = [
            (
                TensorDescriptor.from_tensor(a.key.view(-1, D), [block_n, D]),
                TensorDescriptor.from_tensor(a.value.view(-1, D), [block_n, D]),
            )
            for a in args
        ]

        def tma(kd, vd, zero, split_len=split_len, n=n, part=part, block_n=block_n, warps=warps, stages=stages):
            launcher(_stream_tma)[(n, batch * HKV)](
                q16, kd, vd, part, skv, split_len, context, ROWS=16, D=D, BLOCK_N=block_n, ZERO_TAIL=zero,
                num_warps=warps, num_stages=stages,
            )  # fmt: skip

        for zero in (True, False):
            add(
                f"stream, TMA loads{'' if zero else ' (tail not zeroed)'} "
                f"({n} splits, {block_n} positions x {stages} stages, {warps} warps)",
                [lambda kd=kd, vd=vd, zero=zero: tma(kd, vd, zero) for kd, vd in descs],
            )

        # program (split, b * Hkv + hk): the caches are contiguous [B, Hkv, Skv, D]
        def ptr(a, split_len=split_len, n=n, part=part, block_n=block_n, warps=warps, stages=stages):
            launcher(_stream)[(n, batch * HKV)](
                q16, a.key, a.value, part, a.key.stride(1), split_len, context, ROWS=16, D=D, BLOCK_N=block_n,
                num_warps=warps, num_stages=stages,
            )  # fmt: skip

        add(
            f"stream (no softmax; {n} splits, {block_n} positions x {stages} stages, {warps} warps)",
            [lambda a=a: ptr(a) for a in args],
        )


def probe(batch: int, context: int, bw: float, stream_only: bool = False) -> list[dict]:
    sh = Shape(batch, context)
    rows = []
    filled = sh.kv_elems * 2

    def add(name, fns, nbytes=filled, **extra):
        try:
            us = graph_us(fns, iters=30)
        except OutOfResources as exc:  # a stream variant whose stages do not fit this GPU's shared memory
            torch.cuda.synchronize()
            us, extra = float("nan"), {**extra, "error": str(exc)}
        rows.append({"batch": batch, "context": context, "variant": name, "us": us,
                     "of_copy_bw": nbytes / us / 1e3 / bw, **extra})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)

    args = sh.args()
    boolmask = sh.mask == 0
    skv = context + 128
    add("call (additive bf16 mask)", [lambda a=a: kernel.run(a) for a in args])
    with skip("_combine"):
        add("split only", [lambda a=a: kernel.run(a) for a in args])
    cfg = kernel.config_for(batch, HKV, skv)
    default = kernel.num_splits(batch, HKV, skv, torch.cuda.get_device_properties(0).multi_processor_count, cfg)
    if not stream_only:
        bool_args = [AttentionArgs(a.query, a.key, a.value, boolmask) for a in args]
        add("call (bool mask)", [lambda a=a: kernel.run(a) for a in bool_args])
        nomask = [AttentionArgs(a.query, a.key[:, :, :context], a.value[:, :, :context], None) for a in args]
        add("call (no mask, filled part only)", [lambda a=a: kernel.run(a) for a in nomask])
        with skip("_split_kv"):
            add("combine only", [lambda a=a: kernel.run(a) for a in args], nbytes=0)
        for n in sorted({max(1, default // 2), 33, 66, 132 // batch, default * 2} - {default}):
            add(f"call, splits={n}", [lambda a=a, n=n: kernel.run(a, splits=n) for a in args], splits=n)
    split_len = cdiv(cdiv(context, default), cfg.block_n) * cfg.block_n
    nsplit = cdiv(context, split_len)
    stream_variants(args, context, cfg, nsplit, add)
    if stream_only:
        return rows
    # contiguous sources of the filled part's size (a slice of the cache is strided: copy_ would not stream it)
    src = [(a.key[:, :, :context].contiguous(), a.value[:, :, :context].contiguous()) for a in args]
    dst = [(torch.empty_like(k), torch.empty_like(v)) for k, v in src[:2]]

    def copy(i):
        dst[i % 2][0].copy_(src[i][0])
        dst[i % 2][1].copy_(src[i][1])

    add("copy_ of the filled K and V (2 kernels; bytes read)", [lambda i=i: copy(i) for i in range(len(src))])
    prof = per_kernel([lambda a=a: kernel.run(a) for a in args], CALLS, reps=20)
    rows.append({"batch": batch, "context": context, "variant": "profile", "kernels": prof, "splits": default})
    print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1x4096,1x16384,1x32768,8x16384")
    ap.add_argument("--out", default=None)
    ap.add_argument("--stream-only", action="store_true", help="only the call, its split kernel and the streams")
    ap.add_argument("--ncu", default=None, help="BxCONTEXT: only run 4 calls of that shape, uncaptured (for ncu)")
    args = ap.parse_args()
    if args.ncu:
        b, c = (int(x) for x in args.ncu.split("x"))
        a = Shape(b, c).args()[0]
        for _ in range(4):
            kernel.run(a)
        torch.cuda.synchronize()
        return
    bw = copy_bandwidth_gbs()
    head = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw:.0f} GB/s"
    rows = []
    for s in args.shapes.split(","):
        b, c = (int(x) for x in s.split("x"))
        rows += probe(b, c, bw, args.stream_only)
        torch.cuda.empty_cache()
    lines = [
        f"Decode attention probe; {head}",
        "",
        "| batch | context | variant | us | of copy bw |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if r["variant"] == "profile":
            k = ", ".join(f"{n} {v['us']:.2f} us x{v['per_call']:.0f}" for n, v in r["kernels"].items())
            lines.append(f"| {r['batch']} | {r['context']} | profile ({r['splits']} splits) | {k} | |")
        else:
            lines.append(
                f"| {r['batch']} | {r['context']} | {r['variant']} | {r['us']:.2f} | {100 * r['of_copy_bw']:.0f}% |"
            )
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_results(Path(args.out), "decode-attention-probe", text, {"device": head, "rows": rows})


if __name__ == "__main__":
    main()
