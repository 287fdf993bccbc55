"""Issue 16: generate() with ``model.forward`` compiled (no CUDA graphs), Inductor against rubin, timed in
interleaved rounds so that the H200 host's drift (up to 2x within a session, sixth session) falls on both alike.

For each context: both compiles of ``model.forward`` (``dynamic=False``, as examples/generate.py does) are made
once and swapped in before each generate() call; each round times generate(N) and generate(1) for each backend (the
order alternates per round) and takes per-token = (t(N) - t(1)) / (N - 1). Then, per backend:

* host time of each compiled decode call (synchronised before, the wall time of the call alone), median;
* with ``--profile``, CUDA kernels launched per decode call and the top host ops (torch.profiler over one generate());
* the prefill's last-position logits against eager's (max |diff|) and eager's top-2 margin there, so that a
  differing first token can be told apart from a near-tie;
* whether anything recompiled while timing (dynamo's frame counter), which would void the rounds.

Every generate() gets ``disable_compile=True`` (examples/generate.py's ``generate_once``): on a GPU with a static
cache transformers otherwise compiles the forward itself (Inductor, reduce-overhead) around the swapped-in one, and
traced the per-call timer of the host column into that compile (2026-12-03 step 3: a recompile per call).

Both compiles are of the same frame, so dynamo's cache lookup of each call also checks the other backend's entries:
the table gives that lookup's host time per call (the profile's "TorchDynamo Cache Lookup") so the bias can be read.

    PYTHONPATH=/tmp/site:. python3 benchmarks/h200/forward_interleaved.py --contexts 4096,16384 --out $OUT
    PYTHONPATH=. python3 benchmarks/h200/forward_interleaved.py --device cpu --model tiny --contexts 16 --new 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from generate import example  # noqa: E402  (benchmarks/generate.py's loader of examples/generate.py)


_T0 = time.perf_counter()


def _log(what: str) -> None:
    """A timestamped progress line (the H200 steps of 2026-12-03 ran out of time without saying where)."""
    print(f"[{time.perf_counter() - _T0:6.0f} s] {what}", flush=True)


def _frames() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["frames"].values())


def kernels_and_host_ops(model, prompt, device: str, top: int = 12) -> dict:
    """torch.profiler over one generate() of 9 tokens: CUDA kernels per decode call and the top host ops."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    example.generate_once(model, prompt, 9, None)
    with profile(activities=activities) as prof:
        example.generate_once(model, prompt, 9, None)
        example._sync(device)
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    host = sorted(
        (e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
        key=lambda e: e.self_cpu_time_total,
        reverse=True,
    )
    lookup = sum(e.self_cpu_time_total for e in host if e.key == "TorchDynamo Cache Lookup") / 9
    return {
        "dynamo_cache_lookup_us_per_call": lookup,
        # 1 prefill + 8 decode calls; the prefill's kernels are counted in too (a per-call upper bound)
        "cuda_kernels_per_call": kernels / 9,
        "top_host_ops": [
            {"op": e.key[:90], "calls": e.count, "self_us_per_call": e.self_cpu_time_total / 9} for e in host[:top]
        ],
    }


def host_per_call(model, prompt, n: int, device: str) -> float:
    """Median host us of a compiled decode call (synchronised before each: its own wall time)."""
    compiled, calls = model.forward, []

    def wrapper(*a, **k):
        example._sync(device)
        t0 = time.perf_counter()
        out = compiled(*a, **k)
        calls.append(time.perf_counter() - t0)
        return out

    model.forward = wrapper
    try:
        example.generate_once(model, prompt, n, None)
    finally:
        model.forward = compiled
    return statistics.median(calls[2:]) * 1e6  # calls[0] is the prefill, calls[1] the first decode call


def prefill_logits(model, prompt) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=prompt).logits[:, -1].float()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--new", type=int, default=65, help="N of generate(N)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--backends", default="inductor,rubin")
    ap.add_argument("--model", default="qwen3-30b-a3b-8l")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (tiny model)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true", help="kernels per call and top host ops (torch.profiler)")
    args = ap.parse_args()
    import rubin_compile  # noqa: F401  (backend="rubin" from a checkout)

    torch._dynamo.config.cache_size_limit = 64
    backends = args.backends.split(",")
    contexts = [int(c) for c in args.contexts.split(",")]
    model = example.build_model(args.model, torch.bfloat16, args.device, max(contexts) + args.new + 8)
    eager_forward = model.forward
    rows = []
    for context in contexts:
        torch._dynamo.reset()
        g = torch.Generator().manual_seed(context)
        prompt = torch.randint(1, model.config.vocab_size, (1, context), generator=g).to(args.device)
        reference = prefill_logits(model, prompt)
        top2 = reference[0].topk(2).values
        compiled, ids, first_s = {}, {}, {}
        for b in backends:
            _log(f"context {context}: compiling and warming {b}")
            compiled[b] = torch.compile(eager_forward, backend=b, dynamic=False)
            model.forward = compiled[b]
            t0 = time.perf_counter()
            ids[b] = example.generate_once(model, prompt, args.new, None).cpu()
            example._sync(args.device)
            first_s[b] = time.perf_counter() - t0
            example.generate_once(model, prompt, 1, None)
        frames = _frames()
        _log(f"context {context}: {args.rounds} interleaved rounds")
        per_token = {b: [] for b in backends}
        for r in range(args.rounds):
            for b in backends if r % 2 == 0 else backends[::-1]:
                model.forward = compiled[b]
                _, t_n = example.timed(lambda: example.generate_once(model, prompt, args.new, None), args.device, 1)
                _, t_1 = example.timed(lambda: example.generate_once(model, prompt, 1, None), args.device, 1)
                per_token[b].append((t_n - t_1) / (args.new - 1) * 1e6)
        recompiled = _frames() - frames
        # printed before the per-backend extras below, which take longer (2026-12-03: the run ended before them)
        print(json.dumps({"context": context, "per_token_us_rounds": per_token, "recompiled": recompiled}), flush=True)
        for b in backends:
            _log(f"context {context}: logits, host per call{', profile' if args.profile else ''} of {b}")
            model.forward = compiled[b]
            logits = prefill_logits(model, prompt)
            diff = (logits - reference).abs().max().item()
            row = {
                "context": context,
                "backend": b,
                "per_token_us_median": statistics.median(per_token[b]),
                "per_token_us_rounds": [round(x) for x in per_token[b]],
                "host_per_call_us": host_per_call(model, prompt, 17, args.device),
                "first_generate_s": first_s[b],
                "recompiled_while_timing": recompiled,
                "prefill_logits_max_abs_diff_vs_eager": diff,
                "eager_top2_margin": (top2[0] - top2[1]).item(),
                "first_token_equal_eager": int(logits[0].argmax()) == int(reference[0].argmax()),
                "ids_equal_first_backend": bool(torch.equal(ids[b], ids[backends[0]])),
                # where they differ, and whether a near-tie (eager's logits of the two tokens, in bf16 steps)
                "divergence": example.divergence(model, ids[b], ids[backends[0]], context),
                **(kernels_and_host_ops(model, prompt, args.device) if args.profile else {}),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        model.forward = eager_forward
    lines = [
        f"generate() with model.forward compiled (dynamic=False, no CUDA graphs), {args.model}, batch 1, generate("
        f"{args.new}) and generate(1) per round, {args.rounds} interleaved rounds; "
        + (torch.cuda.get_device_name() if args.device == "cuda" else "cpu")
        + f", torch {torch.__version__}",
        "",
        "| context | backend | per-token us (median) | speed vs first | host per decode call us | of it dynamo cache "
        "lookup us | kernels per call | "
        "prefill logits max diff vs eager | eager top-2 margin | ids = first's | recompiled |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        first = next(x for x in rows if x["context"] == r["context"])
        lines.append(
            f"| {r['context']} | {r['backend']} | {r['per_token_us_median']:.0f} | "
            f"{first['per_token_us_median'] / r['per_token_us_median']:.2f}x | {r['host_per_call_us']:.0f} | "
            f"{r.get('dynamo_cache_lookup_us_per_call', float('nan')):.0f} | {r.get('cuda_kernels_per_call', float('nan')):.0f} | "
            f"{r['prefill_logits_max_abs_diff_vs_eager']:.3g} | "
            f"{r['eager_top2_margin']:.3g} | "
            f"{'yes' if r['ids_equal_first_backend'] else 'no ' + example.describe(r['divergence'])} | "
            f"{r['recompiled_while_timing']} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "forward-interleaved.md").write_text(text + "\n")
        Path(args.out, "forward-interleaved.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
