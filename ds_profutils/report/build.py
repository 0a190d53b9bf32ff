"""The report's numbers, as plain data (what ``--json`` prints): per event, per rank, per step, per trace."""
from __future__ import annotations

from pathlib import Path
from statistics import median
from typing import Any, Dict, Iterable, List, Mapping, Sequence

from ..outputs import MAIN_ENGINE, fetch_records_files, trace_files
from .records import RankRecords, read_all
from .traces import TraceFormatError, summarize_trace

__all__ = ["STRAGGLER_FACTOR", "ReportError", "build_report"]

STRAGGLER_FACTOR = 1.5


class ReportError(ValueError):
    """There is nothing to report on (no directory, or no records and no traces in it)."""


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


def _event_tables(ranks: Sequence[RankRecords]) -> Dict[str, Dict[str, Any]]:
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


def _rank_table(ranks: Sequence[RankRecords]) -> Dict[int, Dict[str, Any]]:
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


def _step_table(ranks: Sequence[RankRecords]) -> List[Dict[str, Any]]:
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
    engines = fetch_records_files(directory)
    record_files = engines.get(MAIN_ENGINE) or next(iter(engines.values()), {})
    traces_found = trace_files(directory)
    if not record_files and not traces_found:
        raise ReportError(f"{directory}: no ZeRO-3 fetch records (zero_fetch_*rank_*.jsonl) and no traces "
                          f"(trace_rank_*.json); is \"partitioned_param_profiler\" enabled with this "
                          "output_dir, and did ds_profutils.attach(engine) run?")
    ranks = read_all(record_files)
    with_records = [records for records in ranks if records.modes]
    world = max([records.world_size for records in ranks] + [max(record_files, default=-1) + 1])
    # Ranks left out by the run's "ranks" setting are not missing; without it, every rank records.
    recording = next((records.recording_ranks for records in with_records if records.recording_ranks is not None),
                     range(world))
    problems = {records.rank: {"count": records.problem_count, "first": records.problems} for records in ranks
                if records.problem_count}
    traces: Dict[int, Any] = {}
    for rank, path in traces_found.items():
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
