"""``ds-profutils report DIR``: one view of a run's per-rank ZeRO-3 fetch records (and its traces).

It answers "which fetches cost what, on which rank, and do they overlap with compute":

* per event, totals per rank with the time's spread across ranks and the slowest rank;
* per rank, the median fetch-wait per step and the share of step time spent waiting for fetches
  (0 % means every fetch was hidden behind compute); a rank whose median fetch-wait is over
  ``STRAGGLER_FACTOR`` times the median of all ranks is flagged as a straggler;
* per step, the fetch-wait spread across ranks;
* for each ``trace_rank_*.json`` beside the records, its step times and top operations.

Files are read once, line by line, keeping running totals per event and four numbers per step, so a
gigabyte of records takes seconds.  A truncated last line (a killed job), a bad line, a missing rank
and an empty directory are reported in the output, not raised.  This module needs only the standard
library; matplotlib is imported only for ``--plot``.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import re
import sys
from array import array
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from .trace_summary import TraceFormatError, summarize_trace

__all__ = [
    "RECORD_FILE", "TRACE_FILE", "STRAGGLER_FACTOR", "ReportError", "add_arguments", "build_report", "plot_report",
    "render_text", "run"
]

RECORD_FILE = "zero_fetch_rank_{rank}.jsonl"
"""Per-rank fetch records, named by global rank; ``attach`` writes them."""
TRACE_FILE = "trace_rank_{rank}.json"
"""Per-rank Chrome traces the profiler decorator writes; summarised when present."""
STRAGGLER_FACTOR = 1.5

FETCH_WAIT_EVENTS = ("forward_fetch_wait", "backward_fetch_wait")
ALL_GATHER_EVENTS = ("forward_all_gather", "backward_all_gather")
_PROBLEMS_SHOWN = 5  # per file; the rest are counted
_PARALLEL_BYTES = 64 * 2**20  # below this, starting processes costs more than it saves


class ReportError(ValueError):
    """There is nothing to report on (no directory, or no records and no traces in it)."""


@dataclass
class _EventTotals:
    """One event's totals on one rank, over every record of one mode."""

    unit: Optional[str]
    count: int = 0
    numel: int = 0
    bytes: Optional[int] = 0
    time_ms: float = 0.0
    min_ms: float = math.inf
    max_ms: float = 0.0


@dataclass
class _RankRecords:
    """What one rank's file says: event totals per (mode, event) and, per train step, four numbers."""

    rank: int
    hosts: Set[str] = field(default_factory=set)
    world_size: int = 0
    recording_ranks: Optional[Tuple[int, ...]] = None  # the run's "ranks" setting; None: every rank
    modes: Dict[str, int] = field(default_factory=dict)
    events: Dict[Tuple[str, str], _EventTotals] = field(default_factory=dict)
    steps: array = field(default_factory=lambda: array("q"))
    global_steps: array = field(default_factory=lambda: array("q"))
    fetch_wait_ms: array = field(default_factory=lambda: array("d"))
    all_gather_ms: array = field(default_factory=lambda: array("d"))
    step_ms: array = field(default_factory=lambda: array("d"))
    problems: List[str] = field(default_factory=list)
    problem_count: int = 0

    def _time_columns(self) -> Tuple[array, ...]:
        return self.step_ms, self.fetch_wait_ms, self.all_gather_ms

    def problem(self, message: str) -> None:
        self.problem_count += 1
        if len(self.problems) < _PROBLEMS_SHOWN:
            self.problems.append(message)

    def add(self, record: Mapping[str, Any]) -> None:
        """Fold one record in; one that is not a fetch record raises (KeyError, TypeError, ValueError,
        AttributeError) before anything changes."""
        mode = str(record.get("mode", "train"))
        events = record["events"]
        staged = [(name, int(entry["count"]), int(entry["numel"]), _optional_int(entry.get("bytes")),
                   float(entry["time_ms"]), float(entry["min_ms"]), float(entry["max_ms"]), entry.get("numel_unit"))
                  for name, entry in events.items()]
        world_size = int(record.get("world_size", 0))
        recording_ranks = record.get("recording_ranks")
        recording_ranks = None if recording_ranks is None else tuple(int(rank) for rank in recording_ranks)
        if mode == "train":
            step, global_step = int(record["step"]), int(record["global_step"])
            times = (float(record["step_time_ms"]), _time_of(events, FETCH_WAIT_EVENTS),
                     _time_of(events, ALL_GATHER_EVENTS))
            if self.steps and self.steps[-1] == step:  # another forward before step(): the same step
                for column, value in zip(self._time_columns(), times):
                    column[-1] += value
            else:
                self.steps.append(step)
                self.global_steps.append(global_step)
                for column, value in zip(self._time_columns(), times):
                    column.append(value)
        self.recording_ranks = recording_ranks
        self.modes[mode] = self.modes.get(mode, 0) + 1
        self.hosts.add(str(record.get("host", "?")))
        self.world_size = max(self.world_size, world_size)
        for name, count, numel, nbytes, time_ms, min_ms, max_ms, unit in staged:
            totals = self.events.get((mode, name))
            if totals is None:
                totals = self.events[(mode, name)] = _EventTotals(unit)
            totals.count += count
            totals.numel += numel
            totals.bytes = None if nbytes is None or totals.bytes is None else totals.bytes + nbytes
            totals.time_ms += time_ms
            if min_ms < totals.min_ms:
                totals.min_ms = min_ms
            if max_ms > totals.max_ms:
                totals.max_ms = max_ms


def _optional_int(value: Any) -> Optional[int]:
    return None if value is None else int(value)


def _time_of(events: Mapping[str, Any], names: Sequence[str]) -> float:
    """Summed time_ms of those of ``names`` that occurred in a record."""
    total = 0.0
    for name in names:
        entry = events.get(name)
        if entry is not None:
            total += float(entry["time_ms"])
    return total


def _read_records(path: Path, rank: int) -> _RankRecords:
    records = _RankRecords(rank)
    with open(path, "rb") as source:
        for number, line in enumerate(source, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                what = "not JSON" if line.endswith(b"\n") else "incomplete last line (job stopped mid-write?)"
                records.problem(f"line {number}: {what}, skipped")
                continue
            try:
                records.add(record)
            except (KeyError, TypeError, ValueError, AttributeError):
                records.problem(f"line {number}: not a fetch record, skipped")
    return records


def _read_all(files: Mapping[int, Path]) -> List[_RankRecords]:
    """Every rank's file, in parallel processes when there is enough to read: JSON parsing is the bottleneck."""
    workers = min(len(files), os.cpu_count() or 1)
    if (workers < 2 or "fork" not in multiprocessing.get_all_start_methods()
            or sum(path.stat().st_size for path in files.values()) < _PARALLEL_BYTES):
        return [_read_records(path, rank) for rank, path in files.items()]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_read_records, files.values(), files.keys()))


def _rank_files(directory: Path, pattern: str) -> Dict[int, Path]:
    """``{rank: path}`` of the files in ``directory`` named by ``pattern`` (a ``{rank}`` template)."""
    prefix, suffix = pattern.split("{rank}")
    name = re.compile(re.escape(prefix) + r"(\d+)" + re.escape(suffix) + "$")
    found = {}
    for path in directory.iterdir():
        match = name.match(path.name)
        if match:
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def _spread(values: Mapping[int, float]) -> Dict[str, Any]:
    """min / median / max of per-rank values, and the rank with the largest."""
    ordered = list(values.values())
    return {
        "min": min(ordered),
        "median": median(ordered),
        "max": max(ordered),
        "slowest_rank": max(values, key=values.__getitem__),
    }


def _median_total(values: Iterable[int]) -> float:
    """Median of per-rank totals, kept an integer when it is one (ranks usually agree)."""
    middle = median(values)
    return int(middle) if middle == int(middle) else middle


def _event_tables(ranks: Sequence[_RankRecords]) -> Dict[str, Dict[str, Any]]:
    tables: Dict[str, Dict[str, Any]] = {}
    for records in ranks:
        for (mode, name), totals in records.events.items():
            tables.setdefault(mode, {}).setdefault(name, {})[records.rank] = totals
    report: Dict[str, Dict[str, Any]] = {}
    for mode, events in sorted(tables.items(), key=lambda item: item[0] != "train"):
        report[mode] = {}
        for name, per_rank in sorted(events.items()):
            totals = list(per_rank.values())
            report[mode][name] = {
                "numel_unit": totals[0].unit,
                "count": _median_total(t.count for t in totals),
                "numel": _median_total(t.numel for t in totals),
                "bytes": None if any(t.bytes is None for t in totals) else _median_total(t.bytes for t in totals),
                "time_ms": _spread({rank: t.time_ms for rank, t in per_rank.items()}),
                "per_rank": {
                    rank: {
                        "count": t.count,
                        "numel": t.numel,
                        "bytes": t.bytes,
                        "time_ms": t.time_ms,
                        "min_ms": t.min_ms,
                        "max_ms": t.max_ms
                    }
                    for rank, t in per_rank.items()
                },
            }
    return report


def _rank_table(ranks: Sequence[_RankRecords]) -> Dict[int, Dict[str, Any]]:
    table = {}
    for records in ranks:
        steps = len(records.steps)
        total_step_ms = sum(records.step_ms)
        table[records.rank] = {
            "hosts": sorted(records.hosts),
            "records": dict(records.modes),
            "steps": steps,
            "fetch_wait_ms_median": median(records.fetch_wait_ms) if steps else None,
            "step_ms_median": median(records.step_ms) if steps else None,
            "fetch_wait_share": sum(records.fetch_wait_ms) / total_step_ms if total_step_ms > 0 else None,
            "straggler": False,
        }
    medians = [row["fetch_wait_ms_median"] for row in table.values() if row["fetch_wait_ms_median"] is not None]
    if medians:
        threshold = STRAGGLER_FACTOR * median(medians)
        for row in table.values():
            wait = row["fetch_wait_ms_median"]
            row["straggler"] = wait is not None and threshold > 0 and wait > threshold
    return table


def _step_table(ranks: Sequence[_RankRecords]) -> List[Dict[str, Any]]:
    by_step: Dict[int, Dict[str, Any]] = {}
    for records in ranks:
        rank = records.rank
        for step, global_step, wait, gather, step_ms in zip(records.steps, records.global_steps,
                                                            records.fetch_wait_ms, records.all_gather_ms,
                                                            records.step_ms):
            row = by_step.get(step)
            if row is None:
                row = by_step[step] = {
                    "step": step,
                    "global_step": global_step,
                    "fetch_wait_ms": {},
                    "all_gather_ms": {},
                    "step_ms": {}
                }
            row["fetch_wait_ms"][rank] = wait
            row["all_gather_ms"][rank] = gather
            row["step_ms"][rank] = step_ms
    rows = [by_step[step] for step in sorted(by_step)]
    for row in rows:
        row["fetch_wait_spread"] = _spread(row["fetch_wait_ms"])
        shares = [
            wait / row["step_ms"][rank] for rank, wait in row["fetch_wait_ms"].items() if row["step_ms"][rank] > 0
        ]
        row["fetch_wait_share_max"] = max(shares) if shares else None
    return rows


def build_report(directory: Path, top_ops: int = 10) -> Dict[str, Any]:
    """Every number the report shows, as plain data (what ``--json`` prints)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ReportError(f"{directory}: no such directory")
    record_files = _rank_files(directory, RECORD_FILE)
    trace_files = _rank_files(directory, TRACE_FILE)
    if not record_files and not trace_files:
        raise ReportError(f"{directory}: no ZeRO-3 fetch records ({RECORD_FILE.format(rank='*')}) and no traces "
                          f"({TRACE_FILE.format(rank='*')}); is \"partitioned_param_profiler\" enabled with this "
                          "output_dir, and did ds_profutils.attach(engine) run?")
    ranks = _read_all(record_files)
    with_records = [records for records in ranks if records.modes]
    world = max([records.world_size for records in ranks] + [max(record_files, default=-1) + 1])
    # Ranks left out by the run's "ranks" setting are not missing; without it, every rank records.
    recording = next((records.recording_ranks for records in with_records if records.recording_ranks is not None),
                     range(world))
    problems = {records.rank: {"count": records.problem_count, "first": records.problems} for records in ranks
                if records.problem_count}
    traces: Dict[int, Any] = {}
    for rank, path in trace_files.items():
        try:
            traces[rank] = summarize_trace(path, top_ops)
        except (OSError, TraceFormatError) as exc:
            problems.setdefault(rank, {"count": 0, "first": []})
            problems[rank]["count"] += 1
            problems[rank]["first"].append(f"{path.name}: {exc}")
    return {
        "directory": str(directory),
        "world_size": world if record_files else None,
        "ranks": [records.rank for records in with_records],
        "missing_ranks": sorted(set(recording) - {records.rank for records in with_records}) if record_files else [],
        "problems": problems,
        "events": _event_tables(with_records),
        "ranks_summary": _rank_table(with_records),
        "steps": _step_table(with_records),
        "traces": traces,
    }


# ---------------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------------


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> List[str]:
    """Left-aligned first column, right-aligned others, two spaces apart."""
    cells = [list(headers)] + [[_cell(value) for value in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return [
        "  ".join(text.ljust(width) if i == 0 else text.rjust(width)
                  for i, (text, width) in enumerate(zip(row, widths))).rstrip() for row in cells
    ]


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if value < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _percent(share: Optional[float]) -> Optional[str]:
    return None if share is None else f"{100 * share:.1f}%"


def _ranks_text(ranks: Iterable[int]) -> str:
    return ", ".join(str(rank) for rank in ranks) or "none"


def _steps_shown(steps: List[Dict[str, Any]], limit: int) -> Tuple[List[Dict[str, Any]], str]:
    if len(steps) <= limit:
        return steps, ""
    slowest = sorted(steps, key=lambda row: row["fetch_wait_spread"]["max"], reverse=True)[:limit]
    return sorted(slowest, key=lambda row: row["step"]), f" ({limit} of {len(steps)} steps: the largest fetch-wait)"


def render_text(report: Mapping[str, Any], max_steps: int = 20) -> str:
    """The report as aligned text tables, at most ``max_steps`` rows in the per-step table."""
    lines = [f"ZeRO-3 fetch report: {report['directory']}"]
    if report["world_size"] is not None:
        lines.append(f"ranks with records: {_ranks_text(report['ranks'])} of {report['world_size']}")
        if report["missing_ranks"]:
            lines.append(f"MISSING ranks (no file or no complete record): {_ranks_text(report['missing_ranks'])}")
    for rank, found in sorted(report["problems"].items()):
        extra = found["count"] - len(found["first"])
        lines.extend(f"rank {rank}: {message}" for message in found["first"])
        if extra > 0:
            lines.append(f"rank {rank}: ... and {extra} more problems")

    for mode, events in report["events"].items():
        lines += ["", f"Events ({mode} records; totals per rank; numel as DeepSpeed counts it: shard or full):"]
        lines += _table(("event", "numel unit", "count", "numel", "bytes", "time ms min", "median", "max", "slowest"),
                        [(name, row["numel_unit"], row["count"], row["numel"], row["bytes"], row["time_ms"]["min"],
                          row["time_ms"]["median"], row["time_ms"]["max"], f"rank {row['time_ms']['slowest_rank']}")
                         for name, row in events.items()])

    summary = report["ranks_summary"]
    if report["steps"]:
        lines += ["", "Ranks (train steps; share = time waiting for fetches / step time; 0% = fully overlapped):"]
        lines += _table(("rank", "hosts", "steps", "fetch-wait ms/step (median)", "step ms (median)", "share", ""),
                        [(rank, ",".join(row["hosts"]), row["steps"], row["fetch_wait_ms_median"],
                          row["step_ms_median"], _percent(row["fetch_wait_share"]),
                          f"STRAGGLER (>{STRAGGLER_FACTOR}x the median of all ranks)" if row["straggler"] else "")
                         for rank, row in summary.items()])
        shown, note = _steps_shown(report["steps"], max_steps)
        lines += ["", f"Steps (fetch-wait ms across ranks){note}:"]
        lines += _table(("step", "global step", "fetch-wait min", "median", "max", "slowest", "max share"),
                        [(row["step"], row["global_step"], row["fetch_wait_spread"]["min"],
                          row["fetch_wait_spread"]["median"], row["fetch_wait_spread"]["max"],
                          f"rank {row['fetch_wait_spread']['slowest_rank']}", _percent(row["fetch_wait_share_max"]))
                         for row in shown])
    elif report["world_size"] is not None:
        lines += ["", "No train steps recorded."]

    for rank, trace in sorted(report["traces"].items()):
        step_ms = trace["step_ms"]
        steps = (f"{len(trace['steps'])} profiler steps, step ms median {step_ms['median']:.3f}, "
                 f"max {step_ms['max']:.3f}" if step_ms else "no ProfilerStep# events")
        lines += ["", f"Trace of rank {rank} ({Path(trace['file']).name}, {trace['events']:,} events): {steps}"]
        lines += _table(("top ops by total time", "category", "count", "total ms"),
                        [(op["name"], op["cat"], op["count"], op["total_ms"]) for op in trace["top_ops"]])
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------------------------------


def plot_report(report: Mapping[str, Any], path: Path) -> None:
    """Fetch-wait and all-gather time per step, one line per rank, as a PNG at ``path``."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise ReportError("--plot needs matplotlib: pip install 'ds-profutils[plot]'") from None
    figure = Figure(figsize=(10, 6), layout="constrained")
    wait_axes, gather_axes = figure.subplots(2, 1, sharex=True)
    for rank in report["ranks_summary"]:
        rows = [row for row in report["steps"] if rank in row["fetch_wait_ms"]]
        steps = [row["step"] for row in rows]
        wait_axes.plot(steps, [row["fetch_wait_ms"][rank] for row in rows], label=f"rank {rank}")
        gather_axes.plot(steps, [row["all_gather_ms"][rank] for row in rows], label=f"rank {rank}")
    wait_axes.set_ylabel("fetch wait (ms)")
    gather_axes.set_ylabel("all-gather (ms)")
    gather_axes.set_xlabel("step")
    gather_axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    wait_axes.legend(loc="upper right")
    figure.suptitle(f"ZeRO-3 fetches per step: {report['directory']}")
    figure.savefig(path)


# ---------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``report`` subcommand's arguments."""
    parser.add_argument("directory", type=Path, metavar="DIR",
                        help=f"output_dir of the run ({RECORD_FILE.format(rank='*')}, {TRACE_FILE.format(rank='*')})")
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
