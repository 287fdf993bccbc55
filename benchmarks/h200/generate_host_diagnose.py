"""Issue 16: why generate() at 4k is host-bound under rubin (2026-12-02 step 3: per token 2170 us against a ~560 us
decode step; Inductor 2316 us against ~1290). For each backend, generate()'s compiled decode step (compile_config,
mode="reduce-overhead"), after a first generate() that compiles:

* wall time of generate(N) for N = 1, 2, 65, 129 (median of --repeats): the cost of a generate() call's first
  decode step (t(2) - t(1): transformers makes a new static cache per call, and where its addresses are new the CUDA
  graph is recorded again) and the per-token cost once running ((t(129) - t(65)) / 64);
* host time of each compiled decode call (synchronised before; the wall time of the call alone), median;
* what the CUDA-graph tree manager did per call (replays, recordings, eager runs, recordings per function);
* a cProfile of one warm generate(65): the top functions by own and by cumulative time (``--profile-out``).

``--setup forward`` compiles ``model.forward`` instead (examples/generate.py's second way, no CUDA graphs).

``--log`` turns on the cudagraph trees' debug log (Re-recording reasons): with it, every call that checks a stale
recording first formats the reason with stack traces, which inflates host time (the first run of this script,
2026-12-02 step 5, had it on: 1014 us for rubin). Timings are taken with it off.

    PYTHONPATH=/tmp/site:. python3 benchmarks/h200/generate_host_diagnose.py --context 4096 --profile-out $OUT
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from generate import example  # noqa: E402  (benchmarks/generate.py's loader of examples/generate.py)


def _count_tree_manager(counts: collections.Counter) -> None:
    """Count what cudagraph trees does per call: replay a recording, record one, or run eagerly (warm-up)."""
    from torch._inductor import cudagraph_trees as ct

    mgr = ct.CUDAGraphTreeManager
    for name in ("execute_node", "record_function", "run_eager"):
        orig = getattr(mgr, name)

        def wrapped(self, *a, _orig=orig, _name=name, **k):
            counts[_name] += 1
            return _orig(self, *a, **k)

        setattr(mgr, name, wrapped)
    orig_run = mgr._run

    def run(self, new_inputs, function_id, _orig=orig_run):
        counts["calls"] += 1
        counts["recordings_of_function"] = len(self.roots.get(function_id, []))
        return _orig(self, new_inputs, function_id)

    mgr._run = run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="qwen3-30b-a3b-8l")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (tiny model)")
    ap.add_argument(
        "--backends",
        default="inductor,rubin",
        help="comma-separated; rubin-call: rubin with inline_kernels='off' (every kernel node an op call)",
    )
    ap.add_argument("--log", action="store_true", help="cudagraph trees' debug log (inflates host time)")
    ap.add_argument("--profile-out", default=None, help="folder for profile-<setup>-<backend>.txt")
    ap.add_argument(
        "--setup",
        choices=["compile_config", "forward"],
        default="compile_config",
        help="how generate() is compiled: its compile_config (CUDA graphs) or model.forward (no CUDA graphs)",
    )
    args = ap.parse_args()
    if args.log:
        torch._logging.set_logs(cudagraphs=True, perf_hints=True)

    counts: collections.Counter = collections.Counter()
    _count_tree_manager(counts)
    model = example.build_model(args.model, torch.bfloat16, args.device, args.context + 129 + 8)
    prompt = torch.randint(1, model.config.vocab_size, (1, args.context), device=args.device)
    rows = []
    for backend in args.backends.split(","):
        torch._dynamo.reset()
        label = backend
        if backend == "rubin-call":  # the rubin op called per node, as before passes/inline_kernels.py
            os.environ["RUBIN_INLINE_KERNELS"], backend = "off", "rubin"
        else:
            os.environ.pop("RUBIN_INLINE_KERNELS", None)
        # every backend gets the same cache length (transformers keeps the longest one it made)
        model._previous_max_cache_length = args.context + 129
        setup = example.compile_config_setup if args.setup == "compile_config" else example.forward_setup
        cfg = setup(backend, args.device)(model)
        t0 = time.perf_counter()
        example.generate_once(model, prompt, 16, cfg)
        example._sync(args.device)
        compile_s = time.perf_counter() - t0

        def gen(n):
            return lambda: example.generate_once(model, prompt, n, cfg)

        walls = {n: example.timed(gen(n), args.device, args.repeats)[1] for n in (1, 2, 65, 129)}

        calls: list[float] = []

        def timed(fn):
            def wrapper(*a, **k):
                example._sync(args.device)
                t0 = time.perf_counter()
                out = fn(*a, **k)
                calls.append(time.perf_counter() - t0)
                return out

            return wrapper

        counts.clear()
        if args.setup == "compile_config":  # the compiled callable generate() asks the model for
            get = model.get_compiled_call
            model.get_compiled_call = lambda compile_config, _get=get: timed(_get(compile_config))
            try:
                example.generate_once(model, prompt, 65, cfg)
            finally:
                del model.get_compiled_call
        else:  # the compiled model.forward (its first call is the prefill, left out of the median below)
            compiled = model.forward
            model.forward = timed(compiled)
            try:
                example.generate_once(model, prompt, 65, cfg)
            finally:
                model.forward = compiled
        tree = dict(counts)

        if args.profile_out:
            prof = cProfile.Profile()
            prof.enable()
            example.generate_once(model, prompt, 65, cfg)
            example._sync(args.device)
            prof.disable()
            s = io.StringIO()
            st = pstats.Stats(prof, stream=s)
            st.sort_stats("tottime").print_stats(45)
            st.sort_stats("cumulative").print_stats(60)
            Path(args.profile_out, f"profile-{args.setup}-{label}.txt").write_text(s.getvalue())

        row = dict(
            backend=label,
            compile_s=compile_s,
            fixed_ms=(walls[2] - walls[1]) * 1e3,
            per_token_us=(walls[129] - walls[65]) / 64 * 1e6,
            per_token_issue_us=(walls[129] - walls[1]) / 128 * 1e6,
            host_call_us=statistics.median(calls[2:]) * 1e6 if len(calls) > 2 else float("nan"),
            tree=tree,
        )
        rows.append(row)
        print(row, flush=True)
    print(
        "| backend | compile s | first decode call of a generate() (t2 - t1) ms | per token (t129 - t65)/64 us "
        "| per token (t129 - t1)/128 us | host per compiled call us | tree manager (64 calls) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['backend']} | {r['compile_s']:.0f} | {r['fixed_ms']:.1f} | {r['per_token_us']:.0f} | "
            f"{r['per_token_issue_us']:.0f} | {r['host_call_us']:.0f} | {r['tree']} |"
        )


if __name__ == "__main__":
    main()
