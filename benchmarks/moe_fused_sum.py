"""The persistent MoE path's top-k sum in FC2's epilogue (``GemmConfig.epilogue_sum=True`` on FC2) against its own
kernel (``epilogue_sum=False``), on the config this GPU runs for each case (its tuned table, or the heuristic).

    python benchmarks/moe_fused_sum.py --shapes qwen3-30b-a3b,deepseek-v3-tp8 --tokens 1024,4096 \
        --formats bf16,fp8_block --out benchmarks/results/<folder>

For each (shape, weight format, T) whose config is the persistent path with the Triton FC2 (a Gluon FC2 leaves the sum
to its kernel; other modes have their own fused sum): both forms' outputs on the same call, which must be bitwise
equal (the fused epilogue sums in the same order with the same float32 operations); then their call times, CUDA-graph
replays of 4 back-to-back calls on 2 weight copies with fresh routing per replay (as the tuner times), PDL on, median of
``--reps`` replays, in ``--rounds`` alternating rounds (unfused, fused, unfused, ...) so drift hits both alike; the
median of the rounds' medians is reported, with the spread of the rounds. Cases not compared are listed with the reason.
Writes ``moe-fused-sum-<gpu>.{md,json}`` under ``--out``. ``--configs FILE`` runs another table's configs (a tuner's
output) instead of this GPU's.

Then, on any machine, a run's JSON sets ``epilogue_sum`` in the tuned table where it measured faster:

    python benchmarks/moe_fused_sum.py --apply RUN.json --write-configs \
        rubin_compile/kernels/triton/moe_configs/NVIDIA_H200.json --commit <hash the run measured>

only for rows whose config was that table's entry at exactly that T, measured on the table's GPU, bitwise equal, and
faster in every round by ``--min-speedup`` (default 1.02) at the median; the entry's ``us`` becomes the fused time of
the run (the same method as the tuner's) and ``measured_by`` says so. Every other row is printed with why it was left.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_names import gpu_slug  # noqa: E402

import rubin_compile.kernels.triton.moe as moe  # noqa: E402
from rubin_compile.kernels.triton.tune_moe import (  # noqa: E402
    BLOCK,
    SHAPES,
    describe,
    make_weights,
    random_calls,
    time_graph,
)


def _calls(cfg, xs, routes, weights):
    return [
        (
            lambda i=i: moe.fused_moe(
                xs[i],
                weights[i % 2]["w13"],
                weights[i % 2]["w2"],
                routes[i][0],
                routes[i][1],
                "silu",
                None,
                None,
                weights[i % 2].get("w13_scale"),
                weights[i % 2].get("w2_scale"),
                weights[i % 2].get("block_shape"),
                pdl=True,
                config=cfg,
            )
        )
        for i in range(len(xs))
    ]


def compare(shape: str, wfmt: str, T: int, table, rounds: int, reps: int, gen) -> dict:
    sh = SHAPES[shape]
    E, k, H, I = sh["E"], sh["k"], sh["H"], sh["I"]
    wdt = torch.bfloat16 if wfmt == "bf16" else torch.float8_e4m3fn
    block = BLOCK if wfmt == "fp8_block" else None
    dev = torch.device("cuda")
    cfg, src = moe.lookup_config(
        T, E, H, I, k, wdt, block, torch.cuda.get_device_name(), table=table, sm90=moe.is_sm90(dev)
    )
    row = dict(shape=shape, format=wfmt, T=T, config=describe(cfg), source=src)
    if cfg.mode != "persistent" or cfg.fc2.gluon:
        row["skipped"] = (
            "the Gluon FC2 leaves the sum to its kernel" if cfg.mode == "persistent" else f"mode {cfg.mode!r}"
        )
        return row
    unfused = replace(cfg, fc2=replace(cfg.fc2, epilogue_sum=False))
    fused = replace(cfg, fc2=replace(cfg.fc2, epilogue_sum=True))
    weights = [make_weights(E, H, I, wfmt, seed=i) for i in range(2)]
    xs, routes, refresh = random_calls(T, E, k, H, 4, gen)
    a = _calls(unfused, xs, routes, weights)[0]()
    b = _calls(fused, xs, routes, weights)[0]()
    torch.cuda.synchronize()
    row["bitwise_equal"] = bool(torch.equal(a, b))
    row["max_abs_diff"] = float((a.float() - b.float()).abs().max())
    times = {"unfused": [], "fused": []}
    for _ in range(rounds):
        for name, c in (("unfused", unfused), ("fused", fused)):
            times[name].append(statistics.median(time_graph(_calls(c, xs, routes, weights), refresh, reps=reps)))
    for name, ts in times.items():
        row[f"{name}_us"] = round(statistics.median(ts), 2)
        row[f"{name}_rounds_us"] = [round(t, 2) for t in ts]
    row["speedup"] = round(row["unfused_us"] / row["fused_us"], 4)
    # fused faster in every round: the per-round pairs, not only the medians
    row["fused_wins_every_round"] = all(f < u for u, f in zip(times["unfused"], times["fused"]))
    return row


def apply(run: dict, table_path: Path, min_speedup: float, commit: str) -> list[str]:
    """Set FC2's ``epilogue_sum`` in the table's entries where ``run`` measured it faster (module docstring); returns
    one line per row: what was done or why not."""
    table = json.loads(table_path.read_text())
    said = []
    for r in run["rows"]:
        case = f"{r['shape']} {r['format']} T={r['T']}"
        src = r.get("source", "")
        why = None
        if "skipped" in r:
            why = f"not compared ({r['skipped']})"
        elif run["device"] != table.get("device"):
            why = f"measured on {run['device']}, the table is {table.get('device')}'s"
        elif not src.startswith("table:") or " of " in src or not src.endswith(f"@T={r['T']}"):
            why = f"its config was not the table's entry at T={r['T']} ({src})"
        elif not r["bitwise_equal"]:
            why = "the two forms' outputs differ"
        elif not (r["fused_wins_every_round"] and r["speedup"] >= min_speedup):
            why = f"not faster in every round by {min_speedup}x (median {r['speedup']:.3f}x)"
        if why is not None:
            said.append(f"{case}: left as it is: {why}")
            continue
        key = src[len("table:") : src.rindex("@T=")]
        entry = table["configs"][key][str(r["T"])]
        entry["fc2"]["epilogue_sum"] = True
        entry["us"] = r["fused_us"]
        entry["measured_by"] = (
            f"benchmarks/moe_fused_sum.py, {run['device']}, commit {commit}: the top-k sum in FC2's epilogue "
            f"{r['fused_us']} us against {r['unfused_us']} us with the sum kernel ({r['speedup']:.3f}x)"
        )
        said.append(f"{case}: epilogue_sum set ({r['unfused_us']} -> {r['fused_us']} us)")
    table_path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return said


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3-tp8,mixtral-8x7b")
    ap.add_argument("--tokens", default="256,1024,4096")
    ap.add_argument("--formats", default="bf16,fp8_block")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--configs", default=None, help="a moe_configs JSON to run instead of this GPU's table")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--apply", default=None, help="a run's JSON: set epilogue_sum in --write-configs where it won")
    ap.add_argument("--write-configs", default=None, help="the tuned table (moe_configs/<GPU>.json) --apply edits")
    ap.add_argument("--min-speedup", type=float, default=1.02)
    ap.add_argument("--commit", default="unknown", help="the commit the run measured (for measured_by)")
    args = ap.parse_args(argv)
    if args.apply:
        if not args.write_configs:
            ap.error("--apply needs --write-configs (the table to edit)")
        run = json.loads(Path(args.apply).read_text())
        print("\n".join(apply(run, Path(args.write_configs), args.min_speedup, args.commit)))
        return
    table = json.load(open(args.configs)) if args.configs else None
    name = torch.cuda.get_device_name()
    gen = torch.Generator(device="cuda").manual_seed(1234)
    rows = []
    for s in args.shapes.split(","):
        for wf in args.formats.split(","):
            for T in (int(t) for t in args.tokens.split(",")):
                r = compare(s, wf, T, table, args.rounds, args.reps, gen)
                rows.append(r)
                print(json.dumps(r), flush=True)
                torch.cuda.empty_cache()
    lines = [
        f"Top-k sum in FC2 (fused) vs its own kernel (unfused), the persistent path, {name}, torch {torch.__version__}; "
        f"CUDA-graph replays of 4 calls, PDL on, median of {args.reps} replays, median of {args.rounds} alternating "
        "rounds (min-max of the rounds' medians in brackets)",
        "",
        "| shape | format | T | config | unfused us | fused us | unfused / fused | fused faster every round | "
        "bitwise equal |",
        "|---|---|---:|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(
                f"| {r['shape']} | {r['format']} | {r['T']} | {r['config']} | - | - | - | not compared: "
                f"{r['skipped']} | - |"
            )
            continue
        u, f = r["unfused_rounds_us"], r["fused_rounds_us"]
        lines.append(
            f"| {r['shape']} | {r['format']} | {r['T']} | {r['config']} | {r['unfused_us']:.1f} "
            f"[{min(u):.1f}-{max(u):.1f}] | {r['fused_us']:.1f} [{min(f):.1f}-{max(f):.1f}] | {r['speedup']:.3f}x | "
            f"{'yes' if r['fused_wins_every_round'] else 'no'} | {'yes' if r['bitwise_equal'] else 'NO'} |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"moe-fused-sum-{gpu_slug()}"
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(
        json.dumps({"device": name, "torch": torch.__version__, "rows": rows}, indent=1)
    )
    print("\n".join(lines))
    if not all(r.get("bitwise_equal", True) for r in rows):
        sys.exit("the fused top-k sum changed a value (see bitwise_equal)")


if __name__ == "__main__":
    main()
