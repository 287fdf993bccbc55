"""Decode attention over a static KV cache on the GPU: rubin's split-KV Triton kernel against what runs without
it (the ATen form Inductor compiles: K / V repeated over the query heads, then SDPA with the mask), and against
the floor (the K / V bytes of the filled cache / copy bandwidth).

    PYTHONPATH=. python benchmarks/decode_attention.py --out benchmarks/results

Shapes: Qwen3-30B-A3B's attention (32 query / 4 KV heads of 128), one query position (and 4, once), a cache of
context + 128 positions filled to ``context`` (a bool mask [B, 1, 1, max_cache_len], as transformers passes it,
made additive as SDPA makes it), bf16 (and an FP8 e4m3 cache with per-tensor scales for the kernel). Each
call is captured in a CUDA graph and replayed (CUDA events, median of 100): device time, no launch cost.
Writes decode-attention-h200.{md,json} under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from rubin_compile.kernels.triton import attention as kernel
from rubin_compile.kernels.triton.tune_moe import copy_bandwidth_gbs
from rubin_compile.ops.attention import AttentionArgs, aten

HQ, HKV, D, EXTRA = 32, 4, 128, 128


def graph_us(fn, iters: int = 100) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(5):
        g.replay()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def case(batch: int, context: int, bw: float, queries: int = 1) -> list[dict]:
    skv = context + EXTRA
    q = torch.randn(batch, queries, HQ, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(batch, HKV, skv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    pos = torch.arange(skv, device="cuda")
    last = context - queries + torch.arange(queries, device="cuda")  # the queries' own positions, causal
    mask = (pos[None, :] <= last[:, None])[None, None].expand(batch, 1, queries, skv).contiguous()
    additive = torch.where(mask, 0.0, float("-inf")).to(torch.bfloat16)
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    kv_bytes = 2 * batch * HKV * context * D
    out = []
    for name, fn, elem in (
        ("rubin triton (bf16)", lambda: kernel.run(AttentionArgs(q, k, v, additive)), 2),
        ("rubin triton (fp8 KV)", lambda: kernel.run(AttentionArgs(q, k8, v8, additive, False, None, one, one)), 1),
        ("repeat_kv + SDPA (ATen form)", lambda: aten(AttentionArgs(q, k, v, additive)), 2),
    ):
        us = graph_us(fn)
        gbps = kv_bytes * elem / us / 1e3
        out.append(
            {
                "batch": batch,
                "context": context,
                "queries": queries,
                "variant": name,
                "us": us,
                "GBps": gbps,
                "of_copy_bw": gbps / bw,
            }
        )
        print(json.dumps(out[-1]), flush=True)
    return out


def render(rows: list[dict], head: str) -> list[str]:
    """The table: each variant against the ATen form of the same batch, context and query count."""
    lines = [
        f"Decode attention (32 / 4 heads of 128, a cache of context + {EXTRA} filled to context); {head}",
        "",
        "| batch | context | queries | variant | us | GB/s of the filled K/V | of copy bandwidth | vs ATen form |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        key = (r["batch"], r["context"], r["queries"])
        base = next(x["us"] for x in rows if (x["batch"], x["context"], x["queries"]) == key and "ATen" in x["variant"])
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['queries']} | {r['variant']} | {r['us']:.1f} | {r['GBps']:.0f} | "
            f"{100 * r['of_copy_bw']:.0f}% | {base / r['us']:.2f}x |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="512,4096,16384,32768")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth_gbs()
    rows = [
        r
        for b in (int(x) for x in args.batches.split(","))
        for c in (int(x) for x in args.contexts.split(","))
        for r in case(b, c, bw)
    ]
    rows += case(1, 4096, bw, queries=4)  # speculative verification: 4 query positions (the kernel's most)
    head = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw:.0f} GB/s"
    lines = render(rows, head)
    text = "\n".join(lines)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "decode-attention-h200.md").write_text(text + "\n")
        (out / "decode-attention-h200.json").write_text(json.dumps({"device": head, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
