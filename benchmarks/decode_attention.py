"""Decode attention over a static KV cache on the GPU: rubin's split-KV Triton kernel against what runs without
it (the ATen form Inductor compiles: K / V repeated over the query heads, then SDPA with the mask), and against
the floor (the K / V bytes of the filled cache / copy bandwidth).

    PYTHONPATH=. python benchmarks/decode_attention.py --out benchmarks/results

Shapes: Qwen3-30B-A3B's attention (32 query / 4 KV heads of 128), one query position (and 4, once), a cache of
context + 128 positions filled to ``context`` (a bool mask [B, 1, 1, max_cache_len], as transformers passes it,
made additive as SDPA makes it), bf16 (and an FP8 e4m3 cache with per-tensor scales for the kernel).

Timing: 16 calls captured in one CUDA graph, over enough copies of the cache that they do not fit in L2 (50 MB
on the H200), the graph replayed (CUDA events, median of the replays) and divided by 16: the device time of a
call as a decode step sees it, between other kernels of one graph (the gap between kernels included, the
host's launch cost not). The ``PDL`` variants launch every call with PDL, as chain_pdl does under CUDA graphs:
a call's launch then overlaps the call before it (in a model, the kernel before the attention), and the next
kernel may launch right after the wait (in a model, the next layer's projection, which asks for its weights before
its own wait); ``late trigger`` lets it launch only once the K / V loop is done, ``L2 prefetch`` asks L2 for the
first two K / V tiles before the wait (kernels/triton/attention.py ``Config``). Writes
decode-attention-<gpu>.{md,json} under ``--out`` (gpu_names.py).

``--sweep`` times every ``Config`` of the kernel (tile, warps, stages, programs per SM, shortest split) at the
benchmark's shapes, checks each against the ATen form, and writes
decode-attention-sweep-h200.{md,json}: what the defaults of kernels/triton/attention.py are chosen from.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
import sys
from pathlib import Path

import torch

from rubin_compile.kernels.triton import attention as kernel
from rubin_compile.kernels.triton.tune_moe import copy_bandwidth_gbs
from rubin_compile.ops.attention import AttentionArgs, aten
from rubin_compile.ops.registry import Launch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: gpu_names, graph_profile
from gpu_names import write_results  # noqa: E402  (benchmarks/gpu_names.py)
from graph_profile import capture  # noqa: E402

HQ, HKV, D, EXTRA = 32, 4, 128, 128
CALLS = 16  # calls per captured graph
L2_BYTES = 50e6


def graph_us(fns: list, iters: int = 50) -> float:
    """Device time per call of ``fns`` (each called once, in order, CALLS calls in all), captured in one graph."""
    g = capture(fns, CALLS)
    for _ in range(3):
        g.replay()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / CALLS)
    return statistics.median(ts)


class Shape:
    """Inputs of one benchmark shape: the query, ``copies`` caches (bf16 and FP8) and the mask."""

    def __init__(self, batch: int, context: int, queries: int = 1) -> None:
        self.batch, self.context, self.queries = batch, context, queries
        skv = context + EXTRA
        self.kv_elems = 2 * batch * HKV * context * D  # the filled part, K and V
        copies = max(1, min(CALLS, math.ceil(3 * L2_BYTES / (2 * self.kv_elems))))
        self.q = torch.randn(batch, queries, HQ, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        self.kv = [(torch.randn(batch, HKV, skv, D, device="cuda", dtype=torch.bfloat16), None) for _ in range(copies)]
        self.kv = [(k, torch.randn_like(k)) for k, _ in self.kv]
        self.kv8 = [(k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)) for k, v in self.kv]
        pos = torch.arange(skv, device="cuda")
        last = context - queries + torch.arange(queries, device="cuda")  # the queries' own positions, causal
        mask = (pos[None, :] <= last[:, None])[None, None].expand(batch, 1, queries, skv).contiguous()
        self.mask = torch.where(mask, 0.0, float("-inf")).to(torch.bfloat16)
        self.one = torch.ones((), device="cuda")

    def args(self, fp8: bool = False) -> list[AttentionArgs]:
        if fp8:
            return [AttentionArgs(self.q, k, v, self.mask, False, None, self.one, self.one) for k, v in self.kv8]
        return [AttentionArgs(self.q, k, v, self.mask) for k, v in self.kv]

    def key(self) -> dict:
        return {"batch": self.batch, "context": self.context, "queries": self.queries}


def case(batch: int, context: int, bw: float, queries: int = 1) -> list[dict]:
    sh = Shape(batch, context, queries)
    pdl = Launch(pdl=True)
    picked = kernel.config_for(batch, HKV, context + EXTRA)
    late = dataclasses.replace(picked, early_trigger=False)
    prefetch = dataclasses.replace(picked, prefetch_tiles=2)
    unchained = dataclasses.replace(picked, pdl_combine=False)
    out = []
    for name, args, elem, run in (
        ("rubin triton (bf16)", sh.args(), 2, kernel.run),
        # the combine launched after the split kernel, not PDL-chained to it (Config.pdl_combine off)
        ("rubin triton (bf16), combine not chained", sh.args(), 2, lambda a: kernel.run(a, config=unchained)),
        # PDL: each call launched with PDL after the one before (as chain_pdl launches it in a decode step under
        # CUDA graphs); the next kernel may launch right after a program's griddepcontrol.wait
        ("rubin triton (bf16), PDL", sh.args(), 2, lambda a: kernel.run(a, pdl)),
        # ... or only once its K / V loop is done; or with its first K / V tiles asked into L2 before the wait
        ("rubin triton (bf16), PDL, late trigger", sh.args(), 2, lambda a: kernel.run(a, pdl, config=late)),
        ("rubin triton (bf16), PDL, L2 prefetch", sh.args(), 2, lambda a: kernel.run(a, pdl, config=prefetch)),
        ("rubin triton (fp8 KV)", sh.args(fp8=True), 1, kernel.run),
        ("rubin triton (fp8 KV), PDL", sh.args(fp8=True), 1, lambda a: kernel.run(a, pdl)),
        ("repeat_kv + SDPA (ATen form)", sh.args(), 2, aten),
    ):
        us = graph_us([lambda a=a: run(a) for a in args], iters=20 if "ATen" in name else 50)
        gbps = sh.kv_elems * elem / us / 1e3
        out.append(
            {
                **sh.key(),
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


# 1- and 2-warp programs and 32-position tiles were slower at every batch-1 shape on an H100 (2026-12-06), 8 warps on
# the H200 before (benchmarks/results/decode-attention-b1-h100-2026-12-06/)
SWEEP = {
    "block_n": (64, 128),
    "num_warps": (4,),
    "num_stages": (2, 3, 4),
    "programs_per_sm": (1, 2, 4),
    "min_split_tiles": (2, 4, 8),
}


def sweep(batches: list[int], contexts: list[int], bw: float, head: str, out: Path | None) -> None:
    """Every Config at every shape (bf16; the five best again with an FP8 cache): time, fraction of copy
    bandwidth, and the check against the ATen form (a config that computes something else is dropped)."""
    configs = [kernel.Config(**dict(zip(SWEEP, v))) for v in itertools.product(*SWEEP.values())]
    rows = []
    for b, c in itertools.product(batches, contexts):
        sh = Shape(b, c)
        want = aten(sh.args()[0]).float()
        timed = []
        for fp8 in (False, True):
            for cfg in (
                configs
                if not fp8
                else [t[1] for t in sorted(timed, key=lambda t: t[0])[:5]] + [kernel.config_for(b, HKV, c + EXTRA)]
            ):
                try:
                    got = kernel.run(sh.args(fp8)[0], config=cfg).float()
                    err = ((got - want).abs().max() / want.abs().max()).item()
                    if not err < (0.1 if fp8 else 2e-2):  # FP8 rounds K and V: a coarser bound
                        print(json.dumps({**sh.key(), "config": str(cfg), "fp8": fp8, "wrong": err}), flush=True)
                        continue
                    us = graph_us([lambda a=a: kernel.run(a, config=cfg) for a in sh.args(fp8)], iters=20)
                except Exception as e:  # a config that does not fit (shared memory): skipped, said
                    print(json.dumps({**sh.key(), "config": str(cfg), "fp8": fp8, "error": str(e)[:200]}), flush=True)
                    continue
                if not fp8:
                    timed.append((us, cfg))
                gbps = sh.kv_elems * (1 if fp8 else 2) / us / 1e3
                rows.append({**sh.key(), "fp8": fp8, **cfg.__dict__, "us": us, "of_copy_bw": gbps / bw})
        del sh
        torch.cuda.empty_cache()
    lines = [
        f"Decode attention config sweep; {head}",
        "",
        "| batch | context | KV | config_for's us | best us | best config | of copy BW |",
        "|---|---|---|---|---|---|---|",
    ]
    for b, c, fp8 in itertools.product(batches, contexts, (False, True)):
        mine = [r for r in rows if (r["batch"], r["context"], r["fp8"]) == (b, c, fp8)]
        if not mine:
            continue
        best = min(mine, key=lambda r: r["us"])
        picked = kernel.config_for(b, HKV, c + EXTRA)
        default = next((r for r in mine if all(r[k] == getattr(picked, k) for k in SWEEP)), None)
        cfg = ", ".join(f"{k}={best[k]}" for k in SWEEP)
        lines.append(
            f"| {b} | {c} | {'fp8' if fp8 else 'bf16'} | {default['us'] if default else float('nan'):.1f} | "
            f"{best['us']:.1f} | {cfg} | {100 * best['of_copy_bw']:.0f}% |"
        )
    text = "\n".join(lines)
    print(text)
    if out:
        write_results(out, "decode-attention-sweep", text, {"device": head, "rows": rows})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="512,4096,16384,32768")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--sweep", action="store_true", help="time every kernel Config instead (see above)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth_gbs()
    if args.sweep:
        head = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw:.0f} GB/s"
        batches = [int(x) for x in args.batches.split(",")]
        contexts = [int(x) for x in args.contexts.split(",")]
        sweep(batches, contexts, bw, head, Path(args.out) if args.out else None)
        return
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
        write_results(Path(args.out), "decode-attention", text, {"device": head, "rows": rows})


if __name__ == "__main__":
    main()
