"""Issue 16: why generate() at 4k is host-bound under rubin (step 3: per token 2170 us against a ~560 us decode step;
Inductor 2316 us against ~1290). For each backend, generate()'s compiled decode step (compile_config,
mode="reduce-overhead"): Inductor's cudagraph skip counter and reasons, and the host time of one compiled decode
call (the wall time of the compiled call alone, synchronised, median), against the same call's GPU time."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from generate import example  # noqa: E402  (benchmarks/generate.py's loader of examples/generate.py)


def main() -> None:

    from torch._dynamo.utils import counters

    torch._logging.set_logs(cudagraphs=True, perf_hints=True)  # prints "skipping cudagraphs due to ..."

    model = example.build_model("qwen3-30b-a3b-8l", torch.bfloat16, "cuda", 4096 + 64 + 8)
    prompt = torch.randint(1, 4000, (1, 4096), device="cuda")
    for backend in ("inductor", "rubin"):
        torch._dynamo.reset()
        counters.clear()
        cfg = example.compile_config_setup(backend, "cuda")(model)
        example.generate_once(model, prompt, 16, cfg)
        torch.cuda.synchronize()
        skips = dict(counters["inductor"])
        calls: list[tuple[float, float]] = []

        # time every compiled decode call generate() makes: wrap the compiled callable transformers keeps
        get = model.get_compiled_call

        def timed_get(compile_config, _get=get):
            fn = _get(compile_config)

            def wrapper(*a, **k):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = fn(*a, **k)
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                calls.append((t1 - t0, time.perf_counter() - t0))
                return out

            return wrapper

        model.get_compiled_call = timed_get
        try:
            example.generate_once(model, prompt, 32, cfg)
        finally:
            del model.get_compiled_call
        host = statistics.median(c[0] for c in calls[2:]) * 1e6 if len(calls) > 2 else float("nan")
        total = statistics.median(c[1] for c in calls[2:]) * 1e6 if len(calls) > 2 else float("nan")
        print(
            f"{backend}: compiled decode calls {len(calls)}, host (call returns) {host:.0f} us, call + GPU {total:.0f} us; "
            f"inductor counters { ({k: v for k, v in skips.items() if 'cudagraph' in k or 'skip' in k}) }",
            flush=True,
        )


if __name__ == "__main__":
    main()
