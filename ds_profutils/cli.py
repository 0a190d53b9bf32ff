"""The ``ds-profutils`` command (also ``python -m ds_profutils``).

Each subcommand is one ``_add_<name>`` function that registers its arguments here and names its
handler by module; the handler's module is imported only when that subcommand runs.  So ``report``,
``timeline`` and ``diff`` never load pydantic or hjson (``check-config``'s), and no subcommand loads torch or
DeepSpeed: the command starts in a fraction of a second.  Handlers return the exit code and print
user errors as plain lines on stderr: a traceback is for bugs, not for a bad file.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from .version import __version__

__all__ = ["EXIT_INVALID", "build_parser", "main"]

# argparse exits with 2 on a usage error; a config that fails the check is the same kind of mistake.
EXIT_INVALID = 2


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a world size of 0 has no ranks to check against)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; expected an integer >= 1")
    return value


def _handler(module: str) -> Callable[[argparse.Namespace], int]:
    """``module.run``, imported when the subcommand runs."""

    def handle(args: argparse.Namespace) -> int:
        return importlib.import_module(module, __package__).run(args)

    return handle


def _check_config(args: argparse.Namespace) -> int:
    from .config.command import check_files

    return 0 if check_files(args.paths, args.world_size) else EXIT_INVALID


def _add_check_config(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check-config",
        help="validate ds_config files and print the resolved profiling settings",
        description="Validate the ds_profutils sections of DeepSpeed config files (json or hjson, read as "
        "DeepSpeed reads them) with DS_PROFUTILS_* environment overrides applied, and print the resolved "
        "settings with defaults filled in. Also an error: a top-level key close to one of our section names "
        "(DeepSpeed ignores it, so the feature would be silently off), the fetch profiler with a ZeRO stage "
        "other than 3, an output_dir that cannot be created or written. Exits 0 when every file is valid, "
        f"{EXIT_INVALID} otherwise, with one line per problem.")
    parser.add_argument("paths", nargs="+", metavar="PATH", help="ds_config.json to check")
    parser.add_argument("--world-size", type=_positive_int, metavar="N",
                        help="also check that every configured rank exists in a job of N ranks")
    parser.set_defaults(handler=_check_config)


def _add_report(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report",
        help="merge a run's per-rank ZeRO-3 fetch records (and traces) into one report",
        description="Read the zero_fetch_*rank_*.jsonl files written by ds_profutils.attach (and any "
        "trace_rank_*.json) in DIR and print, per engine: which rank held the others back (the straggler), a "
        "per-step view of step time, waits and busy time per rank, and which fetches and collectives cost what. "
        "Names the ranks whose records or traces are missing or incomplete. Exits 1 when DIR has nothing to report.")
    parser.add_argument("directory", type=Path, metavar="DIR",
                        help="output_dir of the run (zero_fetch_*rank_*.jsonl, trace_rank_*.json)")
    parser.add_argument("--json", action="store_true", help="print every number as JSON instead of tables")
    parser.add_argument("--plot", type=Path, metavar="FILE.png",
                        help="also draw a rank x step heatmap and a per-rank breakdown (needs matplotlib)")
    parser.add_argument("--plot-metric", choices=("exposed_wait_ms", "busy_ms"), default="exposed_wait_ms",
                        help="what the heatmap shows (default: exposed_wait_ms)")
    parser.add_argument("--steps", type=_positive_int, default=20, metavar="N",
                        help="rows of the per-step table; with more steps, the N with the largest spread of wait")
    parser.add_argument("--ranks", type=_positive_int, default=8, metavar="N",
                        help="ranks listed per table; with more ranks, a summary and the N worst")
    parser.add_argument("--top", type=_positive_int, default=10, metavar="N", help="operations listed per trace")
    parser.set_defaults(handler=_handler(".report.command"))


def _add_timeline(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "timeline",
        help="merge the ranks' traces into one Chrome/Perfetto trace, one process per rank",
        description="Stream every trace_rank_*.json in DIR into one trace (open it in https://ui.perfetto.dev or "
        "chrome://tracing): one process per rank named 'rank r (host)', each trace placed by its own "
        "baseTimeNanoseconds; ranks on different hosts are aligned on the end of the last collective all of them "
        "recorded. Exits 1 when DIR has no trace.")
    parser.add_argument("directory", type=Path, metavar="DIR", help="output_dir of the run (trace_rank_*.json)")
    parser.add_argument("-o", "--output", type=Path, required=True, metavar="FILE.json", help="the merged trace")
    parser.set_defaults(handler=_handler(".timeline.command"))


def _add_diff(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "diff",
        help="what changed between two runs: step time beyond noise, where it went, the straggler before and after",
        description="Compare two runs' output_dirs engine by engine (matched by name): the step time per train step "
        "after warm-up and whether it changed beyond run-to-run noise (a test on effective steps that allows for drift "
        "between steps; the rule and its figures are printed), "
        "its parts (busy, fetch wait, blocking collective wait, memory peak) each with its own change, the whole "
        "iteration, TFLOP/s and MFU where recorded, per rank, a WARNING where the models differ in size, the "
        "report's straggler verdict of each run, the fetch events and collectives per step, the settings that "
        "differ, and, where both runs have traces, the operators whose self time changed most. Exits 1 when a "
        "directory holds no run.")
    parser.add_argument("base", metavar="BASE", help="output_dir of the run compared against; several reruns: "
                        "A1,A2,A3 or @FILE listing one per line (the test then allows for the spread between reruns)")
    parser.add_argument("new", metavar="NEW", help="output_dir of the run that changed (one, A1,A2,A3 or @FILE)")
    parser.add_argument("--json", action="store_true", help="print every number as JSON instead of tables")
    parser.add_argument("--plot", type=Path, metavar="FILE.png",
                        help="also draw both runs' step times per step and the parts side by side (needs matplotlib)")
    parser.add_argument("--ranks", type=_positive_int, default=8, metavar="N",
                        help="ranks listed per engine; with more ranks, the N whose figures changed most")
    parser.add_argument("--top", type=_positive_int, default=10, metavar="N", help="operators listed from the traces")
    parser.set_defaults(handler=_handler(".diff.command"))


def _capture_ranks(text: str) -> object:
    """``capture --ranks``: "all", "suspects" or comma-separated global ranks such as ``0,3`` (0..51: a list
    travels in the live exchange as a bit mask)."""
    from .config.models import MAX_LISTED_RANK

    word = text.strip().lower()
    if word in ("all", "suspects"):
        return word
    try:
        ranks = sorted({int(part) for part in word.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected all, suspects or ranks such as 0,3; got {text!r}") from None
    if not ranks or ranks[0] < 0 or ranks[-1] > MAX_LISTED_RANK:
        raise argparse.ArgumentTypeError(f"ranks 0..{MAX_LISTED_RANK}, got {text!r}")
    return ranks


def _add_capture(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "capture",
        help="ask a running job for a torch trace of its next steps on the ranks that matter",
        description="Write capture_request.json into OUTPUT_DIR, the trace_capture output_dir of a running job "
        "(docs/capture.md). Its rank 0 takes it at the next live interval; every chosen rank traces the same steps "
        "into OUTPUT_DIR/capture_S/. With --wait, waits for the capture and prints its folder and the timeline "
        "command for it; exits 1 when no job took the request in time, or the job refused it (the reason is said).")
    parser.add_argument("output_dir", type=Path, metavar="OUTPUT_DIR", help="the job's trace_capture output_dir")
    parser.add_argument("--steps", type=_positive_int, default=2, metavar="N", help="optimizer steps to trace")
    parser.add_argument("--ranks", type=_capture_ranks, default="suspects", metavar="all|suspects|0,3",
                        help="which ranks trace (suspects: the straggler or slowest rank, the rank that waited most, "
                        "a median rank)")
    parser.add_argument("--wait", type=float, metavar="SECONDS", help="wait this long for the capture to be written")
    parser.set_defaults(handler=_handler(".report.captures.command"))


_SUBCOMMANDS: Sequence[Callable[[argparse._SubParsersAction], None]] = (_add_check_config, _add_report, _add_timeline,
                                                                         _add_diff, _add_capture)


def build_parser() -> argparse.ArgumentParser:
    """The ``ds-profutils`` argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="ds-profutils",
                                     description="Tools for profiling DeepSpeed training with ds_profutils.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_subcommand in _SUBCOMMANDS:
        add_subcommand(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``ds-profutils``: run one subcommand and return its exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except BrokenPipeError:  # ``ds-profutils report DIR | head``: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 1
