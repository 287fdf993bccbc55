"""Where the MoE kernel's heuristic should run the persistent path, and whether it beats the ATen form (run on a GPU).

    PYTHONPATH=. python benchmarks/moe_heuristic.py --out benchmarks/results/DIR

Shapes without tuned configs for the GPU run the heuristic (kernels/triton/moe.py ``heuristic_config``). On sm_90
it takes the persistent path's tiles (``persistent_heuristic``) where ``moe_choice.PERSISTENT_SWITCH`` says;
below, and on other GPUs, the decode-style tiles. Off the selection table, rubin then picks between ours and the
ATen form by a rule (kernels/triton/moe_choice.py ``_rule``). This benchmark gives both decisions
their numbers, in one run, per shape, T and weight format:

* ``decode_tiles``: ``heuristic_config(..., sm90=False)``, what the heuristic ran before the persistent tiles
  (and what it runs on other GPUs);
* ``persistent``: ``persistent_heuristic``'s tiles at every T asked (below T = ``PROBE_T``, those of T = ``PROBE_T``,
  so the switch point is measured), with its relative error against the float32 reference on one call;
* ``tuned``: the tuned table's entry (this GPU's or its stand-in's), where the shape has one: how far the heuristic
  is from tuning;
* ``aten``: rubin.moe's ATen form (``torch._grouped_mm``; bf16 only), the other side of the rule.

``--write-configs moe_configs/<GPU>.json`` merges the heuristic's configs that timed more than 10% faster than the
table's (at a T between its tuned sizes, or one tuned before the persistent path) into the table, for the shapes it
has; ``--configs-from-run JSON`` does so from an earlier run's results, without a GPU.

The shapes: the four benchmark shapes the tables were tuned on, and held-out shapes of real models that were
never tuned (``HELD_OUT``): the heuristic is what those run. Timing as benchmarks/moe.py: CUDA-graph replays of
4 calls on 2 weight copies, fresh random routing before each replay, median. Writes
``moe-heuristic-<gpu>.{md,json}`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from rubin_compile.kernels.triton import moe as tmoe
from rubin_compile.kernels.triton import moe_choice
from rubin_compile.kernels.triton.tune_moe import (
    BLOCK,
    SHAPES,
    make_weights,
    random_calls,
    reference,
    rel_error,
    time_graph,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_names import gpu_slug  # noqa: E402
from moe import CALLS, COPIES, grouped_mm_moe, run_facts  # noqa: E402  (benchmarks/moe.py)

# MoE layers of released models whose shapes no table was tuned on (Hugging Face configs: hidden_size,
# moe_intermediate_size, num_experts, num_experts_per_tok)
HELD_OUT = {
    "qwen3-235b-a22b": dict(E=128, k=8, H=4096, I=1536),
    "glm-4.5-air": dict(E=128, k=8, H=4096, I=1408),
    "llama-4-scout": dict(E=16, k=1, H=5120, I=8192),
    "qwen1.5-moe-a2.7b": dict(E=60, k=4, H=2048, I=1408),
    "gpt-oss-120b": dict(E=128, k=4, H=2880, I=2880),  # H, I not multiples of 128 (nor of the FP8 scale blocks)
}
ALL_SHAPES = {**SHAPES, **HELD_OUT}
PROBE_T = 512  # below this T the persistent tiles timed are those the heuristic picks at it


def bench(name, sh, tokens, wf, reps, log):
    E, k, H, I = sh["E"], sh["k"], sh["H"], sh["I"]
    dev = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(11)
    weights = [make_weights(E, H, I, wf, seed=20 + c) for c in range(COPIES)]
    block = weights[0].get("block_shape")
    wdt = weights[0]["w13"].dtype
    dname, sms = torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for T in tokens:
        xs, routes, refresh = random_calls(T, E, k, H, CALLS, gen)

        def timed(fn):
            return statistics.median(time_graph([lambda i=i: fn(i) for i in range(CALLS)], refresh=refresh, reps=reps))

        def ours(config):
            def fn(i):
                w = weights[i % COPIES]
                return tmoe.fused_moe(
                    xs[i], w["w13"], w["w2"], routes[i][0], routes[i][1], "silu", None, None,
                    w.get("w13_scale"), w.get("w2_scale"), block, pdl=True, config=config,
                )  # fmt: skip

            return fn

        picked, source = tmoe.lookup_config(T, E, H, I, k, wdt, block, dname, sms, sm90=tmoe.is_sm90(dev))
        persistent = tmoe.persistent_heuristic(max(T, PROBE_T), E, k, H, I, wdt, block)
        configs = {"decode_tiles": tmoe.heuristic_config(T, E, H, I, k, wdt, block, sms, sm90=False)}
        if persistent is not None:
            configs["persistent"] = persistent
        if source != "heuristic":
            configs["tuned"] = picked
        row = dict(shape=name, E=E, k=k, H=H, I=I, T=T, wfmt=wf, rubin_runs=source, us={}, configs={}, errors={})
        row["rubin_runs_config"] = picked.to_json()
        for label, cfg in configs.items():
            row["configs"][label] = cfg.to_json()
            try:
                row["us"][label] = timed(ours(cfg))
            except Exception as exc:  # recorded, never dropped: a failing config is a finding
                row["errors"][label] = f"{type(exc).__name__}: {exc}"[:300]
        if "persistent" in row["us"]:
            w = weights[0]
            ref = reference(xs[0], w, routes[0][0], routes[0][1], wf)
            row["persistent_rel_err"] = rel_error(
                tmoe, configs["persistent"], xs[0], w, routes[0][0], routes[0][1], ref
            )
            del ref
        if wf == "bf16":
            try:
                row["us"]["aten"] = timed(
                    lambda i: grouped_mm_moe(
                        xs[i], weights[i % COPIES]["w13"], weights[i % COPIES]["w2"], routes[i][0], routes[i][1]
                    )
                )
            except Exception as exc:
                row["errors"]["aten"] = f"{type(exc).__name__}: {exc}"[:300]
        us = row["us"]
        log(
            f"{name:18s} {wf:9s} T={T:5d} "
            + " ".join(f"{lab}={v:8.1f}" for lab, v in us.items())
            + (f" err={row['persistent_rel_err']:.1e}" if "persistent_rel_err" in row else "")
            + (f" ERR {row['errors']}" if row["errors"] else "")
            + f" [{source}]"
        )
        rows.append(row)
    return rows


def markdown(result) -> str:
    out = [
        f"# The MoE heuristic's tiles on {result['device']} ({result['date']})",
        "",
        f"torch {result['torch']}, Triton {result['triton']}, commit {result['commit']}. {result['method']}. "
        "decode_tiles: the heuristic without the persistent tiles; persistent: its persistent tiles (below T = "
        f"{result['probe_t']}, those of T = {result['probe_t']}); tuned: the table's entry; aten: torch._grouped_mm. "
        "Ratios: that time / persistent (> 1: persistent faster). rubin runs: the config rubin's kernel takes for the "
        "call (the table's or the heuristic's).",
        "",
        "| shape | w | T | decode_tiles us | persistent us | tuned us | aten us | decode / pers. | aten / pers. "
        "| tuned / pers. | pers. rel err | rubin runs |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]

    def f(v):
        return "-" if v is None else f"{v:.1f}"

    def r(a, b):
        return "-" if a is None or b is None else f"{a / b:.2f}x"

    for row in result["rows"]:
        us = row["us"]
        p = us.get("persistent")
        err = row.get("persistent_rel_err")
        out.append(
            f"| {row['shape']} | {row['wfmt']} | {row['T']} | {f(us.get('decode_tiles'))} | {f(p)} | "
            f"{f(us.get('tuned'))} | {f(us.get('aten'))} | {r(us.get('decode_tiles'), p)} | {r(us.get('aten'), p)} | "
            f"{r(us.get('tuned'), p)} | {'-' if err is None else f'{err:.1e}'} | {row['rubin_runs']} |"
        )
    errs = [(row["shape"], row["wfmt"], row["T"], row["errors"]) for row in result["rows"] if row["errors"]]
    if errs:
        out += ["", "Errors:", ""] + [f"- {s} {w} T={t}: {e}" for s, w, t, e in errs]
    return "\n".join(out) + "\n"


MARGIN = 1.10  # a measured config replaces the table's only this much faster (one config timed twice: up to 7% apart)


def write_configs(result: dict, path: Path, margin: float = MARGIN) -> list[str]:
    """Merge into the tuned-config table at ``path`` (moe_configs/<GPU>.json, of the run's GPU) the heuristic's
    configs that timed faster than what the table runs at that T (its entry of the nearest tuned T, the ``tuned``
    column) by more than ``margin``, for shapes the table has (a shape without entries stays untuned: its rule is
    ``moe_choice.untuned_ours``). Each entry gets the time measured and, where the run checked it, the relative
    error, and ``measured_by`` naming the run. Returns what was written, one line each."""
    table = json.loads(path.read_text())
    if table.get("device") != result["device"]:
        raise SystemExit(f"{path} is the table of {table.get('device')!r}, not of {result['device']!r}")
    done = []
    for row in result["rows"]:
        us = row["us"]
        if "tuned" not in us:
            continue
        best = min((label for label in ("decode_tiles", "persistent") if label in us), key=us.get, default=None)
        if best is None or us["tuned"] <= margin * us[best]:
            continue
        key = moe_choice.table_key(row["E"], row["H"], row["I"], row["k"], row["wfmt"])
        entry = dict(row["configs"][best], us=round(us[best], 2))
        if best == "persistent" and "persistent_rel_err" in row:
            entry["rel_err"] = float(f"{row['persistent_rel_err']:.3g}")
        entry["measured_by"] = (
            f"benchmarks/moe_heuristic.py, {result['device']}, {result['date']}, commit {result['commit']}: "
            f"{best} {us[best]:.1f} us against the table's entry of then {us['tuned']:.1f} us"
        )
        table["configs"][key][str(row["T"])] = entry
        done.append(f"{key} T={row['T']}: {best} {us[best]:.1f} us (was {us['tuned']:.1f})")
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")  # as tune_moe writes it
    return done


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--shapes", default=",".join(ALL_SHAPES))
    ap.add_argument("--tokens", default="256,512,1024,2048,4096")
    ap.add_argument("--formats", default="bf16,fp8_block")
    ap.add_argument("--fp8-shapes", default=None, help="shapes timed in FP8 (default: all of --shapes)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument(
        "--write-configs",
        default=None,
        help="merge the heuristic's configs that timed over 10%% faster than the tuned table's into this table "
        "(moe_configs/<GPU>.json), for the shapes it has",
    )
    ap.add_argument("--configs-from-run", default=None, help="with --write-configs: an earlier run's JSON, no GPU")
    args = ap.parse_args(argv)
    if args.configs_from_run:
        if not args.write_configs:
            ap.error("--configs-from-run needs --write-configs PATH")
        for line in write_configs(json.loads(Path(args.configs_from_run).read_text()), Path(args.write_configs)):
            print(line)
        return 0
    unknown = [s for s in args.shapes.split(",") if s not in ALL_SHAPES]
    if unknown:
        ap.error(f"unknown shapes {unknown}; known: {', '.join(ALL_SHAPES)}")
    if not torch.cuda.is_available():
        ap.error("this benchmark times CUDA kernels: no CUDA device is visible")
    tokens = [int(t) for t in args.tokens.split(",")]
    fp8_shapes = set((args.fp8_shapes or args.shapes).split(","))
    result = dict(
        **run_facts(),
        probe_t=PROBE_T,
        persistent_switch=moe_choice.PERSISTENT_SWITCH,
        method=f"CUDA-graph replays of {CALLS} calls on {COPIES} weight copies, fresh random routing before each "
        f"replay, median of {args.reps}",
        block=BLOCK,
        rows=[],
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"moe-heuristic-{gpu_slug(result['device'])}"
    for wf in args.formats.split(","):
        for s in args.shapes.split(","):
            if wf != "bf16" and s not in fp8_shapes:
                continue
            result["rows"] += bench(s, ALL_SHAPES[s], tokens, wf, args.reps, lambda m: print(m, flush=True))
            torch.cuda.empty_cache()
            stem.with_suffix(".json").write_text(json.dumps(result, indent=1))  # written as it goes
            stem.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    if args.write_configs:
        for line in write_configs(result, Path(args.write_configs)):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
