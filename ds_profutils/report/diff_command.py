"""``ds-profutils diff BASE NEW``: what it prints (stdout holds only the comparison; diagnostics go to stderr)."""
from __future__ import annotations

import argparse
import sys

from .build import ReportError
from .diff_build import build_diff
from .diff_text import render_diff
from .jsonout import report_json

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    """Print the comparison of ``args.base`` and ``args.new``; 1 when either holds no run."""
    try:
        diff = build_diff(args.base, args.new, args.top)
        if args.plot is not None:
            from .diff_plot import plot_diff  # matplotlib only when asked for

            plot_diff(diff, args.plot)
    except ReportError as exc:
        print(f"ds-profutils diff: {exc}", file=sys.stderr)
        return 1
    if args.json:
        sys.stdout.flush()
        sys.stdout.buffer.write(report_json(diff))
        sys.stdout.buffer.flush()
    else:
        print(render_diff(diff, args.ranks))
    if args.plot is not None:
        print(f"ds-profutils diff: plot written to {args.plot}", file=sys.stderr)
    return 0
