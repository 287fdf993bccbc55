"""Benchmark the fused MoE Triton kernels against baselines and the HBM roofline (run on the GPU).

    PYTHONPATH=. python benchmarks/moe.py --out benchmarks/results

Per shape (Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V3 TP8 shard, MiniMax-M2-like), token count and weight
format (bf16, FP8 128x128 block) it times, in the same run:

* ``triton``: ours (``rubin_compile.kernels.triton``), tuned table or heuristic, PDL on (and ``pdl=False``);
* ``grouped_mm``: rubin.moe's ATen form (ops/moe.py ``aten``: sort + ``torch._grouped_mm`` + glue), eager ops in a
  CUDA graph (bf16): the ``aten`` baseline of the per-size choice;
* ``inductor``: the same capturable formulation compiled by ``torch.compile`` (Inductor, default mode,
  dynamic shapes: one compile per shape), in a CUDA graph (bf16);
* ``eager_loop``: the reference op itself (a Python loop over the routed experts; it syncs the host, so
  it is timed with events per call, not in a graph);
* ``vllm``: vLLM's Triton fused MoE with vLLM's config for the GPU and T, loaded from vLLM's own source
  (``--vllm-src``; benchmarks/vllm_fused_moe.py says how, and what is not its kernels), in a CUDA graph (bf16); its
  result is checked against ours on the same routing (``vllm_max_diff``);
* the roofline: bytes of the distinct experts actually routed / device-to-device copy bandwidth measured
  at the start of the same run (bytes read + written); and the tensor rate: 6 T k H I FLOPs / time, against
  an 8192^3 bf16 (FP8) matrix product timed in the same run.

``--write-baselines PATH`` merges ours and the baselines' times into the per-size selection table
(rubin_compile/kernels/triton/moe_baselines/<GPU>.json, kernels/triton/moe_choice.py); ``--baselines-from
JSON`` writes it from a results file of an earlier run instead of measuring (no GPU needed; ``--configs-from``
names the tuned-config table of that run where its results predate the ``config_entry`` field). Each row keeps
the tuned entry ours ran, and counts only while ours runs the same today. Rows with T >= 256
also go to ``moe-prefill-<gpu><tag>.{md,json}`` (<gpu>: gpu_names.py, ``h200`` on the H200).

Method: CUDA-graph replays of 4 back-to-back calls (weights rotated over 2 copies, so no call finds its
experts in the 60 MB L2), timed with events, median of 50 replays after warm-up; before every replay a
fresh random routing is drawn into the graph's input buffers (outside the timed region). Prints a table,
writes JSON, a markdown table and a plot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

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
from rubin_compile.kernels.triton import moe_choice
from rubin_compile.ops.moe import aten_tensors, moe_reference

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_fused_moe  # noqa: E402  (a benchmark helper beside this file)
from gpu_names import gpu_slug  # noqa: E402  (benchmarks/gpu_names.py)

CALLS = 4  # calls per graph replay
COPIES = 2  # weight copies rotated across the calls


def grouped_mm_moe(x, w13, w2, tw, ids):
    """rubin.moe's ATen form (ops/moe.py: ``aten``): the slots sorted by expert, two torch._grouped_mm, the glue --
    what Inductor compiles from transformers' grouped-mm experts, and what our adapter runs where it measured faster
    (kernels/triton/moe_choice.py). (Until 2026-12-05 this benchmark timed its own copy of that formulation.)"""
    return aten_tensors(x, w13, w2, tw, ids, "silu")


PREFILL_MIN_T = 256  # rows from this T on also go to the prefill table


def matmul_tflops(fp8: bool, n: int = 8192) -> float:
    """TFLOP/s of an n^3 matrix product on random data (bf16, or e4m3 through torch._scaled_mm), median of 10."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    if fp8:
        a, bt = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")

        def fn():
            return torch._scaled_mm(a, bt, one, one, out_dtype=torch.bfloat16)
    else:

        def fn():
            return a @ b

    us = statistics.median(time_eager(fn, reps=10, warmup=3))
    return 2 * n**3 / us / 1e6


def moe_flops(T: int, k: int, H: int, I: int) -> float:
    """FC1 (2 T k H 2I) + FC2 (2 T k I H) multiply-adds counted as two FLOPs."""
    return 6.0 * T * k * H * I


def bench_shape(name, sh, tokens, formats, baselines, reps, copy_gbs, log, inductor_tokens, vllm_src=None):
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

            def timed(fn_of_i, label, refresh_fn=refresh):
                distinct.zero_()
                ts = time_graph([lambda i=i: fn_of_i(i) for i in range(CALLS)], refresh=refresh_fn, reps=reps)
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
                sm90=tmoe.is_sm90(torch.device("cuda")),
            )
            row = dict(shape=name, E=E, k=k, H=H, I=I, T=T, wfmt=wf, config=cfg.to_json(), config_source=src, us={})
            # the tuned table's entry as written (moe_choice compares it with today's before it counts our time)
            row["config_entry"] = moe_choice.current_config(
                T, moe_choice.table_key(E, H, I, k, wf), moe_choice.load_configs(torch.cuda.get_device_name())
            )

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
                w13s = [w["w13"] for w in weights]
                w2s = [w["w2"] for w in weights]
                if "grouped_mm" in baselines:
                    try:
                        row["us"]["grouped_mm"] = timed(
                            lambda i: grouped_mm_moe(
                                xs[i], w13s[i % COPIES], w2s[i % COPIES], routes[i][0], routes[i][1]
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
                        compiled(xs[0], w13s[0], w2s[0], routes[0][0], routes[0][1])
                        row["inductor_first_call_s"] = round(time.time() - t0, 1)
                        row["us"]["inductor"] = timed(
                            lambda i: compiled(xs[i], w13s[i % COPIES], w2s[i % COPIES], routes[i][0], routes[i][1]),
                            "inductor",
                        )[0]
                    except Exception as exc:
                        row.setdefault("errors", {})["inductor"] = f"{type(exc).__name__}: {exc}"[:200]
                if "vllm" in baselines:
                    try:
                        vm = [vllm_fused_moe.VllmMoE(T, E, H, I, k, vllm_src) for _ in range(CALLS)]
                        for c in range(CALLS):  # the graph's first (warm-up) calls read a valid alignment
                            vm[c].align(routes[c][1])

                        def refresh_vllm(i):
                            refresh(i)
                            for c in range(CALLS):
                                vm[c].align(routes[c][1])

                        def vllm_call(i):
                            w = weights[i % COPIES]
                            return vm[i](xs[i], w["w13"], w["w2"], routes[i][0])

                        row["us"]["vllm"] = timed(vllm_call, "vllm", refresh_vllm)[0]
                        row["vllm_config"] = dict(vm[0].config, source=vm[0].config_source)
                        vm[0].align(routes[0][1])
                        diff = (vllm_call(0).float() - ours(0).float()).abs().max().item()
                        row["vllm_max_diff"] = diff
                    except Exception as exc:
                        row.setdefault("errors", {})["vllm"] = f"{type(exc).__name__}: {exc}"[:300]
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
            row["tflops"] = moe_flops(T, k, H, I) / row["us"]["triton"] / 1e6
            rows.append(row)
            sp = " ".join(f"{b}={row['us'][b] / row['us']['triton']:.2f}x" for b in row["us"] if b != "triton")
            log(
                f"{name:16s} {wf:9s} T={T:5d} ours {row['us']['triton']:9.1f} us floor {row['floor_us']:8.1f} us "
                f"{row['pct_copy_bw']:5.1f}% of copy bw ({row['gbs']:6.0f} GB/s) | {sp} [{src}]"
            )
        weights = None  # free this shape's weights before the next
        torch.cuda.empty_cache()
    return rows


def _peak(result, wfmt: str) -> float:
    """The measured tensor rate the row's format runs against (FP8 weights: the e4m3 product's)."""
    return result["tflops_peak"]["fp8" if wfmt.startswith("fp8") else "bf16"]


def write_outputs(result, out: Path, tag: str):
    out.mkdir(parents=True, exist_ok=True)
    (out / f"moe-{gpu_slug()}{tag}.json").write_text(json.dumps(result, indent=1))
    peaks = result["tflops_peak"]
    head = [
        f"Copy bandwidth measured in the run: {result['copy_gbs']:.0f} GB/s (read + write); tensor rate of an 8192^3 "
        f"product on random data in the same run: bf16 {peaks['bf16']:.0f}, FP8 {peaks['fp8']:.0f} TFLOP/s. "
        f"torch {result['torch']}, Triton {result['triton']}, commit {result['commit']}. {result['method']}",
        "",
    ]
    lines = [f"# Fused MoE on {result['device']} ({result['date']})", "", *head]
    lines += [
        "| shape | w | T | ours us | floor us | % copy bw | GB/s | TFLOP/s | % tensor peak | ours no-PDL | vllm | "
        "grouped_mm | inductor | eager loop |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(r, b):
        u = r["us"]
        return f"{u[b]:.1f} ({u[b] / u['triton']:.2f}x)" if b in u else "-"

    for r in result["rows"]:
        u = r["us"]
        lines.append(
            f"| {r['shape']} | {r['wfmt']} | {r['T']} | {u['triton']:.1f} | {r['floor_us']:.1f} | "
            f"{r['pct_copy_bw']:.1f} | {r['gbs']:.0f} | {r['tflops']:.0f} | {100 * r['tflops'] / _peak(result, r['wfmt']):.1f} | "
            f"{cell(r, 'triton_nopdl')} | {cell(r, 'vllm')} | {cell(r, 'grouped_mm')} | {cell(r, 'inductor')} | "
            f"{cell(r, 'eager_loop')} |"
        )
    notes = ["", "Baseline cells: time in us (time / ours: >1 means ours is faster)."]
    errors = [
        f"- {r['shape']} {r['wfmt']} T={r['T']}: {e}" for r in result["rows"] for e in r.get("errors", {}).items()
    ]
    if errors:
        notes += ["", "Baselines that did not run:", *errors]
    (out / f"moe-{gpu_slug()}{tag}.md").write_text("\n".join(lines + notes) + "\n")
    prefill = [r for r in result["rows"] if r["T"] >= PREFILL_MIN_T]
    if prefill:
        (out / f"moe-prefill-{gpu_slug()}{tag}.json").write_text(json.dumps(dict(result, rows=prefill), indent=1))
        lines = [f"# Fused MoE at prefill sizes (T >= {PREFILL_MIN_T}) on {result['device']} ({result['date']})", ""]
        lines += head + [
            "| shape | w | T | ours us | TFLOP/s | % tensor peak | % copy bw | vllm us (vllm / ours) | vllm config | "
            "grouped_mm | inductor |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
        ]
        for r in prefill:
            vc = r.get("vllm_config", {})
            vcfg = "x".join(str(vc[n]) for n in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K") if n in vc)
            lines.append(
                f"| {r['shape']} | {r['wfmt']} | {r['T']} | {r['us']['triton']:.1f} | {r['tflops']:.0f} | "
                f"{100 * r['tflops'] / _peak(result, r['wfmt']):.1f} | {r['pct_copy_bw']:.1f} | {cell(r, 'vllm')} | "
                f"{vcfg or '-'} | {cell(r, 'grouped_mm')} | {cell(r, 'inductor')} |"
            )
        (out / f"moe-prefill-{gpu_slug()}{tag}.md").write_text("\n".join(lines) + "\n")
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
            for b, c in (
                ("triton", "C0"),
                ("grouped_mm", "C1"),
                ("inductor", "C2"),
                ("eager_loop", "C3"),
                ("vllm", "C4"),
            ):
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
    fig.savefig(out / f"moe-{gpu_slug()}{tag}.png", dpi=110)


def commit() -> str:
    """The tree's commit: RUBIN_COMMIT when set (a GPU run's copy of the tree may carry a stale .git), else git's."""
    if os.environ.get("RUBIN_COMMIT"):
        return os.environ["RUBIN_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def run_facts() -> dict:
    """What a results file says about its run: the GPU, the date, torch, Triton, the tree's commit."""
    return dict(
        device=torch.cuda.get_device_name(),
        date=time.strftime("%Y-%m-%d"),
        torch=torch.__version__,
        triton=__import__("triton").__version__,
        commit=commit(),
    )


BASELINE_COLUMNS = {"grouped_mm": "aten", "vllm": "vllm"}  # a result row's baseline -> its name in moe_choice


def write_baselines(result, path: Path, source: str) -> int:
    """Merge the bf16 rows of ``result`` (ours and each measured baseline, us, and the tuned entry ours ran) into the
    selection table at ``path`` (moe_choice's format); returns the number of (shape, T) entries written."""
    table = json.loads(path.read_text()) if path.is_file() else {}
    if table and table.get("device") != result["device"]:
        raise SystemExit(f"{path} is the table of {table.get('device')!r}, not of {result['device']!r}")
    entries = table.setdefault("entries", {})
    written = 0
    for r in result["rows"]:
        times = {name: r["us"][b] for b, name in BASELINE_COLUMNS.items() if b in r["us"]}
        if r["wfmt"] != "bf16" or not times:
            continue
        key = moe_choice.table_key(r["E"], r["H"], r["I"], r["k"], r["wfmt"])
        if "config_entry" not in r:
            print(f"{key} T={r['T']}: the results do not say which tuned entry ours ran; the row will not count")
        entries.setdefault(key, {})[str(r["T"])] = {
            "triton": round(r["us"]["triton"], 2),
            **{n: round(t, 2) for n, t in times.items()},
            "config": r.get("config_entry"),
        }
        written += 1
    table["device"] = result["device"]
    table["measured"] = source
    table["method"] = (
        "per (shape, T): ours and the baselines timed in one run of benchmarks/moe.py (" + result["method"] + "); "
        "aten = rubin.moe's ATen form as sort + torch._grouped_mm (the grouped_mm column), vllm = vLLM's Triton "
        "fused_moe with its config (the vllm column)"
    )
    table["entries"] = {k: dict(sorted(v.items(), key=lambda kv: int(kv[0]))) for k, v in sorted(entries.items())}
    path.write_text(json.dumps(table, indent=1) + "\n")
    return written


def main(argv=None):
    ap = argparse.ArgumentParser(description="fused MoE benchmark")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--formats", default="bf16,fp8_block")
    ap.add_argument(
        "--baselines", default="grouped_mm,inductor,eager_loop", help="of grouped_mm,inductor,eager_loop,vllm"
    )
    ap.add_argument("--inductor-tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--vllm-src", default=None, help="vLLM's fused_moe folder (default: the installed vLLM's)")
    ap.add_argument("--write-baselines", default=None, help="merge ours / grouped_mm / vllm times into this table")
    ap.add_argument("--baselines-from", default=None, help="a results JSON of an earlier run: write the table from it")
    ap.add_argument(
        "--configs-from",
        default=None,
        help="with --baselines-from, for results older than the config_entry field: the tuned-config table (a "
        "moe_configs JSON) that was in effect when they were measured, e.g. from git show REV:PATH",
    )
    args = ap.parse_args(argv)

    def log(msg):
        print(msg, flush=True)

    if args.baselines_from:
        if not args.write_baselines:
            ap.error("--baselines-from needs --write-baselines PATH")
        result = json.loads(Path(args.baselines_from).read_text())
        if args.configs_from:
            old = json.loads(Path(args.configs_from).read_text())
            for r in result["rows"]:
                key = moe_choice.table_key(r["E"], r["H"], r["I"], r["k"], r["wfmt"])
                r.setdefault("config_entry", moe_choice.current_config(r["T"], key, old))
        source = f"{args.baselines_from} ({result['device']}, {result['date']}, torch {result['torch']}, Triton {result['triton']})"
        n = write_baselines(result, Path(args.write_baselines), source)
        log(f"wrote {n} entries from {args.baselines_from} into {args.write_baselines}")
        return 0
    copy_gbs = copy_bandwidth_gbs()
    peaks = {"bf16": matmul_tflops(False), "fp8": matmul_tflops(True)}
    log(
        f"device {torch.cuda.get_device_name()}: copy bandwidth {copy_gbs:.0f} GB/s (read + write); "
        f"8192^3 products: bf16 {peaks['bf16']:.0f}, FP8 {peaks['fp8']:.0f} TFLOP/s"
    )
    result = dict(
        **run_facts(),
        copy_gbs=copy_gbs,
        tflops_peak=peaks,
        method=f"CUDA-graph replays of {CALLS} calls on {COPIES} rotating weight copies, fresh random "
        f"routing before each replay, median of {args.reps}; eager_loop timed per call with events "
        f"(host-syncing reference), median of 10-20",
        rows=[],
    )
    toks = [int(t) for t in args.tokens.split(",")]
    ind_toks = {int(t) for t in args.inductor_tokens.split(",")}
    for s in args.shapes.split(","):
        result["rows"] += bench_shape(
            s,
            SHAPES[s],
            toks,
            args.formats.split(","),
            args.baselines.split(","),
            args.reps,
            copy_gbs,
            log,
            ind_toks,
            args.vllm_src,
        )
        write_outputs(result, Path(args.out), args.tag)
    log(f"wrote {args.out}/moe-{gpu_slug()}{args.tag}.*")
    if args.write_baselines:
        source = f"benchmarks/moe.py on {result['device']}, {result['date']}, commit {result['commit']}"
        n = write_baselines(result, Path(args.write_baselines), source)
        log(f"merged {n} entries into {args.write_baselines}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
