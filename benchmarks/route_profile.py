"""Where the decode routing's time goes (issue 13's routing goal: <= 3 us per layer at T <= 32).

    PYTHONPATH=. python benchmarks/route_profile.py --out /tmp/out

For each router of benchmarks/route.py and each T, in CUDA graphs of 16 calls (benchmarks/route.py's timing: a
fresh router weight copy and hidden states per call, median of the replays, per call):

- ``call``: the whole routing as rubin launches it (``route.launch``), PDL on and off;
- ``logits only`` / ``top-k only``: the same calls with the other kernel's launch skipped (``route.launcher``
  wrapped for this run; the skipped kernel's outputs are whatever the buffers hold, so only the times mean
  anything), PDL off: what each kernel costs between other kernels of a graph;
- the per-kernel device time from torch.profiler over the replays (PDL off, so no kernel's time includes a wait);
- ``launch floor``: a Triton kernel that writes one float, 16 (and 32) to a graph, PDL off and on: what any
  kernel costs there before it does work;
- whole calls (PDL on) with other logits tiles (``SWEEP``) and, at T <= 8, both logits forms (``RouteConfig.mma``:
  multiply-adds or ``tl.dot``); the top-k kernel alone at 1 / 2 / 4 / 8 warps.

Writes route-profile-<gpu>.{md,json} under ``--out``. A diagnostic: nothing in rubin reads its output.
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

from rubin_compile.kernels.triton import route as kernel
from rubin_compile.kernels.triton.launch import launcher

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_wait = gdc_launch_dependents = None

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: route, gpu_names
from gpu_names import write_results  # noqa: E402
from graph_profile import per_kernel  # noqa: E402
from route import CALLS, MODELS, graph_us, inputs  # noqa: E402


# (block_e, block_k, warps) of the logits kernel tried per router: the heuristic's and longer K slices (fewer
# partials for the top-k kernel to sum)
SWEEP = {
    "DeepSeek-V3": [(16, 512, 4), (8, 1024, 4), (8, 2048, 8), (16, 1024, 8), (32, 256, 4), (16, 256, 4)],
    "Qwen3-30B-A3B": [(8, 256, 4), (16, 128, 4), (16, 1024, 8), (8, 1024, 4), (16, 512, 4), (8, 2048, 8)],
    "Mixtral-8x7B": [(8, 256, 4), (16, 128, 4), (8, 512, 4), (8, 1024, 4), (8, 2048, 8), (8, 4096, 8)],
}


@triton.jit
def _one_store_kernel(out_ptr, GDC: tl.constexpr):
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    tl.store(out_ptr + tl.program_id(0), 1.0)


def launch_floor(n: int, pdl: bool) -> float:
    """us per launch of a one-store kernel, ``n`` to a graph (CALLS per timed call, so scaled back per launch)."""
    out = torch.empty(132, device="cuda")
    gdc = kernel._has_gdc(out.device)

    def one():
        for _ in range(n // CALLS):
            launcher(_one_store_kernel)[(1,)](
                out, GDC=gdc, num_warps=1, **({"launch_pdl": True} if pdl and gdc else {})
            )

    return graph_us([one]) * CALLS / n


@contextlib.contextmanager
def only(which: str):
    """Launch only the ``which`` kernel ("logits" / "topk") of route.launch."""
    skip = kernel._route_topk_kernel if which == "logits" else kernel._router_logits_kernel
    real = kernel.launcher

    class _Skip:
        def __getitem__(self, grid):
            return lambda *a, **k: None

    kernel.launcher = lambda fn: _Skip() if fn is skip else real(fn)
    try:
        yield
    finally:
        kernel.launcher = real


def per_kernel_us(fns: list) -> dict[str, float]:
    """Median device time per kernel over the profiled replays of a graph of ``fns`` (graph_profile.per_kernel),
    the routing kernels named "logits" and "topk"."""
    out = {}
    for name, v in per_kernel(fns, CALLS).items():
        out["logits" if "logits" in name else "topk" if "topk" in name else name] = v["us"]
    return out


def case(model: str, T: int, sweep: bool) -> dict:
    m = MODELS[model]
    E, H, k = m["E"], m["H"], m["k"]
    ws, xs, _, kw = inputs(model, T)
    cfg0 = kernel.heuristic(T, E, H, kernel._num_sms(xs[0].device))

    def fns(pdl=False, cfg=None):
        return [lambda x=x, w=w: kernel.route(x, w, top_k=k, pdl=pdl, config=cfg, **kw) for x, w in zip(xs, ws)]

    row = {"model": model, "T": T, "heuristic": [cfg0.block_e, cfg0.block_k, cfg0.num_warps, cfg0.topk_warps]}
    row["call_pdl_us"] = graph_us(fns(True))
    row["call_us"] = graph_us(fns(False))
    for which in ("logits", "topk"):
        with only(which):
            row[f"{which}_only_us"] = graph_us(fns(False))
    try:
        row["profiled_us"] = per_kernel_us(fns(False))
    except Exception as e:  # the profiler is a diagnostic extra: the timings above stand without it
        row["profiled_us"] = {}
        print(f"profiler: {type(e).__name__}: {e}", flush=True)
    if sweep:  # whole calls, PDL on: tiles around the heuristic's, each logits form where T allows both
        sw = {}
        for be, bk, nw in SWEEP[model]:
            for mma in (False, True) if T <= 8 else (True,):
                cfg = kernel.RouteConfig(be, bk, nw, cfg0.topk_warps, mma)
                sw[f"{be}x{bk}w{nw}{'-mma' if mma else '-fma'}"] = graph_us(fns(True, cfg))
        row["call_sweep_pdl_us"] = sw
        row["topk_warps_us"] = {}
        for tw in (1, 2, 4, 8):
            cfg = kernel.RouteConfig(cfg0.block_e, cfg0.block_k, cfg0.num_warps, tw)
            with only("topk"):
                row["topk_warps_us"][tw] = graph_us(fns(False, cfg))
    return row


def render(rows: list[dict], floors: dict, head: str) -> list[str]:
    lines = [
        f"Decode routing, where the time goes; {head}",
        "",
        f"Launch floor (a one-store Triton kernel, us per launch in a graph): {json.dumps(floors)}",
        "",
        "| router | T | heuristic (BE, BK, warps, top-k warps) | call, PDL | call | logits only | top-k only | "
        "profiled logits / top-k | best call, PDL (us) | top-k warps 1 / 2 / 4 / 8 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        prof = r["profiled_us"]
        sw = r.get("call_sweep_pdl_us") or {}
        best = min(sw, key=sw.get) if sw else None
        tw = r.get("topk_warps_us") or {}
        lines.append(
            f"| {r['model']} | {r['T']} | {r['heuristic']} | {r['call_pdl_us']:.2f} | {r['call_us']:.2f} | "
            f"{r['logits_only_us']:.2f} | {r['topk_only_us']:.2f} | "
            f"{prof.get('logits', float('nan')):.2f} / {prof.get('topk', float('nan')):.2f} | "
            f"{f'{best} ({sw[best]:.2f})' if best else '-'} | {' / '.join(f'{v:.2f}' for v in tw.values()) or '-'} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/out"))
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--tokens", nargs="*", type=int, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    props = torch.cuda.get_device_properties(0)
    head = f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}"
    print(head, flush=True)
    floors = {f"{n} per graph, pdl {p}": round(launch_floor(n, p), 3) for n in (16, 32) for p in (False, True)}
    print(floors, flush=True)
    rows = []
    for model in args.models:
        for T in args.tokens:
            rows.append(case(model, T, not args.no_sweep))
            print(json.dumps(rows[-1]), flush=True)
    text = "\n".join(render(rows, floors, head))
    print(text)
    write_results(args.out, "route-profile", text, {"device": head, "launch_floor": floors, "rows": rows})


if __name__ == "__main__":
    main()
