"""The device time of each kernel in a CUDA graph, from torch.profiler over its replays: what the diagnostic
benchmarks (route_profile.py, decode_attention_probe.py) report beside their graph timings."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def capture(fns: list[Callable[[], object]], calls: int) -> torch.cuda.CUDAGraph:
    """``calls`` calls of ``fns`` (in turn), each run once first (compiled and warmed outside the capture), captured
    in one CUDA graph."""
    order = [fns[i % len(fns)] for i in range(calls)]
    for fn in order:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in order:
            fn()
    return graph


def per_kernel(fns: list[Callable[[], object]], calls: int, reps: int = 10) -> dict[str, dict[str, float]]:
    """For ``calls`` calls of ``fns`` (in turn) captured in one graph and replayed ``reps`` times under the profiler:
    per kernel name (its first 40 characters, arguments cut), the median device us of a launch and the launches per
    call."""
    graph = capture(fns, calls)
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            times.setdefault(ev.name.split("(")[0][:40], []).append(ev.time_range.elapsed_us())
    return {k: {"us": statistics.median(v), "per_call": len(v) / (reps * calls)} for k, v in times.items()}
