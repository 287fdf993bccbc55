"""Profile one fused-MoE call per case with Nsight Compute: where the time of a decode call goes.

    ncu --clock-control none --profile-from-start off --csv --metrics gpu__time_duration.sum,\
dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,\
sm__warps_active.avg.pct_of_peak_sustained_active \
        python benchmarks/moe_profile.py --cases qwen3-30b-a3b:bf16:1,deepseek-v3-tp8:bf16:1 > ncu.csv
    python benchmarks/moe_profile.py --summarise ncu.csv

Without Nsight Compute, ``--torch-profiler`` gives the same per-kernel split from torch.profiler: each case's kernels'
device time averaged over 10 calls (PDL off, so no kernel overlaps the next), with the call's wall time beside it
(CUDA events around the same 10 calls). ``--configs FILE`` runs the configs of a moe_configs JSON (a tuner's output,
e.g. another GPU's or a results folder's) instead of this GPU's table:

    python benchmarks/moe_profile.py --torch-profiler --cases qwen3-30b-a3b:fp8_block:4096 \
        --configs benchmarks/results/moe-h100-2026-12-05-s7/call1-tuned-NVIDIA_H100_80GB_HBM3.json

Each case runs warm-up calls first (compiles, tuned config from the table), then exactly one call between
``cudaProfilerStart`` / ``cudaProfilerStop``, so the CSV holds that call's kernels in launch order (ncu
serialises them and flushes caches between kernels: per-kernel times, not the overlap across kernels).
``--summarise`` prints per kernel: time, DRAM bytes read, DRAM GB/s and % of peak, grid size, and any other
metric in the CSV (warp stall reasons, say) as name=value.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys


def run(cases: str, torch_profiler: bool = False, configs: str = None) -> None:
    import json

    import torch

    import rubin_compile.kernels.triton.moe as moe
    from rubin_compile.kernels.triton.tune_moe import BLOCK, SHAPES, make_routing, make_weights

    table = json.load(open(configs)) if configs else None
    if torch_profiler:  # no PDL at all: the persistent path's kernels chain with it even on pdl=False, and a
        # waiting kernel's time would then include the wait for the one before it (the decode path chains only with
        # pdl=True or a config's ``chain``)
        import rubin_compile.kernels.triton.moe_prefill as prefill

        prefill.has_gdc = lambda: False

    for case in cases.split(","):
        shape, wfmt, T = case.split(":")
        T = int(T)
        sh = SHAPES[shape]
        E, k, H, I = sh["E"], sh["k"], sh["H"], sh["I"]
        w = make_weights(E, H, I, wfmt)
        x = torch.randn((T, H), device="cuda", dtype=torch.bfloat16)
        tw, ids = make_routing(T, E, k)
        cfg, src = moe.lookup_config(
            T,
            E,
            H,
            I,
            k,
            w["w13"].dtype,
            BLOCK if wfmt == "fp8_block" else None,
            torch.cuda.get_device_name(),
            table=table,
            sm90=moe.is_sm90(torch.device("cuda")),
        )

        def call(x=x, w=w, tw=tw, ids=ids, cfg=cfg):
            return moe.fused_moe(
                x,
                w["w13"],
                w["w2"],
                tw,
                ids,
                "silu",
                None,
                None,
                w.get("w13_scale"),
                w.get("w2_scale"),
                w.get("block_shape"),
                pdl=not torch_profiler,
                config=cfg,
            )

        for _ in range(3):
            call()
        torch.cuda.synchronize()
        print(f"# case {case}: {src}", file=sys.stderr)
        if torch_profiler:
            kernel_split(case, call, src)
            continue
        torch.cuda.profiler.start()
        call()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()

        torch.cuda.empty_cache()


def kernel_split(case: str, call, src: str, calls: int = 10) -> None:
    """Print each kernel's device time per call (torch.profiler, ``calls`` calls) and the call's wall time."""
    import statistics

    import torch
    from torch.profiler import ProfilerActivity, profile

    from rubin_compile.kernels.triton.tune_moe import time_eager

    walls = time_eager(call, reps=5, warmup=0, inner=calls)  # the case's warm-up calls ran before
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for ev in prof.key_averages():  # only CUDA activity was recorded: one row per kernel name (and memset)
        total_us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if total_us:
            name = ev.key.split("(")[0][:40]
            per[name] = per.get(name, 0.0) + total_us / calls
    total = sum(per.values())
    print(f"## {case}: {statistics.median(walls):.1f} us per call (events, median of 5 x {calls}); {src}")
    print("| kernel | us per call | share |")
    print("|---|---:|---:|")
    for name, us in sorted(per.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {us:.1f} | {100 * us / total:.0f}% |")
    print(f"| (sum of kernels) | {total:.1f} | |", flush=True)


def summarise(path: str) -> None:
    text = open(path).read()
    start = text.find('"ID"')
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    kernels: dict[tuple, dict] = {}
    for r in rows:
        key = (r["ID"], r["Kernel Name"].split("(")[0][:28], r.get("Grid Size", ""))
        kernels.setdefault(key, {})[r["Metric Name"]] = (r["Metric Value"].replace(",", ""), r["Metric Unit"])
    print(
        f"{'id':>4} {'kernel':28s} {'grid':>16s} {'us':>8s} {'MB read':>8s} {'GB/s':>7s} {'% dram':>7s} {'% warps':>7s}"
    )
    for (kid, name, grid), m in kernels.items():
        t, tu = m.get("gpu__time_duration.sum", ("0", "ns"))
        us = float(t) / (1000.0 if tu == "ns" else 1.0 if tu == "us" else 1e-3)
        b, bu = m.get("dram__bytes_read.sum", ("0", "byte"))
        mb = float(b) * {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}.get(bu, 1e-6)
        pct = m.get("dram__throughput.avg.pct_of_peak_sustained_elapsed", ("0", ""))[0]
        warps = m.get("sm__warps_active.avg.pct_of_peak_sustained_active", ("0", ""))[0]
        extra = " ".join(
            f"{n.split('issue_stalled_')[-1].split('_per_')[0]}={v}"
            for n, (v, _) in sorted(m.items())
            if n not in KNOWN
        )
        print(
            f"{kid:>4} {name:28s} {grid:>16s} {us:8.1f} {mb:8.1f} {mb / us * 1e3 if us else 0:7.0f} "
            f"{float(pct):7.1f} {float(warps):7.1f} {extra}"
        )


KNOWN = {
    "gpu__time_duration.sum",
    "dram__bytes_read.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "launch__grid_size",
}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", help="shape:format:T,... (shapes of tune_moe.SHAPES)")
    ap.add_argument("--summarise", help="an ncu --csv output to print as a table")
    ap.add_argument("--torch-profiler", action="store_true", help="per-kernel times from torch.profiler (no ncu)")
    ap.add_argument("--configs", help="a moe_configs JSON whose configs run instead of this GPU's table")
    args = ap.parse_args()
    if args.summarise:
        summarise(args.summarise)
    else:
        run(args.cases, args.torch_profiler, args.configs)
