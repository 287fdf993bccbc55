"""Profile one fused-MoE call per case with Nsight Compute: where the time of a decode call goes.

    ncu --clock-control none --profile-from-start off --csv --metrics gpu__time_duration.sum,\
dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,\
sm__warps_active.avg.pct_of_peak_sustained_active \
        python benchmarks/moe_profile.py --cases qwen3-30b-a3b:bf16:1,deepseek-v3-tp8:bf16:1 > ncu.csv
    python benchmarks/moe_profile.py --summarise ncu.csv

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


def run(cases: str) -> None:
    import torch

    import rubin_compile.kernels.triton.moe as moe
    from rubin_compile.kernels.triton.tune_moe import BLOCK, SHAPES, make_routing, make_weights

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
            sm90=moe.is_sm90(torch.device("cuda")),
        )

        def call(x=x, w=w, tw=tw, ids=ids):
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
                pdl=True,
            )

        for _ in range(3):
            call()
        torch.cuda.synchronize()
        print(f"# case {case}: {src}", file=sys.stderr)
        torch.cuda.profiler.start()
        call()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()

        torch.cuda.empty_cache()


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
    args = ap.parse_args()
    if args.summarise:
        summarise(args.summarise)
    else:
        run(args.cases)
