"""The ``ds-profutils`` command (also ``python -m ds_profutils``).

Each subcommand is one ``_add_<name>`` function that registers its parser and sets ``handler``, plus
the handler itself; ``main`` knows nothing about them beyond ``_SUBCOMMANDS``.  Handlers return the
exit code and print user errors as plain lines: a traceback is for bugs, not for a bad config file.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, List, Mapping, Optional, Sequence

from .config import (DEEPSPEED_APPLIED_KEYS, ConfigError, ConfigProblem, ProfUtilsConfig, check_ranks,
                     environment_overrides, load_config, raw_settings)

__all__ = ["EXIT_INVALID", "build_parser", "main"]

# argparse exits with 2 on a usage error; a config that fails the check is the same kind of mistake.
EXIT_INVALID = 2


def _render(settings: Mapping[str, Any], indent: str = "") -> List[str]:
    """Settings as indented ``key: value`` lines, values spelled as in JSON (true, null, "text")."""
    lines = []
    for key, value in settings.items():
        if isinstance(value, Mapping) and value:
            lines.append(f"{indent}{key}:")
            lines.extend(_render(value, indent + "  "))
        else:
            lines.append(f"{indent}{key}: {json.dumps(value)}")
    return lines


def _rank_problems(config: ProfUtilsConfig, world_size: int) -> List[ConfigProblem]:
    """Every configured rank list checked against the job's world size, as the features do at run time."""
    problems: List[ConfigProblem] = []
    for key, ranks in (("profiler.ranks", config.profiler.ranks),
                       ("profiler.summary_ranks", config.profiler.summary_ranks),
                       ("partitioned_param_profiler.ranks", config.partitioned_param_profiler.ranks)):
        try:
            check_ranks(key, ranks, world_size)
        except ConfigError as exc:
            problems.extend(exc.problems)
    return problems


def _check_config(args: argparse.Namespace) -> int:
    exit_code = 0
    overrides = environment_overrides()
    for path in args.paths:
        try:
            config = load_config(path)
            if args.world_size is not None:
                problems = _rank_problems(config, args.world_size)
                if problems:
                    raise ConfigError(problems, path)
        except ConfigError as exc:
            print("\n".join(exc.lines()), file=sys.stderr)
            exit_code = EXIT_INVALID
            continue
        print(f"{path}: valid; resolved ds_profutils settings:")
        if overrides:
            print("  (with environment overrides "
                  f"{', '.join(f'{name}={value}' for name, value in sorted(overrides.items()))})")
        print("\n".join(_render(config.model_dump(), "  ")))
        raw, _ = raw_settings(path)
        theirs = {key: raw[key] for key in DEEPSPEED_APPLIED_KEYS if key in raw}
        if theirs:
            print("applied by DeepSpeed, not read by ds_profutils:")
            print("\n".join(_render(theirs, "  ")))
    return exit_code


def _add_check_config(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check-config",
        help="validate ds_config files and print the resolved profiling settings",
        description="Validate the ds_profutils sections of DeepSpeed config files (json or hjson, read as "
        "DeepSpeed reads them) with DS_PROFUTILS_* environment overrides applied, and print the resolved "
        f"settings with defaults filled in. Exits 0 when every file is valid, {EXIT_INVALID} otherwise, "
        "with one line per problem.")
    parser.add_argument("paths", nargs="+", metavar="PATH", help="ds_config.json to check")
    parser.add_argument("--world-size", type=int, metavar="N",
                        help="also check that every configured rank exists in a job of N ranks")
    parser.set_defaults(handler=_check_config)


def _add_report(subparsers: argparse._SubParsersAction) -> None:
    from .report import command

    parser = subparsers.add_parser(
        "report",
        help="merge a run's per-rank ZeRO-3 fetch records (and traces) into one report",
        description="Read the zero_fetch_rank_*.jsonl files written by ds_profutils.attach (and any "
        "trace_rank_*.json) in DIR and print per-event, per-rank and per-step tables: which fetches cost what, "
        "on which rank, and how much of each step waits for them. Exits 1 when DIR has nothing to report.")
    command.add_arguments(parser)
    parser.set_defaults(handler=command.run)


_SUBCOMMANDS: Sequence[Callable[[argparse._SubParsersAction], None]] = (_add_check_config, _add_report)


def build_parser() -> argparse.ArgumentParser:
    """The ``ds-profutils`` argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="ds-profutils",
                                     description="Tools for profiling DeepSpeed training with ds_profutils.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_subcommand in _SUBCOMMANDS:
        add_subcommand(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``ds-profutils``: run one subcommand and return its exit code."""
    args = build_parser().parse_args(argv)
    return args.handler(args)
