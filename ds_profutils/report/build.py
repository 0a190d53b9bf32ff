"""The report's numbers, as data (what ``--json`` prints): per engine, per event, rank and step; per trace.

Everything is plain data except each engine's step view (:class:`.steps.StepView`), which stays in
compact arrays however many ranks and steps there are; :mod:`.jsonout` writes it out row by row.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from statistics import median
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

from ..diagnosis.advice import advise
from ..diagnosis.stragglers import rank_causes, rank_work, work_imbalance
from ..outputs import MAIN_ENGINE, fetch_records_files, hang_file, trace_files
from .hangs import add_hangs, hang_reports, read_hang_files
from .memory import memory_report
from .pipeline import pipeline_report, staged_view
from .records import BYTES, COUNT, MAX, MIN, NUMEL, TIME, FileRecords
from .run_files import (beyond_world, directory_problem, earlier_run, ending_early, found_unreadable,
                        newest_world_size, read_all, trace_gaps, where_to_look, world_of)
from .steps import (ARRIVAL_FIGURES, STRAGGLER_LEVEL, STRAGGLER_MIN_SPREAD_MS, STRAGGLER_STEP_SHARE, StepView,
                    held_back_in_some_steps, host_stragglers, is_straggler, own_gap_ms, reach, steps_to_name,
                    straggler_rule, tflops)
from .traces import TraceFormatError, summarize_trace

__all__ = ["ReportError", "build_report"]

TORN = "ends in a torn line (the job stopped mid-write?); the complete records before it are read"


class ReportError(ValueError):
    """There is nothing to report on (no directory, or no records and no traces in it)."""


def _spread(values: Mapping[int, float]) -> Dict[str, Any]:
    """min / median / max of per-rank values, and the rank with the largest."""
    ordered = list(values.values())
    return {"min": min(ordered), "median": median(ordered), "max": max(ordered),
            "max_rank": max(values, key=values.__getitem__)}


def _median_total(values: Iterable[float]) -> float:
    """Median of per-rank totals, kept an integer when it is one (ranks usually agree)."""
    middle = median(values)
    return int(middle) if middle == int(middle) else middle


def _event_tables(files: Sequence[FileRecords]) -> Dict[str, Dict[str, Any]]:
    tables: Dict[str, Dict[str, Dict[int, List[Any]]]] = {}
    units: Dict[str, Optional[str]] = {}
    for records in files:
        units.update(records.units)
        for mode, events in records.events.items():
            for name, totals in events.items():
                tables.setdefault(mode, {}).setdefault(name, {})[records.rank] = totals
    report: Dict[str, Dict[str, Any]] = {}
    for mode, events in sorted(tables.items(), key=lambda item: item[0] != "train"):
        report[mode] = {}
        for name, per_rank in sorted(events.items()):
            totals = list(per_rank.values())
            report[mode][name] = {
                "numel_unit": units.get(name),
                "count": _median_total(t[COUNT] for t in totals),
                "numel": _median_total(t[NUMEL] for t in totals),
                "bytes": None if any(t[BYTES] is None for t in totals) else _median_total(t[BYTES] for t in totals),
                "time_ms": _spread({rank: t[TIME] for rank, t in per_rank.items()}),
                "per_rank": {rank: {"count": t[COUNT], "numel": t[NUMEL], "bytes": t[BYTES], "time_ms": t[TIME],
                                    "min_ms": t[MIN] if t[MIN] <= t[MAX] else None,
                                    "max_ms": t[MAX] if t[MIN] <= t[MAX] else None}
                             for rank, t in per_rank.items()},
            }
    return report


def _collective_table(files: Sequence[FileRecords]) -> Dict[str, Any]:
    """deepspeed.comm collectives in train steps: count, time (inside the call) and, where the records say
    (schema 3), the part of it that stalled the compute stream, per rank, by operation."""
    ops: Dict[str, Dict[int, List[float]]] = {}
    for records in files:
        for op, totals in records.collectives.items():
            ops.setdefault(op, {})[records.rank] = totals
    table = {}
    for op, per_rank in sorted(ops.items()):
        exposed = {rank: exposed_ms for rank, (_, _, exposed_ms) in per_rank.items() if exposed_ms == exposed_ms}
        table[op] = {"count": _median_total(count for count, _, _ in per_rank.values()),
                     "time_ms": _spread({rank: time_ms for rank, (_, time_ms, _) in per_rank.items()}),
                     "exposed_ms": _spread(exposed) if exposed else None,
                     "per_rank": {rank: {"count": count, "time_ms": time_ms,
                                         "exposed_ms": exposed_ms if exposed_ms == exposed_ms else None}
                                  for rank, (count, time_ms, exposed_ms) in per_rank.items()}}
    return table


def _median_of(values: Iterable[float]) -> Optional[float]:
    present = [value for value in values if value == value]
    return median(present) if present else None


_MEAN_SPLIT_KEYS = ("step_ms_mean", "fetch_wait_ms_mean", "collective_wait_ms_mean", "busy_ms_mean")


def _mean_split(records: FileRecords) -> Dict[str, Optional[float]]:
    """Mean per train step of the step time and its parts: unlike the medians, the parts add up to the step."""
    steps = [(step, fetch, other)
             for step, fetch, other in zip(records.step_ms, records.fetch_wait_ms, records.collective_wait_ms)
             if step == step and fetch == fetch and other == other]
    if not steps:
        return dict.fromkeys(_MEAN_SPLIT_KEYS)
    step, fetch, other = (sum(column) / len(steps) for column in zip(*steps))
    return dict(zip(_MEAN_SPLIT_KEYS, (step, fetch, other, step - fetch - other)))


_NO_WORK = {"work_median": None, "busy_ms_per_unit_median": None}
_NO_CAUSE = {"cause": None, "cause_figures": None, "cause_steps": {}}


def _rank_table(files: Sequence[FileRecords], view: StepView, device_clock: bool) -> Dict[int, Dict[str, Any]]:
    table = {}
    for records in files:
        rank = records.rank
        exposed = [fetch + other for fetch, other in zip(records.fetch_wait_ms, records.collective_wait_ms)]
        total_step_ms = sum(records.step_ms)
        achieved = _median_of(tflops(records))
        table[rank] = {
            "host": max(records.hosts, key=records.hosts.__getitem__),
            "pipe_stage": records.pipe_stage,
            "records": dict(records.modes),
            "steps": len(records.global_steps),
            "step_ms_median": _median_of(records.step_ms),
            "fetch_wait_ms_median": _median_of(records.fetch_wait_ms),
            "collective_wait_ms_median": _median_of(records.collective_wait_ms),
            "exposed_wait_ms_median": _median_of(exposed),
            "collective_ms_median": _median_of(records.collective_ms),
            "busy_ms_median": _median_of(step - wait for step, wait in zip(records.step_ms, exposed)),
            "iteration_ms_median": _median_of(records.iteration_ms),
            "gap_ms_median": _median_of(records.gap_ms),
            "tokens_median": _median_of(records.tokens),
            "gap_collective_ms_median": _median_of(records.gap_collective_ms),
            "own_gap_ms_median": _median_of(own_gap_ms(records)),
            "eval_ms_median": _median_of(records.eval_ms),
            "save_ms_median": _median_of(records.save_ms),
            "tflops_median": achieved,
            "mfu_median": achieved / records.peak_tflops if achieved is not None and records.peak_tflops else None,
            **_mean_split(records),
            "exposed_wait_share": sum(exposed) / total_step_ms if total_step_ms > 0 else None,
            "straggler_steps": view.straggler_steps.get(rank, 0),
            "attributed_wait_ms": view.attributed_ms.get(rank, 0.0),
            "waited_for_stragglers_ms": view.waited_ms.get(rank, 0.0),
            "straggler_p_value": view.p_values.get(rank),
            "straggler": is_straggler(view, rank),
            "held_steps": view.held_steps.get(rank, 0),
            "held_p_value": view.held_p_values.get(rank),
            "held_back_in_some_steps": held_back_in_some_steps(view, rank),
            "straggler_step_numbers": view.straggler_step_numbers.get(rank, []),
        }
    work = rank_work(view)
    causes = rank_causes(view, [rank for rank, row in table.items() if row["straggler"]], device_clock)
    for rank, row in table.items():  # a rank with eval records only is in no step view: no work, no cause
        row.update(work_unit=view.work_unit, **work.get(rank, _NO_WORK), **causes.get(rank, _NO_CAUSE))
        row["late_by_gap"] = row["cause"] == "input_pipeline" if row["straggler"] else None
    return table


def _host_table(ranks_summary: Mapping[int, Mapping[str, Any]], view: StepView) -> Dict[str, Dict[str, Any]]:
    """Per host (only with ranks on more than one), its ranks and :func:`.steps.host_stragglers`' verdict."""
    hosts: Dict[str, List[int]] = {}
    for rank, row in ranks_summary.items():
        hosts.setdefault(row["host"], []).append(rank)
    if len(hosts) < 2:
        return {}
    verdicts = host_stragglers(view, hosts)
    return {host: {"ranks": sorted(ranks), **verdicts[host]}
            for host, ranks in sorted(hosts.items(), key=lambda item: min(item[1]))}


def _sum_counts(counters: Iterable[Mapping[str, int]]) -> Dict[str, int]:
    total: Counter = Counter()
    for counter in counters:
        total.update(counter)
    return dict(total)


def _model_numel(files: Sequence[FileRecords]) -> Optional[int]:
    """The model's parameter count.  A pipeline's rank counts its own stage's layers: one rank's count per stage,
    added up (a layer tied across stages, shared embeddings, counts in each stage holding it); None where a stage
    recorded none (``ranks`` left it out), rather than part of the model."""
    counts: Dict[Optional[int], int] = {}
    for records in files:
        if records.model_numel is not None:
            counts.setdefault(records.pipe_stage, records.model_numel)
    stages = next((records.pipe_stages for records in files if records.pipe_stage is not None), None)
    if stages is None:
        return counts.get(None)
    return sum(counts.values()) if len(counts) == stages and None not in counts else None


def _engine_report(name: str, files: Sequence[FileRecords], trace_steps: Mapping[int, Mapping[int, float]],
                   incomplete: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One engine's tables; its missing and incomplete files are appended to ``incomplete``."""
    by_rank = {records.rank: records for records in files}
    with_records = [records for records in files if records.complete_records]
    world = world_of(files)
    # Ranks left out by the run's "ranks" setting are not missing; without it, every rank records.
    recording = next((records.recording_ranks for records in with_records if records.recording_ranks is not None),
                     range(world))
    for rank in recording:
        records = by_rank.get(rank)
        reason = ("no file" if records is None else "no complete record" if not records.complete_records else None)
        if reason is not None:
            incomplete.append({"kind": "records", "engine": name, "rank": rank,
                               "file": None if records is None else Path(records.path).name, "reason": reason})
    for records in files:
        ignored = beyond_world(records, world)
        if ignored is not None:
            incomplete.append({"kind": "records", "engine": name, "rank": records.rank,
                               "file": Path(records.path).name, "reason": ignored})
        if records.torn:
            incomplete.append({"kind": "records", "engine": name, "rank": records.rank,
                               "file": Path(records.path).name, "reason": TORN})
    incomplete += ending_early("records", {records.rank: (Path(records.path), list(records.global_steps))
                                            for records in with_records}, name)
    view = staged_view(with_records, trace_steps)  # the straggler test within each pipeline stage
    clocks = _sum_counts(records.clocks for records in files)
    ranks_summary = _rank_table(with_records, view, device_clock=bool(clocks) and set(clocks) == {"device"})
    hosts_summary = _host_table(ranks_summary, view)
    ranks = len(view.ranks)
    report = {
        "world_size": world,
        "recording_ranks": None if isinstance(recording, range) else list(recording),
        "ranks": [records.rank for records in with_records],
        "records": _sum_counts(records.modes for records in files),
        "clocks": clocks,
        "old_format_records": sum(records.old_format for records in files),
        "comms_logger_records": sum(records.comms_logger for records in files),
        "superseded_records": sum(records.superseded for records in files),
        "model_numel": _model_numel(with_records),
        "peak_tflops": next((f.peak_tflops for f in with_records if f.peak_tflops is not None), None),
        "segments": max((records.segment + 1 for records in files), default=1),
        "straggler_figure": view.arrival,
        "straggler_test": {"steps": view.tested_steps,
                           "steps_to_name": steps_to_name(view.tested_steps, ranks, view.compared_ranks),
                           "reach": reach(view), "chance_per_step": 1 / view.compared_ranks if ranks else None,
                           "rank_level": STRAGGLER_LEVEL / ranks if ranks else None,
                           "host_level": STRAGGLER_LEVEL / len(hosts_summary) if hosts_summary else None},
        "straggler_ranks": [rank for rank in view.ranks if is_straggler(view, rank)],
        "held_back_ranks": [rank for rank, row in ranks_summary.items() if row["held_back_in_some_steps"]],
        "work_unit": view.work_unit,
        "work_imbalance": work_imbalance(view),
        "ranks_summary": ranks_summary,
        "straggler_hosts": [host for host, row in hosts_summary.items() if row["straggler"]],
        "hosts_summary": hosts_summary,
        "events": _event_tables(with_records),
        "collectives": _collective_table(with_records),
        "memory": memory_report(with_records, _profiled_steps(with_records, trace_steps)),
        "steps": view,
        "config": next((f.ds_config for f in reversed(with_records) if f.ds_config), {}),
        "fetch_elements": _fetch_elements(with_records),
        "pipeline": pipeline_report(with_records),
    }
    report["advice"] = advise(report, report["config"])
    return report


def _fetch_elements(files: Sequence[FileRecords]) -> Optional[Dict[str, Optional[float]]]:
    """ZeRO-3's gathered elements over the run, the median over ranks: by prefetch, on demand, and prefetched but
    still in flight when needed (None: no fetch records)."""
    fetching = [f for f in files if f.prefetch_hits is not None]
    in_flight = [f.prefetch_in_flight_waited for f in fetching if f.prefetch_in_flight_waited is not None]
    return {"prefetched": median(f.prefetch_hits for f in fetching), "on_demand": median(f.prefetch_waited for f in fetching),
            "in_flight_waited": median(in_flight) if in_flight else None} if fetching else None


def _profiled_steps(files: Sequence[FileRecords], trace_steps: Mapping[int, Mapping[int, float]]) -> Dict[int, set]:
    """Per rank, the global steps its torch profiler was active in: from its records' ``profiler_active`` where
    they say, else from its trace's ``ProfilerStep#N`` (numbered globally)."""
    return {records.rank: records.profiler_steps or set(trace_steps.get(records.rank, ())) for records in files}


def _traces(found: Mapping[int, Path], top_ops: int, incomplete: List[Dict[str, Any]]) -> Dict[int, Any]:
    traces: Dict[int, Any] = {}
    for rank, path in found.items():
        try:
            traces[rank] = summary = summarize_trace(path, top_ops)
        except (OSError, TraceFormatError) as exc:
            incomplete.append({"kind": "trace", "engine": None, "rank": rank, "file": path.name,
                               "reason": f"not read: {getattr(exc, 'strerror', None) or exc}"})
            continue
        if summary["incomplete"] is not None:
            incomplete.append({"kind": "trace", "engine": None, "rank": rank, "file": path.name,
                               "reason": f"incomplete: {summary['incomplete']}; its {summary['events']:,} events "
                                         "up to the cut are read"})
    return traces


def _joined_engine(engines: Sequence[str]) -> Optional[str]:
    """The engine whose steps a trace's ``ProfilerStep#N`` numbers: ``step_profiler(engine)`` is given one
    engine, the main one in any usual script; with a single engine, that one."""
    if MAIN_ENGINE in engines:
        return MAIN_ENGINE
    return engines[0] if len(engines) == 1 else None


def build_report(directory: Path, top_ops: int = 10) -> Dict[str, Any]:
    """Every number the report shows, as data (what ``--json`` prints)."""
    directory = Path(directory)
    problem = directory_problem(directory)
    if problem is not None:
        raise ReportError(problem)
    record_files = fetch_records_files(directory)
    traces_found = trace_files(directory)
    hang_content, hangs_unread = read_hang_files(directory)
    if not record_files and not traces_found and not hang_content:
        raise ReportError(f"{directory}: no step records (zero_fetch_*rank_*.jsonl) and no traces "
                          f"(trace_rank_*.json); {where_to_look(directory)}")
    incomplete: List[Dict[str, Any]] = list(hangs_unread)
    traces = _traces(traces_found, top_ops, incomplete)
    files = read_all(record_files)
    # Files a run with another world size left in a reused output_dir (ranks this run does not have).
    world = newest_world_size([(Path(f.path), f.last_time, f.world_size) for f in files] +
                              [(traces_found[rank], (summary["base_time_ns"] or 0) / 1e9, summary["world_size"])
                               for rank, summary in traces.items()] +
                              [(hang_file(directory, rank), content.get("time"), content.get("world_size"))
                               for rank, content in hang_content.items()])
    for rank in [rank for rank, content in hang_content.items() if earlier_run(content.get("world_size"), world)]:
        reason = earlier_run(hang_content.pop(rank).get("world_size"), world)  # a relaunch with fewer ranks
        incomplete.append({"kind": "hang", "engine": None, "rank": rank, "file": hang_file(directory, rank).name,
                           "reason": reason})
    hangs = hang_reports(hang_content)
    for records in [f for f in files if earlier_run(f.world_size, world)]:
        files.remove(records)
        incomplete.append({"kind": "records", "engine": records.engine, "rank": records.rank,
                           "file": Path(records.path).name, "reason": earlier_run(records.world_size, world)})
    earlier = [rank for rank, summary in traces.items() if earlier_run(summary["world_size"], world)]
    for rank in earlier:
        incomplete.append({"kind": "trace", "engine": None, "rank": rank, "file": traces_found[rank].name,
                           "reason": earlier_run(traces.pop(rank)["world_size"], world)})
    trace_gaps({rank: path for rank, path in traces_found.items() if rank not in earlier}, traces, incomplete)
    trace_steps = {rank: {step["step"]: step["ms"] for step in summary["steps"]} for rank, summary in traces.items()
                   if summary["step_numbering"] == "global"}
    if not traces and not hangs and not any(f.complete_records for f in files):
        unread = [f"{entry['file']}: {entry['reason']}" for entry in incomplete if entry["file"]][:3]
        if not unread:
            unread = [found_unreadable(files)]
        raise ReportError(f"{directory}: nothing readable ({'; '.join(unread)})")
    names = sorted({f.engine for f in files}, key=lambda name: (name != MAIN_ENGINE, name))  # the main engine first
    joined = _joined_engine(names)
    engines = {name: _engine_report(name, [f for f in files if f.engine == name],
                                    trace_steps if name == joined else {}, incomplete)
               for name in names}
    add_hangs(engines, hangs, hang_content, lambda name: _engine_report(name, [], {}, []))
    hosts: Dict[str, set] = {}
    for records in files:
        for host in records.hosts:
            hosts.setdefault(host, set()).add(records.rank)
    for rank, summary in traces.items():
        if summary["host"] is not None:
            hosts.setdefault(summary["host"], set()).add(rank)
    return {
        "directory": str(directory),
        "straggler_rule": {"text": straggler_rule(), "figure": list(ARRIVAL_FIGURES),
                           "min_spread_ms": STRAGGLER_MIN_SPREAD_MS,
                           "min_spread_share_of_median_step": STRAGGLER_STEP_SHARE,
                           "test": "one-sided exact binomial: straggler steps against 1/ranks per tested step "
                                   "(a host: its share of the ranks)",
                           "level": STRAGGLER_LEVEL, "rank_level": "level / ranks", "host_level": "level / hosts",
                           "reach": {name: {"tested_steps": engine["straggler_test"]["steps"],
                                            "ranks": len(engine["ranks"]),
                                            "steps_to_name": engine["straggler_test"]["steps_to_name"],
                                            "text": engine["straggler_test"]["reach"]}
                                     for name, engine in engines.items()},
                           "below_threshold": "a rank slower by less than the per-step threshold is never a step "
                                              "straggler and is not flagged"},
        "hosts": {host: sorted(ranks) for host, ranks in sorted(hosts.items())},
        "incomplete": sorted(incomplete, key=lambda entry: (entry["kind"], entry["engine"] or "", entry["rank"])),
        "problems": [{"engine": records.engine, "rank": records.rank, "file": Path(records.path).name,
                      "count": records.problem_count, "first": records.problems}
                     for records in files if records.problem_count],
        "engines": engines,
        "trace_steps_joined_to": joined if trace_steps else None,
        "traces": traces,
    }
