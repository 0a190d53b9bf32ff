"""The report as aligned text tables that stay readable at 1024 ranks.

Beyond a handful of ranks, a table shows a summary across ranks and the worst ranks (those that held
the others back most), never one row per rank; ``--json`` has every number.
"""
from __future__ import annotations

from pathlib import Path
from statistics import median
from typing import Any, List, Mapping, Optional, Tuple

from ..diagnosis.advice import advice_lines
from ..diagnosis.causes import describe_cause
from .hangs import hang_lines
from .pipeline import pipeline_lines
from .steps import ARRIVAL_FIGURES, StepView
from ..units import rank_ranges
from .tables import counted, percent, table, unread_files, wrap
from ..units import flops_rate, share

__all__ = ["render_text"]

_HOSTS_SHOWN = 6


def _header(report: Mapping[str, Any]) -> List[str]:
    lines = [f"ds-profutils report: {report['directory']}"]
    hosts = sorted(report["hosts"].items(), key=lambda item: (min(item[1], default=-1), item[0]))
    if hosts:
        shown = [f"{host} ({'rank' if len(ranks) == 1 else 'ranks'} {rank_ranges(ranks)})" for host, ranks in hosts]
        if len(shown) > _HOSTS_SHOWN:
            shown[_HOSTS_SHOWN - 1:-1] = [f"... {len(shown) - _HOSTS_SHOWN} more ..."]
        lines += wrap(f"hosts ({len(hosts)}): " + "; ".join(shown))
    return lines + unread_files(report["incomplete"], report["problems"])


def _engine_header(name: str, engine: Mapping[str, Any]) -> List[str]:
    records = ", ".join(f"{count:,} {mode}" for mode, count in engine["records"].items()) or "none"
    clocks = ", ".join(f"{clock} ({counted(count, 'record')})" for clock, count in engine["clocks"].items()) or "-"
    lines = [""] + wrap(f"== engine {name}: ranks {rank_ranges(engine['ranks'])} of {engine['world_size']} with "
                         f"records; {counted(len(engine['steps'].global_steps), 'train step')}; records: {records}; "
                         f"clock: {clocks}")
    if engine["old_format_records"]:
        lines += wrap(f"{engine['old_format_records']:,} records of an older ds_profutils (no \"schema\"): no "
                       "blocking collectives recorded, so their exposed wait is the fetch wait alone")
    if engine["superseded_records"]:
        lines += wrap(f"RESUMED: the run went back to earlier steps ({engine['segments']} segments: a restart from a "
                       f"checkpoint before its last recorded step); {counted(engine['superseded_records'], 'record')} "
                       "of steps recorded again later are superseded: each step is taken from the latest segment "
                       "that recorded it, never added to an earlier run's")
    if engine["comms_logger_records"]:
        lines += wrap(f"WARNING: DeepSpeed's comms logger was on in {engine['comms_logger_records']:,} records; it "
                       "synchronizes after every collective, which lengthens step times and waits")
    return lines


def _chance(p_value: float, level: float) -> str:
    """How a verdict's binomial test came out, in a few words."""
    return f"p = {p_value:.2g} by chance, named at <= {level:.3g}"


def _held_back(rank: int, row: Mapping[str, Any], steps: int, level: float) -> str:
    """The line of a rank that held the others back in part of the run: in which steps, how long, and why there."""
    ranges = rank_ranges(row["straggler_step_numbers"]).split(", ")  # compressed first, then cut: 500-9999 stays so
    shown = ", ".join(ranges[:20]) + (", ..." if len(ranges) > 20 else "")
    by_count = sorted(row["cause_steps"].items(), key=lambda item: -item[1])
    causes = ", ".join(f"{cause} {count}" for cause, count in by_count)
    return (f"HELD BACK IN SOME STEPS: rank {rank} ({row['host']}) held the others back in {row['straggler_steps']} of "
            f"the {row['held_steps']} steps where a rank did, of {steps} (global steps {shown}; "
            f"{_chance(row['held_p_value'], level)}); their waiting beyond its own in those steps: "
            f"{row['attributed_wait_ms']:,.1f} ms; the cause in those steps: {causes or 'none decided'}")


def _stragglers(engine: Mapping[str, Any]) -> List[str]:
    summary, view, test = engine["ranks_summary"], engine["steps"], engine["straggler_test"]
    if not view.global_steps:
        return ["No train steps recorded."]
    steps = view.tested_steps
    named = engine["straggler_ranks"]
    lines = []
    if view.arrival != "collective_ms":
        lines += wrap("The records carry no time inside collectives (schema 2 or older): the step straggler is the "
                       "rank with the least exposed wait (fetch waits and blocking collectives), which misses a rank "
                       "slowed while the collectives overlap on a side stream.")
    for rank in named:
        row = summary[rank]
        lines += wrap(f"STRAGGLER: rank {rank} ({row['host']}) held the others back in {row['straggler_steps']} of "
                       f"{steps} steps ({_chance(row['straggler_p_value'], test['rank_level'])}); their waiting "
                       f"beyond its own in those steps: {row['attributed_wait_ms']:,.1f} ms")
        if row.get("cause") is not None:
            lines += wrap(f"  {describe_cause(row['cause'], row['cause_figures'], row['work_unit'], row['cause_steps'])}")
    hosts = engine["hosts_summary"]
    if not named:
        occasional = sorted((rank for rank, row in summary.items() if row["straggler_steps"]),
                            key=lambda rank: -summary[rank]["straggler_steps"])
        detail = ", ".join(f"rank {rank} in {summary[rank]['straggler_steps']}" for rank in occasional[:5])
        lines += wrap(f"No straggler{' rank' if engine['straggler_hosts'] else ''}: no rank was the step straggler "
                       f"more often than chance allows in the {steps} steps"
                       + (f" (step stragglers: {detail}{', ...' if len(occasional) > 5 else ''})." if detail else "."))
    for rank in engine.get("held_back_ranks", []):
        lines += wrap(_held_back(rank, summary[rank], steps, test["rank_level"]))
    lines += wrap(f"Reach of the test: {test['reach']}.")
    for host in engine["straggler_hosts"]:
        row = hosts[host]
        if row["straggler_steps"] == sum(summary[rank]["straggler_steps"] for rank in set(row["ranks"]) & set(named)):
            continue  # its named ranks were all of its straggler steps: naming them says it
        lines += wrap(f"STRAGGLER HOST: {host} (ranks {rank_ranges(row['ranks'])}) held the others back in "
                       f"{row['straggler_steps']} of {steps} steps: their straggler was one of its ranks "
                       f"({_chance(row['straggler_p_value'], test['host_level'])})")
    return lines


def _worst_ranks(summary: Mapping[int, Mapping[str, Any]], limit: int) -> List[int]:
    """Ranks by how much they held the others back, then by busy time: the ones worth a look first."""
    return sorted(summary, key=lambda rank: (-summary[rank]["straggler_steps"], -summary[rank]["attributed_wait_ms"],
                                             -(summary[rank]["busy_ms_median"] or 0.0), rank))[:limit]


_RANK_COLUMNS = {"step_ms_median": "step ms", "fetch_wait_ms_median": "fetch wait",
                 "collective_wait_ms_median": "collective wait", "exposed_wait_ms_median": "exposed wait",
                 "collective_ms_median": "in collectives", "busy_ms_median": "busy", "iteration_ms_median": "iteration",
                 "gap_ms_median": "gap", "tflops_median": "FLOP/s", "mfu_median": "MFU"}
_OPTIONAL_COLUMNS = ("iteration_ms_median", "gap_ms_median", "tflops_median", "mfu_median")  # later writers' fields


def _fetched(engine: Mapping[str, Any]) -> bool:
    """Whether the engine's records hold fetch events (ZeRO-3 with ``partitioned_param_profiler``): without them a
    fetch wait column would be a column of zeros about something the job never recorded."""
    return any(engine["events"].values())


def _rank_columns(view: StepView, summary: Mapping[int, Mapping[str, Any]], fetched: bool = True) -> List[str]:
    """The per-rank medians shown: the fetch wait only where fetches were recorded, the time inside collectives
    only where the records carry it, the iteration, gap, TFLOP/s and MFU where some rank has them."""
    return [column for column in _RANK_COLUMNS
            if (column != "fetch_wait_ms_median" or fetched)
            and (column != "collective_ms_median" or view.arrival == "collective_ms")
            and (column not in _OPTIONAL_COLUMNS or any(row[column] is not None for row in summary.values()))]


def _ranks(engine: Mapping[str, Any], limit: int) -> List[str]:
    summary = engine["ranks_summary"]
    fetched = _fetched(engine)
    columns = _rank_columns(engine["steps"], summary, fetched)
    staged = engine.get("pipeline") is not None  # a pipeline's ranks say their stage
    stage = ("stage", ) if staged else ()
    headers = ("rank", "host", *stage, "steps", *(_RANK_COLUMNS[column] for column in columns), "exposed share",
               "straggler steps", "others' wait ms", "")
    shown = sorted(summary) if len(summary) <= limit else _worst_ranks(summary, limit)
    rows: List[Tuple[Any, ...]] = [
        (rank, row["host"], *((row["pipe_stage"], ) if staged else ()), row["steps"],
         *(_cell_of(column, row[column]) for column in columns),
         percent(row["exposed_wait_share"]), row["straggler_steps"], row["attributed_wait_ms"],
         "STRAGGLER" if row["straggler"] else "") for rank, row in ((rank, summary[rank]) for rank in shown)]
    note = ""
    if len(summary) > limit:
        note = (f"; {limit} of {len(summary)} ranks shown: those that held the others back most, then the busiest "
                "(every rank: --json)")
        for label, pick in (("min", min), ("median", median), ("max", max)):
            rows.append((f"{label} of all", "", *(None for _ in stage), None, *(_cell_of(column, _over_ranks(summary, column, pick))
                                                    for column in columns),
                         None, None, None, ""))
    inside = "; in collectives = time inside them, waiting for late peers included" if "collective_ms_median" in columns else ""
    if "iteration_ms_median" in columns:
        inside += ("; iteration = end of the previous optimizer step to the end of this one (data loading, callbacks "
                   "and logging included); gap = its part outside forward, backward and step")
    if "tflops_median" in columns:
        inside += "; FLOP/s = the step's model FLOPs over its iteration; MFU = that over the peak the job was given"
    exposed = "fetch wait + blocking collectives" if fetched else "blocking collectives"
    return ["", *wrap(f"Ranks (median per train step, ms; exposed wait = {exposed}; busy = "
                       f"step - exposed{inside}; others' wait = what the ranks waited beyond this one in its straggler "
                       f"steps){note}:"), *table(headers, rows)]


def _cell_of(column: str, value: Any) -> Any:
    """A rank table value as shown: MFU as a percentage, FLOP/s in TFLOP/s, GFLOP/s or MFLOP/s, the rest as they are."""
    if column == "tflops_median":
        return flops_rate(value)
    return share(value) if column == "mfu_median" else value


def _over_ranks(summary: Mapping[int, Mapping[str, Any]], column: str, pick: Any) -> Optional[float]:
    values = [row[column] for row in summary.values() if row[column] is not None]
    return pick(values) if values else None


def _steps_shown(view: StepView, limit: int) -> Tuple[List[int], str]:
    count = len(view.global_steps)
    if count <= limit:
        return list(range(count)), ""
    by_spread = sorted(range(count), key=lambda index: -(view.spread_ms[index] or 0.0))[:limit]
    return sorted(by_spread), f" ({limit} of {count} steps: the largest spread of {ARRIVAL_FIGURES[view.arrival]})"


_STEP_COLUMNS = {"step_ms": "step ms", "fetch_wait_ms": "fetch wait", "collective_wait_ms": "collective wait",
                 "exposed_wait_ms": "exposed wait", "collective_ms": "in collectives", "busy_ms": "busy",
                 "trace_step_ms": "trace step ms"}


def _steps(view: StepView, limit: int, max_ranks: int, fetched: bool = True) -> List[str]:
    """Up to ``max_ranks`` ranks, a row per step and rank (the fetch wait where fetches were recorded); beyond, a
    row per step across ranks."""
    shown, note = _steps_shown(view, limit)
    if not shown:
        return []
    if len(view.ranks) <= max_ranks:
        names = [name for name in _STEP_COLUMNS if (name != "collective_ms" or view.arrival == "collective_ms")
                 and (name != "fetch_wait_ms" or fetched)]
        matrices = [getattr(view, name) for name in names]
        rows = []
        for index in shown:
            for rank_index, rank in enumerate(view.ranks):
                values = [matrix.get(rank_index, index) for matrix in matrices]
                if values[0] is None:
                    continue
                rows.append((view.global_steps[index], rank, *values,
                             "straggler" if view.straggler[index] == rank else ""))
        legend = ("step ms: the step's micro steps added up, each from its forward start to the end of "
                  "engine.step() (or of engine.backward() where no step() follows); trace step ms: the trace's ProfilerStep#N, one "
                  "optimizer step from one step_profiler() call (or, driven by the engine, one engine.step()) to "
                  "the next, so it also holds data loading and whatever the loop does between steps")
        headers = ("step", "rank", *(_STEP_COLUMNS[name] for name in names), "")
        return ["", f"Steps (per global step and rank, ms){note}:", *wrap(legend), *table(headers, rows)]
    figure = ARRIVAL_FIGURES[view.arrival]
    arrival = getattr(view, view.arrival)
    headers = ("step", "ranks", "step ms median", f"{figure} min", "median", "max", "busy median", "straggler")
    rows = []
    for index in shown:
        inside = [value for value in arrival.step_column(index) if value == value]
        step_ms = [value for value in view.step_ms.step_column(index) if value == value]
        busy = [value for value in view.busy_ms.step_column(index) if value == value]
        straggler = view.straggler[index]
        rows.append((view.global_steps[index], len(step_ms), median(step_ms), min(inside, default=None),
                     median(inside) if inside else None, max(inside, default=None), median(busy),
                     "-" if straggler is None else f"rank {straggler}"))
    return ["", f"Steps (across ranks, ms){note}:", *table(headers, rows)]


def _events(engine: Mapping[str, Any]) -> List[str]:
    lines = []
    for mode, events in engine["events"].items():
        lines += ["", *wrap(f"Events ({mode} records; totals per rank, median across ranks; numel as DeepSpeed "
                             "counts it: shard or full):")]
        lines += table(("event", "numel unit", "count", "numel", "bytes", "time ms min", "median", "max", "max at"),
                        [(name, row["numel_unit"], row["count"], row["numel"], row["bytes"], row["time_ms"]["min"],
                          row["time_ms"]["median"], row["time_ms"]["max"], f"rank {row['time_ms']['max_rank']}")
                         for name, row in events.items()])
    collectives = engine["collectives"]
    if not collectives:
        return lines
    exposed = any(row["exposed_ms"] is not None for row in collectives.values())  # schema 3: every collective
    lines += ["", *wrap("Collectives (train steps; totals per rank, median across ranks; time inside the call, "
                         "waiting for late peers included; exposed: the part that stalled the compute stream):"
                         if exposed else "Blocking collectives (train steps; totals per rank, median across ranks):")]
    lines += table(("collective", "count", "time ms min", "median", "max", "max at",
                     *(("exposed ms median", ) if exposed else ())),
                    [(op, row["count"], row["time_ms"]["min"], row["time_ms"]["median"], row["time_ms"]["max"],
                      f"rank {row['time_ms']['max_rank']}", *(((row["exposed_ms"] or {}).get("median"), ) if exposed else ()))
                     for op, row in collectives.items()])
    return lines


def _size(value: Optional[float]) -> Optional[str]:
    """Bytes in binary units: ``812.00 MiB``, ``1.50 GiB``."""
    if value is None:
        return None
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:,.2f} {unit}"
    return f"{int(value)} B"


_MEMORY_SOURCES = {
    "allocator": "the accelerator's allocator",
    "rss": "RSS, the process's resident set size (a CPU run: DeepSpeed's CPU accelerator reports it, sampled at phase "
           "boundaries; it counts everything the process holds, not only tensors)",
}
_MEMORY_COLUMNS = (  # key, header, how a value is shown
    ("peak_allocated_bytes", "peak allocated", _size), ("peak_step", "at step", None), ("peak_phase", "phase", None),
    ("median_peak_allocated_bytes", "median peak", _size), ("peak_reserved_bytes", "peak reserved", _size),
    ("median_peak_reserved_bytes", "median reserved", _size), ("live_params_max", "live params max", None),
    ("max_live_parameters", "limit", None), ("live_params_share", "of limit", percent),
    ("trace_cache_invalidations", "trace-cache invalidations", None), ("prefetch_hit_rate", "prefetch hits", percent),
    ("jumps", "jumps", None), ("disturbed_steps", "disturbed steps", None),
)
_JUMPS_SHOWN = 10


def _memory(engine: Mapping[str, Any], limit: int) -> List[str]:
    """Per rank the step peaks, live parameters against their limit, cache and prefetch figures; the highest
    rank, the imbalance and the jumps.  Beyond ``limit`` ranks, the highest peaks and the lowest."""
    memory = engine["memory"]
    if memory is None:
        return ["", "Memory: the records carry no memory figures (schema 2 or older, or memory figures were off)."]
    ranks, hosts = memory["ranks"], engine["ranks_summary"]
    sources = "; ".join(f"{_MEMORY_SOURCES.get(source, source)}: {counted(count, 'record')}"
                        for source, count in memory["sources"].items()) or "none"
    columns = [(key, header, show) for key, header, show in _MEMORY_COLUMNS
               if key == "jumps" or (any(row[key] for row in ranks.values()) if key == "disturbed_steps"
                                     else any(row[key] is not None for row in ranks.values()))]
    shown = sorted(ranks)
    note = ""
    if len(ranks) > limit:
        lowest = memory["lowest_rank"]
        by_peak = sorted((rank for rank in ranks if rank != lowest),
                         key=lambda rank: (-(ranks[rank]["peak_allocated_bytes"] or 0), rank))
        shown = by_peak[:limit - 1] + ([lowest] if lowest is not None else by_peak[limit - 1:limit])
        note = f"; {limit} of {len(ranks)} ranks shown: the highest peaks, then the lowest"
    live = ("; ZeRO-3's most live parameter elements against stage3_max_live_parameters"
            if any(key == "live_params_max" for key, _, _ in columns) else "")
    lines = ["", *wrap(f"Memory (train steps: per rank the highest step peak, the step and phase it was in, and the "
                        f"median step peak{live}; memory from {sources}){note}:")]
    lines += table(("rank", "host", *(header for _, header, _ in columns)),
                    [(rank, hosts[rank]["host"], *(ranks[rank][key] if show is None else show(ranks[rank][key])
                                                   for key, _, show in columns)) for rank in shown])
    highest, lowest = memory["highest_rank"], memory["lowest_rank"]
    if highest is not None:
        top = ranks[highest]
        phase = f" ({top['peak_phase']})" if top["peak_phase"] else ""
        imbalance = "-" if memory["imbalance"] is None else f"{memory['imbalance']:.2f}x"
        lines += wrap(f"Highest peak: rank {highest} ({hosts[highest]['host']}), {_size(top['peak_allocated_bytes'])} "
                       f"at step {top['peak_step']}{phase}; imbalance {imbalance} (highest over lowest peak: rank "
                       f"{lowest}, {_size(ranks[lowest]['peak_allocated_bytes'])}).")
    if memory["disturbed_steps"]:
        disturbed = [rank for rank, row in ranks.items() if row["disturbed_steps"]]
        lines += wrap(f"DISTURBED: {counted(memory['disturbed_steps'], 'step')} (rank {rank_ranges(disturbed)}) had their "
                       "peaks reset between ds_profutils' boundaries (DeepSpeed's memory_breakdown, or anything else "
                       "that resets the accelerator's peak statistics), so their peaks cover part of the step only: "
                       "counted under \"disturbed steps\" and left out of the peaks, the highest rank, the imbalance "
                       "and the jumps.")
    rule = memory["jump_rule"]["text"]
    if not memory["jump_count"]:
        return lines + wrap(f"No jumps ({rule}).")
    jumps = memory["jumps"]
    listed = "; ".join(f"rank {jump['rank']} at step {jump['global_step']}: {_size(jump['peak_allocated_bytes'])} "
                       f"({_size(jump['baseline_bytes'])} before)"
                       + (", during the torch profiler's window (its own buffers, not a leak)" if jump["during_profiler"]
                          else "") for jump in jumps[:_JUMPS_SHOWN])
    more = memory["jump_count"] - min(len(jumps), _JUMPS_SHOWN)
    return lines + wrap(f"JUMPS ({rule}): {listed}" + (f"; ... {more:,} more (--json)" if more else "") + ".")


def _traces(traces: Mapping[int, Mapping[str, Any]], limit: int) -> List[str]:
    if not traces:
        return []
    if len(traces) > limit:
        by_step = sorted(traces, key=lambda rank: -((traces[rank]["step_ms"] or {}).get("median") or 0.0))[:limit]
        lines = ["", f"Traces: {len(traces)} ranks; the {limit} with the longest median step:"]
        lines += table(("rank", "host", "events", "steps", "step ms median", "max"),
                        [(rank, traces[rank]["host"], traces[rank]["events"], len(traces[rank]["steps"]),
                          (traces[rank]["step_ms"] or {}).get("median"), (traces[rank]["step_ms"] or {}).get("max"))
                         for rank in by_step])
        traces = {min(traces): traces[min(traces)]}
    else:
        lines = []
    for rank, trace in sorted(traces.items()):
        step_ms = trace["step_ms"]
        steps = (f"{len(trace['steps'])} profiler steps, step ms median {step_ms['median']:.3f}, "
                 f"max {step_ms['max']:.3f}" if step_ms else "no ProfilerStep# events")
        lines += ["", f"Trace of rank {rank} ({Path(trace['file']).name}, {trace['events']:,} events): {steps}"]
        lines += table(("top ops by total time", "category", "count", "total ms"),
                        [(op["name"], op["cat"], op["count"], op["total_ms"]) for op in trace["top_ops"]])
    return lines


def render_text(report: Mapping[str, Any], max_steps: int = 20, max_ranks: int = 8) -> str:
    """The report as text: at most ``max_steps`` steps and ``max_ranks`` ranks per table."""
    lines = _header(report)
    lines[1:1] = hang_lines(report)  # a hung job's culprit before everything else
    if report["engines"]:
        lines += ["", *wrap(f"Straggler rule: {report['straggler_rule']['text']}.")]
    for name, engine in report["engines"].items():
        lines += _engine_header(name, engine)
        lines += _stragglers(engine)
        if engine["ranks_summary"]:
            lines += _ranks(engine, max_ranks)
            lines += pipeline_lines(engine.get("pipeline"))
            lines += _steps(engine["steps"], max_steps, max_ranks, _fetched(engine))
            lines += _memory(engine, max_ranks)
        if "advice" in engine:
            lines += ["", *(part for line in advice_lines(engine["advice"]) for part in wrap(line))]
        lines += _events(engine)
    joined = report["trace_steps_joined_to"]
    if joined is not None:
        lines += ["", *wrap(f"The traces' step times (ProfilerStep#N, N = global step) are joined to engine {joined}.")]
    lines += _traces(report["traces"], max_ranks)
    return "\n".join(lines)
