"""Compile time of generate() with a static cache under backend="inductor" and backend="rubin", each in a fresh
process, with cold caches (new, empty TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR) and then warm (a second
process over the same directories): what a user sees on the first run on a machine and on every run after.

    PYTHONPATH=. python benchmarks/compile_time.py --out benchmarks/results

Compile time = the first generate() call (which compiles the decode step: transformers' compile_config,
mode="reduce-overhead") less the same call warm. The child process also counts where the first call's time
went in that process: Triton compiles run in it (``triton.compile``: rubin's kernels; Inductor compiles its
own in worker processes) and rubin's pass pipeline. Writes compile-time-<gpu>.{md,json} under ``--out`` (gpu_names.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: gpu_names
from gpu_names import write_results  # noqa: E402  (benchmarks/gpu_names.py)


def _count(obj, name: str, tally: dict) -> None:
    """Wrap ``obj.name`` to add its calls and seconds to ``tally[name]``."""
    fn = getattr(obj, name)

    def wrapped(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            tally[name][0] += 1
            tally[name][1] += time.perf_counter() - t0

    tally.setdefault(name, [0, 0.0])
    setattr(obj, name, wrapped)


def child(backend: str, model_name: str, context: int, new: int) -> dict:
    import torch
    import triton
    import triton.compiler.compiler as tcc

    import rubin_compile  # noqa: F401
    from rubin_compile.passes import manager

    tally: dict = {}
    _count(tcc, "compile", tally)
    # The JIT binds ``triton.compiler.compile`` when a kernel is first launched: every name of it is replaced.
    triton.compiler.compile = triton.compile = tcc.compile
    _count(manager.PassManager, "__call__", tally)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from generate import example as ex  # examples/generate.py, as benchmarks/generate.py loads it

    model = ex.build_model(model_name, torch.bfloat16, "cuda", context + new + 8)
    prompt = torch.randint(1, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0)).cuda()
    config = ex.compile_config_setup(backend, "cuda")(model)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ex.generate_once(model, prompt, new, config)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    at_first = {k: list(v) for k, v in tally.items()}
    warm = []
    for _ in range(3):
        t0 = time.perf_counter()
        ex.generate_once(model, prompt, new, config)
        torch.cuda.synchronize()
        warm.append(time.perf_counter() - t0)
    warm.sort()
    return {
        "backend": backend,
        "first_call_s": first,
        "warm_call_s": warm[1],
        "compile_s": first - warm[1],
        "triton_compiles_in_process": at_first["compile"][0],
        "triton_compile_s_in_process": at_first["compile"][1],
        "rubin_passes_s": at_first["__call__"][1],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="inductor,rubin")
    ap.add_argument("--model", default="qwen3-30b-a3b-8l")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.model, args.context, args.new_tokens)), flush=True)
        return
    rows = []
    for backend in args.backends.split(","):
        caches = Path(tempfile.mkdtemp(prefix=f"rubin-compile-time-{backend}-"))
        env = dict(
            os.environ, TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"), TRITON_CACHE_DIR=str(caches / "triton")
        )
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        for state in ("cold", "warm"):
            cmd = [sys.executable, __file__, "--child", backend, "--model", args.model, "--context", str(args.context)]
            cmd += ["--new-tokens", str(args.new_tokens)]
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(r.stdout[-2000:], r.stderr[-4000:])
                raise SystemExit(f"{backend} ({state}) failed with exit code {r.returncode}")
            rows.append({"caches": state, **json.loads(line[len("RESULT ") :])})
            print(json.dumps(rows[-1]), flush=True)
    import torch

    head = (
        f"generate() of {args.model} (bf16, batch 1, context {args.context}, {args.new_tokens} new tokens), "
        f"compile_config mode=reduce-overhead; {torch.cuda.get_device_name()}, torch {torch.__version__}"
    )
    lines = [
        head,
        "",
        "| backend | caches | compile s | first call s | warm call s | Triton compiles in process (s) | rubin passes s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['backend']} | {r['caches']} | {r['compile_s']:.1f} | {r['first_call_s']:.1f} | "
            f"{r['warm_call_s']:.2f} | {r['triton_compiles_in_process']} ({r['triton_compile_s_in_process']:.1f}) | "
            f"{r['rubin_passes_s']:.1f} |"
        )
    by = {(r["backend"], r["caches"]): r["compile_s"] for r in rows}
    for state in ("cold", "warm"):
        if ("inductor", state) in by and ("rubin", state) in by:
            lines.append(
                f"\nrubin / Inductor compile time, {state} caches: {by['rubin', state] / by['inductor', state]:.2f}x"
            )
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_results(Path(args.out), "compile-time", text, {"device": head, "rows": rows})


if __name__ == "__main__":
    main()
