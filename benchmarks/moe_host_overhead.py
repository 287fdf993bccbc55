"""Host cost and device time of one fused-MoE call (``fused_moe``), for comparing two versions of the kernel's
launch code (run on the GPU).

    PYTHONPATH=. python benchmarks/moe_host_overhead.py [--label after] [--out DIR]

Per shape and token count it measures, on random weights and routing:

* ``host us``: the wall time of the Python call that enqueues the kernels, each call started on an idle GPU (a
  synchronisation before it, outside the timed region, so no launch waits for a full queue), median over
  ``--reps`` calls after warm-up. This is what a call costs the CPU outside a CUDA graph: argument checks, the
  launch plan, buffer allocation, the launches.
* ``device us``: CUDA-graph replays of 4 back-to-back calls (weights rotated over 2 copies), median, per call:
  the kernels alone (``tune_moe.time_graph``, as benchmarks/moe.py times them).

Prints a table and writes ``moe-host-overhead-<label>.json``. To compare versions, run it once per version in the
same machine session (PYTHONPATH pointing at each checkout).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from rubin_compile.kernels.triton import moe as tmoe
from rubin_compile.kernels.triton.tune_moe import BLOCK, SHAPES, make_routing, make_weights, time_graph


def host_us(call, reps: int, warmup: int = 20) -> float:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="run")
    ap.add_argument("--out", default=".")
    ap.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3-tp8")
    ap.add_argument("--tokens", default="1,16,256")
    ap.add_argument("--formats", default="bf16,fp8_block")
    ap.add_argument("--reps", type=int, default=500)
    args = ap.parse_args()
    rows = []
    print(f"{'shape':16s} {'w':9s} {'T':>5s} {'host us':>8s} {'device us':>10s}  [{args.label}]")
    for shape in args.shapes.split(","):
        s = SHAPES[shape]
        E, k, H, I = s["E"], s["k"], s["H"], s["I"]
        for wfmt in args.formats.split(","):
            weights = [make_weights(E, H, I, wfmt, seed=c) for c in range(2)]
            block = BLOCK if wfmt == "fp8_block" else None
            for T in map(int, args.tokens.split(",")):
                xs = [torch.randn((T, H), device="cuda", dtype=torch.bfloat16) for _ in range(4)]
                routes = [make_routing(T, E, k) for _ in range(4)]

                def call(i=0, weights=weights, xs=xs, routes=routes, block=block):
                    w = weights[i % 2]
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
                        pdl=True,
                    )

                h = host_us(call, args.reps)
                d = statistics.median(time_graph([lambda i=i: call(i) for i in range(4)], reps=30, warmup=3))
                rows.append(dict(shape=shape, wfmt=wfmt, T=T, host_us=h, device_us=d, label=args.label))
                print(f"{shape:16s} {wfmt:9s} {T:5d} {h:8.1f} {d:10.1f}")
            weights = None  # free this format's weights before the next
    out = Path(args.out) / f"moe-host-overhead-{args.label}.json"
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
