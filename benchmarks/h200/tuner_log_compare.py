"""Per (shape, format, T) entry of tune_moe's detail log (``--log``): the best time of the candidates whose description
matches a pattern against the best of the others, both from the same run, and the winner.

    python3 benchmarks/h200/tuner_log_compare.py PATTERN LABEL OTHER_LABEL DETAIL_LOG [DETAIL_LOG ...]

e.g. ``"/gemv" GEMV MMA`` (the reduction form's candidates) or ``"^fused" fused other`` (the fused decode path's)."""

from __future__ import annotations

import re
import sys


def main(argv: list[str]) -> None:
    pattern, label, other_label, *paths = argv
    match = re.compile(pattern)
    print(
        f"{'entry':34s} {'best ' + other_label + ' us':>13s} {'best ' + label + ' us':>13s} "
        f"{other_label + '/' + label:>11s}  winner"
    )
    for path in paths:
        times = []
        for line in open(path):
            m = re.match(r"\s+([\d.]+) us  (.*)", line)
            if m:
                times.append((float(m.group(1)), m.group(2)))
                continue
            m = re.match(r"(\S+)\s+(\S+)\s+T=\s*(\d+): best", line)
            if m and times:
                other = min((t for t, d in times if not match.search(d)), default=float("nan"))
                this = min((t for t, d in times if match.search(d)), default=float("nan"))
                entry = f"{m.group(1)} {m.group(2)} T={m.group(3)}"
                print(f"{entry:34s} {other:13.1f} {this:13.1f} {other / this:11.2f}  {min(times)[1]}")
                times = []


if __name__ == "__main__":
    main(sys.argv[1:])
