"""Benchmark the fused MoE Triton kernels against baselines and the HBM roofline (run on the GPU).

    PYTHONPATH=. python benchmarks/moe.py --out benchmarks/results

Per shape (Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V3 TP8 shard, MiniMax-M2-like), token count and weight
format (bf16, FP8 128x128 block) it times, in the same run:

* ``triton``: ours (``rubin_compile.kernels.triton``), tuned table or heuristic, PDL on (and ``pdl=False``);
* ``grouped_mm``: the op written as sort + ``torch._grouped_mm`` + glue, eager ops in a CUDA graph (bf16);
* ``inductor``: the same capturable formulation compiled by ``torch.compile`` (Inductor, default mode,
  dynamic shapes: one compile per shape), in a CUDA graph (bf16);
* ``eager_loop``: the reference op itself (a Python loop over the routed experts; it syncs the host, so
  it is timed with events per call, not in a graph);
* the roofline: bytes of the distinct experts actually routed / device-to-device copy bandwidth measured
  at the start of the same run (bytes read + written).

Method: CUDA-graph replays of 4 back-to-back calls (weights rotated over 2 copies, so no call finds its
experts in the 60 MB L2), timed with events, median of 50 replays after warm-up; before every replay a
fresh random routing is drawn into the graph's input buffers (outside the timed region). Prints a table,
writes JSON, a markdown table and a plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rubin_compile.kernels.triton import moe as tmoe
from rubin_compile.kernels.triton.tune_moe import (
    SHAPES,
    TOKENS,
    copy_bandwidth_gbs,
    expert_bytes,
    make_routing,
    make_weights,
    time_eager,
    time_graph,
)
from rubin_compile.ops.moe import moe_reference

CALLS = 4  # calls per graph replay
COPIES = 2  # weight copies rotated across the calls


def grouped_mm_moe(x, w13t, w2t, tw, ids):
    """The op as sort + torch._grouped_mm (bf16); w13t = w13.transpose(1, 2), w2t = w2.transpose(1, 2)."""
    T, k = ids.shape
    E, _, two_i = w13t.shape
    inter = two_i // 2
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32)
    )
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    tok = order // k
    h = torch._grouped_mm(x.index_select(0, tok), w13t, offs=offs)
    a = F.silu(h[:, :inter]) * h[:, inter:]
    y = torch._grouped_mm(a, w2t, offs=offs)
    y = y.float() * tw.reshape(-1)[order].float().unsqueeze(1)
    out = torch.zeros((T, x.shape[1]), dtype=torch.float32, device=x.device).index_add_(0, tok, y)
    return out.to(x.dtype)


def bench_shape(name, sh, tokens, formats, baselines, reps, copy_gbs, log, inductor_tokens):
    E, k, H, I = sh["E"], sh["k"], sh["H"], sh["I"]
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(7)
    compiled = None
    for wf in formats:
        weights = [make_weights(E, H, I, wf, seed=10 + c) for c in range(COPIES)]
        eb = expert_bytes(H, I, wf)
        block = weights[0].get("block_shape")
        for T in tokens:
            xs = [torch.randn((T, H), device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(CALLS)]
            routes = [list(make_routing(T, E, k, generator=gen)) for _ in range(CALLS)]
            distinct = torch.zeros((), device="cuda", dtype=torch.float64)

            def refresh(i):
                for r in routes:
                    tw, ids = make_routing(T, E, k, generator=gen)
                    r[0].copy_(tw)
                    r[1].copy_(ids)
                    distinct.add_(torch.zeros(E, device="cuda").index_fill_(0, ids.reshape(-1), 1.0).sum())

            def timed(fn_of_i, label):
                distinct.zero_()
                ts = time_graph([lambda i=i: fn_of_i(i) for i in range(CALLS)], refresh=refresh, reps=reps)
                nbytes = distinct.item() / (reps * CALLS) * eb
                return statistics.median(ts), nbytes

            cfg, src = tmoe.lookup_config(
                T,
                E,
                H,
                I,
                k,
                weights[0]["w13"].dtype,
                block,
                torch.cuda.get_device_name(),
                torch.cuda.get_device_properties(0).multi_processor_count,
            )
            row = dict(shape=name, E=E, k=k, H=H, I=I, T=T, wfmt=wf, config=cfg.to_json(), config_source=src, us={})

            def ours(i, pdl=True):
                w = weights[i % COPIES]
                return tmoe.fused_moe(
                    xs[i],
                    w["w13"],
                    w["w2"],
                    routes[i][0],
                    routes[i][1],
                    "silu",
                    None,
                    None,
                    w.get("w13_scale"),
                    w.get("w2_scale"),
                    block,
                    pdl=pdl,
                )

            t, nbytes = timed(ours, "triton")
            row["us"]["triton"] = t
            row["bytes"] = nbytes
            row["floor_us"] = nbytes / (copy_gbs * 1e3)
            row["us"]["triton_nopdl"] = timed(lambda i: ours(i, pdl=False), "triton_nopdl")[0]
            if wf == "bf16":
                w13t = [w["w13"].transpose(1, 2) for w in weights]
                w2t = [w["w2"].transpose(1, 2) for w in weights]
                if "grouped_mm" in baselines:
                    try:
                        row["us"]["grouped_mm"] = timed(
                            lambda i: grouped_mm_moe(
                                xs[i], w13t[i % COPIES], w2t[i % COPIES], routes[i][0], routes[i][1]
                            ),
                            "grouped_mm",
                        )[0]
                    except Exception as exc:
                        row.setdefault("errors", {})["grouped_mm"] = f"{type(exc).__name__}: {exc}"[:200]
                if "inductor" in baselines and T in inductor_tokens:
                    try:
                        if compiled is None:
                            compiled = torch.compile(grouped_mm_moe, dynamic=True, fullgraph=True)
                        t0 = time.time()
                        compiled(xs[0], w13t[0], w2t[0], routes[0][0], routes[0][1])
                        row["inductor_first_call_s"] = round(time.time() - t0, 1)
                        row["us"]["inductor"] = timed(
                            lambda i: compiled(xs[i], w13t[i % COPIES], w2t[i % COPIES], routes[i][0], routes[i][1]),
                            "inductor",
                        )[0]
                    except Exception as exc:
                        row.setdefault("errors", {})["inductor"] = f"{type(exc).__name__}: {exc}"[:200]
            if "eager_loop" in baselines:
                w = weights[0]
                row["us"]["eager_loop"] = statistics.median(
                    time_eager(
                        lambda: moe_reference(
                            xs[0],
                            w["w13"],
                            w["w2"],
                            routes[0][0],
                            routes[0][1],
                            "silu",
                            None,
                            None,
                            w.get("w13_scale"),
                            w.get("w2_scale"),
                            block,
                        ),
                        reps=10 if T * k * E > 1 << 16 else 20,
                    )
                )
            row["pct_copy_bw"] = 100.0 * row["floor_us"] / row["us"]["triton"]
            row["gbs"] = nbytes / row["us"]["triton"] / 1e3
            rows.append(row)
            sp = " ".join(f"{b}={row['us'][b] / row['us']['triton']:.2f}x" for b in row["us"] if b != "triton")
            log(
                f"{name:16s} {wf:9s} T={T:5d} ours {row['us']['triton']:9.1f} us floor {row['floor_us']:8.1f} us "
                f"{row['pct_copy_bw']:5.1f}% of copy bw ({row['gbs']:6.0f} GB/s) | {sp} [{src}]"
            )
        weights = None  # free this shape's weights before the next
        torch.cuda.empty_cache()
    return rows


def write_outputs(result, out: Path, tag: str):
    out.mkdir(parents=True, exist_ok=True)
    (out / f"moe-h200{tag}.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Fused MoE on {result['device']} ({result['date']})",
        "",
        f"Copy bandwidth measured in the run: {result['copy_gbs']:.0f} GB/s (read + write). "
        f"torch {result['torch']}, Triton {result['triton']}. {result['method']}",
        "",
        "| shape | w | T | ours us | floor us | % copy bw | GB/s | ours no-PDL | grouped_mm | inductor | eager loop |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        u = r["us"]

        def cell(b):
            return f"{u[b]:.1f} ({u[b] / u['triton']:.2f}x)" if b in u else "-"

        lines.append(
            f"| {r['shape']} | {r['wfmt']} | {r['T']} | {u['triton']:.1f} | {r['floor_us']:.1f} | "
            f"{r['pct_copy_bw']:.1f} | {r['gbs']:.0f} | {cell('triton_nopdl')} | {cell('grouped_mm')} | "
            f"{cell('inductor')} | {cell('eager_loop')} |"
        )
    lines += ["", "Baseline cells: time in us (time / ours: >1 means ours is faster)."]
    (out / f"moe-h200{tag}.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    shapes = list(dict.fromkeys(r["shape"] for r in result["rows"]))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4.2), squeeze=False)
    for ax, s in zip(axes[0], shapes):
        for wf, style in (("bf16", "-"), ("fp8_block", "--"), ("fp8_tensor", ":")):
            rs = [r for r in result["rows"] if r["shape"] == s and r["wfmt"] == wf]
            if not rs:
                continue
            Ts = [r["T"] for r in rs]
            ax.plot(Ts, [r["floor_us"] for r in rs], "k" + style, lw=1, label=f"roofline {wf}")
            for b, c in (("triton", "C0"), ("grouped_mm", "C1"), ("inductor", "C2"), ("eager_loop", "C3")):
                pts = [(r["T"], r["us"][b]) for r in rs if b in r["us"]]
                if pts:
                    ax.plot(*zip(*pts), style, color=c, marker="o", ms=3, label=f"{b} {wf}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(s)
        ax.set_xlabel("tokens T")
        ax.set_ylabel("us per MoE call")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"moe-h200{tag}.png", dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description="fused MoE benchmark")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--formats", default="bf16,fp8_block")
    ap.add_argument("--baselines", default="grouped_mm,inductor,eager_loop")
    ap.add_argument("--inductor-tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)

    def log(msg):
        print(msg, flush=True)

    copy_gbs = copy_bandwidth_gbs()
    log(f"device {torch.cuda.get_device_name()}: copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
    result = dict(
        device=torch.cuda.get_device_name(),
        date=time.strftime("%Y-%m-%d"),
        torch=torch.__version__,
        triton=__import__("triton").__version__,
        copy_gbs=copy_gbs,
        method=f"CUDA-graph replays of {CALLS} calls on {COPIES} rotating weight copies, fresh random "
        f"routing before each replay, median of {args.reps}; eager_loop timed per call with events "
        f"(host-syncing reference), median of 10-20",
        rows=[],
    )
    toks = [int(t) for t in args.tokens.split(",")]
    ind_toks = {int(t) for t in args.inductor_tokens.split(",")}
    for s in args.shapes.split(","):
        result["rows"] += bench_shape(
            s, SHAPES[s], toks, args.formats.split(","), args.baselines.split(","), args.reps, copy_gbs, log, ind_toks
        )
        write_outputs(result, Path(args.out), args.tag)
    log(f"wrote {args.out}/moe-h200{args.tag}.*")


if __name__ == "__main__":
    sys.exit(main())
