"""``ds-profutils report DIR``: what it prints (stdout holds only the report; diagnostics go to stderr).

With ``--json``, the report as one JSON document, written by orjson.  The step views stay in their arrays until
written: each rank's row becomes a list only while it is serialized, so the output of 1024 ranks x 1000 steps
never exists as Python objects all at once.  NaN (a rank without a record of a step) is written as null.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import PurePath
from typing import Any, Callable, Mapping

import orjson

from .build import ReportError, build_report
from .captures import capture_lines, read_captures
from .steps import Matrix, StepView
from .text import render_text

__all__ = ["emit", "report_json", "run"]


def _default(value: Any) -> Any:
    """orjson's hook for what it cannot write itself; it calls it again on what this returns."""
    if isinstance(value, StepView):
        return {"layout": "each column is a list per rank (in 'ranks' order) of values per global step (in "
                          "'global_steps' order); null: no record", "global_steps": value.global_steps,
                "ranks": value.ranks, **value.columns(), "straggler": value.straggler, "spread_ms": value.spread_ms,
                "threshold_ms": value.threshold_ms}
    if isinstance(value, Matrix):
        return value.rows()
    if isinstance(value, memoryview):
        return value.tolist()
    if isinstance(value, PurePath):  # a capture's folder
        return str(value)
    raise TypeError(f"{type(value).__name__} is not part of a report")


def report_json(report: Mapping[str, Any]) -> bytes:
    """The whole report as JSON bytes (one line, newline-terminated; integer keys as strings)."""
    return orjson.dumps(report, default=_default, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_APPEND_NEWLINE
                        | orjson.OPT_PASSTHROUGH_DATACLASS)


def emit(command: str, args: argparse.Namespace, build: Callable[[], Mapping[str, Any]],
         render: Callable[[Mapping[str, Any]], str], plot: Callable[[Mapping[str, Any]], None]) -> int:
    """Build, plot when ``args.plot`` asks, then print the text or (``args.json``) the JSON; a
    :class:`.build.ReportError` is one line on stderr and exit status 1."""
    try:
        data = build()
        if args.plot is not None:
            plot(data)
    except ReportError as exc:
        print(f"ds-profutils {command}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        sys.stdout.flush()
        sys.stdout.buffer.write(report_json(data))
        sys.stdout.buffer.flush()
    else:
        print(render(data))
    if args.plot is not None:
        print(f"ds-profutils {command}: plot written to {args.plot}", file=sys.stderr)
    return 0


def _plot(report: Mapping[str, Any], args: argparse.Namespace) -> None:
    from .plot import plot_report  # matplotlib only when asked for

    plot_report(report, args.plot, args.plot_metric)


def _build(args: argparse.Namespace) -> Mapping[str, Any]:
    """The report with the trace captures (docs/capture.md) listed where there are any (``captures``);
    captures alone make a report too."""
    captures = read_captures(args.directory)  # each folder a Path: a string in the JSON
    try:
        report = build_report(args.directory, args.top)
    except ReportError:
        if not captures:
            raise
        report = {"captures_only": True}
    return {**report, "captures": captures} if captures else report


def _render(report: Mapping[str, Any], args: argparse.Namespace) -> str:
    lines = capture_lines(report.get("captures", []))
    text = "" if report.get("captures_only") else render_text(report, args.steps, args.ranks)
    return "\n\n".join(part for part in (text, "\n".join(lines)) if part)


def run(args: argparse.Namespace) -> int:
    """Print the report of ``args.directory``; 1 when there is nothing to report on."""
    return emit("report", args, lambda: _build(args), lambda report: _render(report, args),
                lambda report: _plot(report, args))
