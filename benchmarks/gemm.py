"""Decode-sized GEMMs: our Triton GEMM (PDL on / off) against cuBLAS and Inductor's max-autotune GEMM, and
which one rubin's selection runs.

    PYTHONPATH=. python benchmarks/gemm.py --out benchmarks/results                  # the whole matrix
    PYTHONPATH=. python benchmarks/gemm.py --shapes qwen3-30b-a3b.qkv --ms 1,16 --formats bf16 --inductor-ms ''

Shapes: ``tune_gemm.SHAPES`` (Qwen3-30B-A3B fused qkv / o / router / LM head, Llama-3.1-8B fused qkv / o /
fused gate-up / down, DeepSeek-V3 TP8 MLA and dense-MLP projections). M = 1, 2, 4, ..., 256. Formats: bf16,
and FP8 e4m3 weights with 128 x 128 block scales (weight-only: bf16 activations, the weights dequantised in
the kernel).

Timing (the harness of kernels/triton/tune_gemm.py): back-to-back calls in one CUDA graph over enough copies
of the weights that L2 never holds the next call's (as in a decode step, where each projection's weights are
read once per step), median of the replays, us per call. Per row:

- ``ours``: the config selection uses (the tuned table for this GPU, or the heuristic off the table), launched
  with PDL (as a CUDA-graph decode step launches it) and without; ``heuristic``: the heuristic's config;
- ``cublas``: ``torch.mm`` on bf16 weights of the same shape (for FP8 rows: what the model in bf16 runs);
  ``aten``: for FP8 rows, the op's ATen form, which is what rubin lowers an FP8 weight-only GEMM to when our
  kernel does not run it (the weights dequantised in float32 on every call);
- ``inductor``: ``torch.compile(F.linear, mode="max-autotune-no-cudagraphs")`` for this exact shape (bf16;
  only at ``--inductor-ms``: each compile autotunes for seconds);
- ``selected``: what rubin runs for this call (``gemm.choose``: ours or cuBLAS) and its time, against the best
  of ours / cuBLAS / Inductor;
- % of copy bandwidth (weights + activations in and out / copy bandwidth measured at the start / time) and
  % of the dense tensor peak (2MNK / time / peak; H200: 989 TFLOPS bf16, 1979 FP8).

Writes ``gemm-<gpu>.{md,json,png}`` under ``--out`` (gpu_names.py).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rubin_compile.kernels.triton import gemm as G  # noqa: E402
from rubin_compile.kernels.triton import tune_gemm as T  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: gpu_names
from gpu_names import gpu_slug  # noqa: E402  (benchmarks/gpu_names.py)

MS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PEAK_TFLOPS = {"bf16": 989.0, "fp8_block": 1979.0}  # H200 dense (NVIDIA's datasheet figures without sparsity)


def inductor_time(x, weights, reps: int) -> float:
    import torch._dynamo
    import torch.nn.functional as F

    torch._dynamo.reset()
    fn = torch.compile(lambda a, w: F.linear(a, w), mode="max-autotune-no-cudagraphs", dynamic=False)
    ws = [w["b"].t() for w in weights]
    for w in ws[:1]:
        fn(x, w)  # compile and autotune outside the graph
    return T.time_op([lambda w=w: fn(x, w) for w in ws], reps)


def measure(shapes, formats, ms, inductor_ms, reps, log) -> dict:
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    bw = T.copy_bandwidth_gbs()
    log(f"{props.name}: {sms} SMs, copy bandwidth {bw:.0f} GB/s; table: {bool(G.load_table(props.name))}")
    rows = []
    for name in shapes:
        K, N = T.SHAPES[name]
        bf16 = None
        for wfmt in formats:
            t0 = time.time()
            weights = T.make_weights(N, K, wfmt, T.copies_for(N, K, wfmt))
            if wfmt != "bf16" and bf16 is None:
                bf16 = T.make_weights(N, K, "bf16", T.copies_for(N, K, "bf16"))
            for M in ms:
                x = torch.randn((M, K), device="cuda", dtype=torch.bfloat16)
                choice = G.choose(M, N, K, wfmt, props.name, sms)
                off_table = G.choose(M, N, K, wfmt, "", sms, table={})  # what the heuristic's rule picks
                heur = off_table.config
                r = dict(shape=name, format=wfmt, M=M, N=N, K=K, config=choice.config.describe(), source=choice.source)
                r["ours_us"] = T.ours_time(x, weights, choice.config, True, reps)
                r["ours_nopdl_us"] = T.ours_time(x, weights, choice.config, False, reps)
                r["heuristic_us"] = r["ours_us"] if heur == choice.config else T.ours_time(x, weights, heur, True, reps)
                r["cublas_us"] = T.cublas_time(x, weights if wfmt == "bf16" else bf16, "bf16", reps)
                r["aten_us"] = T.cublas_time(x, weights, wfmt, reps) if wfmt != "bf16" and M in (1, 16) else None
                r["inductor_us"] = inductor_time(x, weights, reps) if wfmt == "bf16" and M in inductor_ms else None
                rival = r["cublas_us"] if wfmt == "bf16" else (r["aten_us"] or math.inf)
                r["heuristic_selects"] = "ours" if off_table.kernel == "triton" else "cuBLAS"
                r["heuristic_selected_us"] = r["heuristic_us"] if off_table.kernel == "triton" else rival
                r["selected"] = "ours" if choice.kernel == "triton" else ("cuBLAS" if wfmt == "bf16" else "ATen form")
                r["selected_us"] = r["ours_us"] if choice.kernel == "triton" else rival
                candidates = {"ours": r["ours_us"], "cuBLAS": r["cublas_us"] if wfmt == "bf16" else None}
                candidates["ATen form"] = r["aten_us"]
                candidates["Inductor"] = r["inductor_us"]
                best = min((v, k) for k, v in candidates.items() if v is not None)
                r["best"], r["best_us"] = best[1], best[0]
                flops, nbytes = G.flops_and_bytes(M, N, K, wfmt)
                r["floor_us"] = nbytes / (bw * 1e3)
                r["pct_copy_bw"] = 100 * r["floor_us"] / r["ours_us"]
                r["pct_copy_bw_cublas"] = 100 * (G.flops_and_bytes(M, N, K, "bf16")[1] / (bw * 1e3)) / r["cublas_us"]
                r["pct_tensor_peak"] = 100 * flops / (r["ours_us"] * 1e-6) / (PEAK_TFLOPS[wfmt] * 1e12)
                r["weights_MB"] = G.weight_bytes(N, K, wfmt) / 1e6
                rows.append(r)
                ind = f"{r['inductor_us']:.2f}" if r["inductor_us"] is not None else "-"
                log(
                    f"{name:28s} {wfmt:9s} M={M:3d} ours {r['ours_us']:8.2f} (no PDL {r['ours_nopdl_us']:8.2f}, "
                    f"heur {r['heuristic_us']:8.2f}) cuBLAS {r['cublas_us']:8.2f} Inductor {ind:>8s} "
                    f"{r['pct_copy_bw']:5.1f}% BW | selected {r['selected']} ({choice.source}), best {r['best']}"
                )
            del weights
            torch.cuda.empty_cache()
            log(f"  {name} {wfmt}: {time.time() - t0:.0f} s")
        bf16 = None
    return {"gpu": props.name, "sms": sms, "copy_GBps": round(bw), "torch": torch.__version__, "rows": rows}


def summary(res: dict) -> list[str]:
    """The issue's goals, computed from the rows."""
    rows = res["rows"]
    out = []
    bf = [r for r in rows if r["format"] == "bf16"]
    big = [r for r in bf if r["M"] <= 16 and r["weights_MB"] >= 8]
    if big:
        worst = min(big, key=lambda r: r["pct_copy_bw"])
        out.append(
            f"bf16, M <= 16, weights >= 8 MB: {sum(r['pct_copy_bw'] >= 85 for r in big)} / {len(big)} rows at >= 85% of "
            f"copy bandwidth; median {statistics.median(r['pct_copy_bw'] for r in big):.0f}%, lowest "
            f"{worst['pct_copy_bw']:.0f}% ({worst['shape']} M={worst['M']})"
        )
    m1 = [r for r in bf if r["M"] == 1]
    if m1:
        gm = math.exp(statistics.mean(math.log(r["cublas_us"] / r["ours_us"]) for r in m1))
        gms = math.exp(statistics.mean(math.log(r["cublas_us"] / r["selected_us"]) for r in m1))
        out.append(
            f"bf16, M = 1: geometric mean of cuBLAS / ours over {len(m1)} shapes {gm:.2f}x (selected: {gms:.2f}x)"
        )
    fp = {(r["shape"], r["M"]): r for r in rows if r["format"] == "fp8_block"}
    pairs = [(fp[(r["shape"], 1)], r) for r in m1 if (r["shape"], 1) in fp]
    if pairs:
        ratios = [b["ours_us"] / f["ours_us"] for f, b in pairs]
        out.append(
            f"FP8 block vs our bf16 at M = 1: geometric mean {math.exp(statistics.mean(map(math.log, ratios))):.2f}x, "
            f"{sum(x >= 1.6 for x in ratios)} / {len(ratios)} shapes >= 1.6x"
        )
    slower = [r for r in rows if r["selected_us"] > 1.05 * r["best_us"]]
    out.append(
        f"selection slower than the best of the measured kernels by > 5%: {len(slower)} of {len(rows)} rows"
        + "".join(
            f"\n  - {r['shape']} {r['format']} M={r['M']}: {r['selected']} {r['selected_us']:.2f} us vs "
            f"{r['best']} {r['best_us']:.2f} us"
            for r in slower[:20]
        )
    )
    pdl = [r["ours_nopdl_us"] / r["ours_us"] for r in rows if r["M"] <= 16]
    if pdl:
        out.append(
            f"PDL on vs off (ours, M <= 16): median {statistics.median(pdl):.3f}x faster with PDL, "
            f"range {min(pdl):.2f}-{max(pdl):.2f}x"
        )
    heur = [r for r in bf if r["heuristic_selected_us"] > 1.05 * r["cublas_us"]]
    out.append(
        f"off the table (the heuristic's rule and config), slower than cuBLAS by > 5% (bf16): {len(heur)} of {len(bf)} rows"
    )
    return out


def write(res: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gemm-{gpu_slug()}.json").write_text(json.dumps(res, indent=1) + "\n")
    f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [
        f"# Decode-sized GEMMs on {res['gpu']} (copy bandwidth {res['copy_GBps']} GB/s, torch {res['torch']})",
        "",
        f"Measured at commit {res.get('commit', '?')} with `{res.get('command', 'benchmarks/gemm.py')}`. Times in us per call "
        "(CUDA-graph replays of back-to-back calls over rotating weight copies, medians). `% BW`: bytes at the floor / "
        "copy bandwidth / ours; `% peak`: 2MNK / ours / dense tensor peak. FP8 rows: weight-only FP8 with 128x128 "
        "block scales; their cuBLAS column is bf16 weights of the same shape, `ATen` is what rubin lowers them to.",
        "",
        "## Goals",
        "",
        *[f"- {s}" for s in summary(res)],
        "",
        "## All rows",
        "",
        "| shape | fmt | M | N | K | MB | ours PDL | ours no PDL | heuristic | cuBLAS | ATen | Inductor | % BW | % BW cuBLAS | % peak | selected | best | config (source) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['shape']} | {r['format']} | {r['M']} | {r['N']} | {r['K']} | {r['weights_MB']:.1f} | "
            f"{f(r['ours_us'])} | {f(r['ours_nopdl_us'])} | {f(r['heuristic_us'])} | {f(r['cublas_us'])} | "
            f"{f(r['aten_us'])} | {f(r['inductor_us'])} | {r['pct_copy_bw']:.0f} | {r['pct_copy_bw_cublas']:.0f} | "
            f"{r['pct_tensor_peak']:.1f} | {r['selected']} {f(r['selected_us'])} | {r['best']} | "
            f"{r['config']} ({r['source']}) |"
        )
    (out / f"gemm-{gpu_slug()}.md").write_text("\n".join(lines) + "\n")
    plot(res, out / f"gemm-{gpu_slug()}.png")


def plot(res: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return
    rows = [r for r in res["rows"] if r["format"] == "bf16"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    cols = 4
    fig, axes = plt.subplots(math.ceil(len(shapes) / cols), cols, figsize=(4 * cols, 3 * math.ceil(len(shapes) / cols)))
    for ax, s in zip(axes.flat, shapes):
        rs = [r for r in rows if r["shape"] == s]
        ms = [r["M"] for r in rs]
        for key, label in (("ours_us", "ours (PDL)"), ("ours_nopdl_us", "ours (no PDL)"), ("cublas_us", "cuBLAS")):
            ax.plot(ms, [r[key] for r in rs], marker="o", label=label)
        ind = [(r["M"], r["inductor_us"]) for r in rs if r["inductor_us"] is not None]
        if ind:
            ax.plot(*zip(*ind), marker="s", linestyle="none", label="Inductor max-autotune")
        ax.plot(ms, [r["floor_us"] for r in rs], linestyle="--", color="gray", label="floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(s, fontsize=9)
        ax.set_xlabel("M")
        ax.set_ylabel("us")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"bf16 GEMM, {res['gpu']}: time per call")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(T.SHAPES))
    ap.add_argument("--formats", default="bf16,fp8_block")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--inductor-ms", default="1,16,64,256", help="M values at which Inductor max-autotune is timed")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default="?")
    ap.add_argument("--plot-from", default=None, help="only redraw the plot (and the table) from a JSON")
    a = ap.parse_args()
    if a.plot_from:
        res = json.loads(Path(a.plot_from).read_text())
        write(res, Path(a.out or Path(a.plot_from).parent))
        return
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gemm.py needs a CUDA GPU")
    inductor_ms = {int(m) for m in a.inductor_ms.split(",") if m}
    res = measure(
        a.shapes.split(","), a.formats.split(","), [int(m) for m in a.ms.split(",")], inductor_ms, a.reps, print
    )
    res["commit"] = a.commit
    res["command"] = "python benchmarks/gemm.py " + " ".join(sys.argv[1:])
    for line in summary(res):
        print(line)
    if a.out:
        write(res, Path(a.out))


if __name__ == "__main__":
    main()
