"""``ds-profutils diff BASE NEW`` (each a run directory, ``A1,A2,A3`` or ``@FILE``): what it prints (stdout holds only the comparison; diagnostics go to stderr)."""
from __future__ import annotations

import argparse
from typing import Any, Mapping

from ..report.command import emit
from .build import build_diff
from .sides import run_directories
from .text import render_diff

__all__ = ["run"]


def _plot(diff: Mapping[str, Any], args: argparse.Namespace) -> None:
    from .plot import plot_diff  # matplotlib only when asked for

    plot_diff(diff, args.plot)


def run(args: argparse.Namespace) -> int:
    """Print the comparison of ``args.base`` and ``args.new``; 1 when either holds no run."""
    return emit("diff", args, lambda: build_diff(run_directories(str(args.base)), run_directories(str(args.new)),
                                                 args.top),
                lambda diff: render_diff(diff, args.ranks), lambda diff: _plot(diff, args))
