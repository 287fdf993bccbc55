"""Command line: ``python -m rubin_compile explain DIR``."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from rubin_compile.debug.explain import ExplainError, explain


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rubin_compile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("explain", help="print, per dumped graph, what each pass matched and why")
    ex.add_argument("dump_dir", help="the folder given as RUBIN_DUMP_DIR or options['dump_dir']")
    ex.add_argument("--changed", action="store_true", help="only graphs and passes with rewrites or near-misses")
    ex.add_argument("--graph", help="only this graph id (a folder name under DUMP_DIR)")
    args = parser.parse_args(argv)
    try:
        explain(args.dump_dir, sys.stdout, only_changed=args.changed, graph=args.graph)
    except ExplainError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
