"""Wall-clock timing for the CPU benchmarks (CPU ops are synchronous: no events needed)."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def median_ms(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    """Median wall-clock milliseconds of ``reps`` calls of ``fn`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3
