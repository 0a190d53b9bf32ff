"""``ds-profutils report DIR``: what it prints (stdout holds only the report; diagnostics go to stderr)."""
from __future__ import annotations

import argparse
import sys

from .build import ReportError, build_report
from .jsonout import report_json
from .text import render_text

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    """Print the report of ``args.directory``; 1 when there is nothing to report on."""
    try:
        report = build_report(args.directory, args.top)
        if args.plot is not None:
            from .plot import plot_report  # matplotlib only when asked for

            plot_report(report, args.plot, args.plot_metric)
    except ReportError as exc:
        print(f"ds-profutils report: {exc}", file=sys.stderr)
        return 1
    if args.json:
        sys.stdout.flush()
        sys.stdout.buffer.write(report_json(report))
        sys.stdout.buffer.flush()
    else:
        print(render_text(report, args.steps, args.ranks))
    if args.plot is not None:
        print(f"ds-profutils report: plot written to {args.plot}", file=sys.stderr)
    return 0
