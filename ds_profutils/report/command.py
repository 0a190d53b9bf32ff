"""The ``ds-profutils report`` subcommand: arguments and what it prints."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .build import ReportError, build_report
from .plot import plot_report
from .text import render_text

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``report`` subcommand's arguments."""
    parser.add_argument("directory", type=Path, metavar="DIR",
                        help="output_dir of the run (zero_fetch_*rank_*.jsonl, trace_rank_*.json)")
    parser.add_argument("--json", action="store_true", help="print every number as JSON instead of tables")
    parser.add_argument("--plot", type=Path, metavar="FILE.png",
                        help="also plot fetch-wait and all-gather time per step and rank (needs matplotlib)")
    parser.add_argument("--steps", type=int, default=20, metavar="N",
                        help="rows of the per-step table; with more steps, the N with the largest fetch-wait")
    parser.add_argument("--top", type=int, default=10, metavar="N", help="operations listed per trace")


def run(args: argparse.Namespace) -> int:
    """Print the report of ``args.directory``; 1 when there is nothing to report on."""
    try:
        report = build_report(args.directory, args.top)
        if args.plot is not None:
            plot_report(report, args.plot)
    except ReportError as exc:
        print(f"ds-profutils report: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=1) if args.json else render_text(report, args.steps))
    if args.plot is not None and not args.json:
        print(f"\nplot written to {args.plot}")
    return 0
