"""Two runs (or two sets of reruns, :mod:`.sides`) compared, as data (what ``ds-profutils diff --json`` prints).

Engines are matched by name; where each run has exactly one engine and the names differ, those two
are compared (and ``matched_by`` says so).  Per engine: the step time (per step the largest over ranks: the step
the job took), the step as the mean over ranks and each part of it (busy, fetch
wait, blocking collective wait, and the memory peak where both runs' records carry it) with its own
change and test (:mod:`.stats`), the per-rank medians that show on which ranks a change
happened, the report's straggler verdict of each run, the fetch events and collectives per step, and
the settings that differ.  Where both runs have traces: the operators whose self time per step
changed most, from the trace of the lowest rank traced in both.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..diagnosis.checked import advice_checked
from .ops import self_times
from .settings import settings_differences
from .sides import read_side
from .stages import stage_changes
from .stats import (ALPHA, MIN_CHANGE, MIN_STEPS, RUNS_ALPHA, WARMUP_SHARE, WARMUP_STEPS, compare_runs,
                    significance_rule)
from .summary import ITERATION, MEMORY, PARTS, SERIES, STEP_MEAN
from ..report.traces import TraceFormatError

__all__ = ["build_diff"]


def _matched(base: Sequence[str], new: Sequence[str]) -> Tuple[List[Tuple[str, str]], str]:
    """Pairs of (BASE engine, NEW engine) and how they were matched."""
    pairs = [(name, name) for name in base if name in new]
    if not pairs and len(base) == 1 and len(new) == 1:
        return [(base[0], new[0])], "the only engine of each run"
    return pairs, "name"


def _after_warmup(side: Mapping[str, Any], series: str) -> List[List[float]]:
    """Per run of a side, the series' values after that run's warm-up (runs without any left out)."""
    runs = ([value for value in run["series"].get(series, ())[run["warmup"]:] if value is not None]
            for run in side["runs"])
    return [run for run in runs if run]


_SIZE_FIGURES = ("count", "numel", "numel_per_event", "bytes")
_SIZE_CHANGED = 0.01  # a count or size that moved less than this (relative) is the same (averaging noise)


def _size_change(base: Optional[Mapping[str, Any]], new: Optional[Mapping[str, Any]]) -> float:
    """The largest relative change of a row's counts and sizes per step (inf: in one run only).  These are
    what the configuration decides (a bucket size changes numel per event), unlike its time."""
    if base is None or new is None:
        return math.inf
    changes = [abs(new[key] - base[key]) / abs(base[key]) if base[key] else (math.inf if new[key] else 0.0)
               for key in _SIZE_FIGURES if base.get(key) is not None and new.get(key) is not None]
    return max(changes, default=0.0)


def _figures(base: Mapping[str, Mapping[str, Any]], new: Mapping[str, Mapping[str, Any]]) -> Dict[str, Any]:
    """Per event (or collective) in either run: its per-step figures in each (None: not in that run); first
    the rows whose count or size changed, most first, then by the change of their time."""
    rows = {}
    for name in list(base) + [name for name in new if name not in base]:
        before, after = base.get(name), new.get(name)
        rows[name] = {"base": before, "new": after, "size_change": _size_change(before, after),
                      "time_change_ms": (after or {}).get("time_ms", 0.0) - (before or {}).get("time_ms", 0.0)}

    def order(item: Tuple[str, Mapping[str, Any]]) -> Tuple[float, float]:
        changed = item[1]["size_change"] >= _SIZE_CHANGED
        return (-item[1]["size_change"] if changed else 0.0, -abs(item[1]["time_change_ms"]))

    return dict(sorted(rows.items(), key=order))


def _ranks(base: Mapping[int, Mapping[str, Any]], new: Mapping[int, Mapping[str, Any]]) -> Dict[int, Any]:
    """Per rank in both runs: the medians after warm-up in each, and their change."""
    return {rank: {"base": base[rank], "new": new[rank],
                   "change": {name: None if base[rank][name] is None or new[rank][name] is None
                              else new[rank][name] - base[rank][name] for name in SERIES}}
            for rank in sorted(set(base) & set(new))}


_WHERE_RANKS = 3


def _where(ranks: Mapping[int, Mapping[str, Any]], parts: Mapping[str, Mapping[str, Any]]) -> Dict[str, Any]:
    """Per figure that changed significantly, the ranks (up to 3) whose median changed most that way (a gap 50 ms
    longer on rank 1 alone reads +50 there, where the mean over two ranks would say +25)."""
    where = {}
    for part, figure in parts.items():
        if not figure["significant"] or not any(row["change"].get(part) is not None for row in ranks.values()):
            continue
        sign = 1.0 if figure["change"] > 0 else -1.0
        moved = sorted(((row["change"][part] * sign, rank) for rank, row in ranks.items()
                        if row["change"][part] is not None and row["change"][part] * sign > 0), reverse=True)
        where[part] = [{"rank": rank, "change": change * sign} for change, rank in moved[:_WHERE_RANKS]]
    return where


def _engine(base: Mapping[str, Any], new: Mapping[str, Any], names: Tuple[str, str],
            settings: Tuple[Mapping[str, Any], Mapping[str, Any]]) -> Dict[str, Any]:
    step_ms = compare_runs(_after_warmup(base, "step_ms"), _after_warmup(new, "step_ms"))
    step_mean = compare_runs(_after_warmup(base, STEP_MEAN), _after_warmup(new, STEP_MEAN))
    parts = {part: compare_runs(_after_warmup(base, part), _after_warmup(new, part), scale=step_mean["base"])
             for part in PARTS}
    memory = {run: _after_warmup(engine, MEMORY) for run, engine in (("base", base), ("new", new))}
    if memory["base"] and memory["new"]:
        parts[MEMORY] = compare_runs(memory["base"], memory["new"])
    iteration: Dict[str, Any] = {}  # where both runs carry them; the gap's 2 % is of the base iteration
    for name in ITERATION:
        before, after = _after_warmup(base, name), _after_warmup(new, name)
        if before and after:
            scale = (iteration.get("iteration_ms") or {}).get("base") if name == "gap_ms" else None
            iteration[name] = compare_runs(before, after, scale=scale)
    ranks = _ranks(base["ranks"], new["ranks"])
    per_rank = {"step_ms": step_ms, **parts, **{name: iteration[name] for name in ("iteration_ms", "gap_ms")
                                                   if name in iteration}}
    return {
        "engine": {"base": names[0], "new": names[1]},
        "runs": {"base": len(base["runs"]), "new": len(new["runs"])},
        "steps": {"base": len(base["global_steps"]), "new": len(new["global_steps"])},
        "warmup_steps": {"base": base["warmup"], "new": new["warmup"]},
        "step_ms": step_ms,
        "step_ms_mean_over_ranks": step_mean,
        "parts": parts,
        "iteration": iteration,
        "memory": {"base": bool(memory["base"]), "new": bool(memory["new"])},
        "straggler": {"base": base["stragglers"], "new": new["stragglers"],
                      "hosts": {"base": base["straggler_hosts"], "new": new["straggler_hosts"]},
                      "straggler_steps": {"base": base["straggler_steps"], "new": new["straggler_steps"]},
                      "runs": {"base": base["straggler_runs"], "new": new["straggler_runs"]}},
        "ranks": ranks,
        "where": _where(ranks, per_rank),
        "events": _figures(base["events"], new["events"]),
        "collectives": _figures(base["collectives"], new["collectives"]),
        "settings": settings_differences(*settings),
        "series": {"base": base["series"], "new": new["series"]},
        "stages": stage_changes(base["pipelines"], new["pipelines"]),
    }


def _operators(base: Mapping[str, Any], new: Mapping[str, Any], top: int) -> Optional[Dict[str, Any]]:
    """Operators whose self time per profiled step changed most, in the lowest rank's trace of each run."""
    common = sorted(set(base["traces"]) & set(new["traces"]))
    if not common:
        return None
    rank = common[0]
    sides = {}
    for run, summary in (("base", base), ("new", new)):
        trace = summary["traces"][rank]
        try:
            times = self_times(Path(trace["file"]))
        except (OSError, TraceFormatError):
            return None  # the report has named the trace incomplete; no partial comparison
        sides[run] = (times, trace["steps"] or 1)
    keys = list(sides["base"][0].ops) + [key for key in sides["new"][0].ops if key not in sides["base"][0].ops]
    rows = []
    for category, name in keys:
        per_step = {}
        for run, (times, steps) in sides.items():
            totals = times.ops.get((category, name))
            per_step[run] = None if totals is None else {"count": totals[0] / steps, "self_ms": totals[1] / steps}
        change = (per_step["new"] or {"self_ms": 0.0})["self_ms"] - (per_step["base"] or {"self_ms": 0.0})["self_ms"]
        rows.append({"name": name, "cat": category, **per_step, "change_ms": change})
    rows.sort(key=lambda row: -abs(row["change_ms"]))
    return {"rank": rank, "steps": {"base": base["traces"][rank]["steps"], "new": new["traces"][rank]["steps"]},
            "late_events": {run: times.late for run, (times, _) in sides.items()}, "ops": rows[:top]}


def _run_notes(side: Mapping[str, Any]) -> Any:
    """Per run of a side, its directory and what the report noted; one run: that run's notes, several: a list."""
    notes = [{"directory": summary["directory"], "incomplete": summary["incomplete"], "problems": summary["problems"],
              "superseded": summary["superseded"], "hosts": summary["hosts"], "engines": list(summary["engines"])}
             for summary in side["runs"]]
    return notes[0] if len(notes) == 1 else notes


def _not_a_rerun(label: str, found: Mapping[str, Any]) -> str:
    """The warning for a run of a side whose settings differ from the side's first run's."""
    where = "the traces" if found["scope"] is None else f"engine {found['scope']}"
    changes = "; ".join(f"{change['setting']} {change['base']} -> {change['new']}" for change in found["differences"])
    return (f"{label}: {found['run']} is no rerun of {found['of']} ({where}: {changes}): the side's test pools runs "
            "of different configurations")


def build_diff(base_directories: Sequence[Path], new_directories: Sequence[Path], top: int = 10) -> Dict[str, Any]:
    """Every figure ``ds-profutils diff`` shows, as data; each side one run directory or several (a sequence; a
    single path is one run).  Raises :class:`ds_profutils.report.build.ReportError` (naming the directory) where a
    directory holds no run."""
    base = read_side([base_directories] if isinstance(base_directories, (str, Path)) else base_directories, top)
    new = read_side([new_directories] if isinstance(new_directories, (str, Path)) else new_directories, top)
    pairs, matched_by = _matched(list(base["engines"]), list(new["engines"]))
    engines = {base_name: _engine(base["engines"][base_name], new["engines"][new_name], (base_name, new_name),
                                  (base["settings"][base_name], new["settings"][new_name]))
               for base_name, new_name in pairs}
    for (base_name, new_name), engine in zip(pairs, engines.values()):  # BASE's advice that NEW followed
        engine["advice_checked"] = advice_checked(base["engines"][base_name]["advice"], base["engines"][base_name][
            "config"], new["engines"][new_name]["config"], engine, MIN_CHANGE)
    warnings = [f"engine {name}: the runs trained models of different sizes (model_numel {setting['base']:,} -> "
                f"{setting['new']:,}): this compares two different jobs"
                for name, engine in engines.items() for setting in engine["settings"]
                if setting["setting"] == "model_numel" and setting["base"] is not None and setting["new"] is not None]
    warnings += [_not_a_rerun(label, found) for label, side in (("BASE", base), ("NEW", new))
                 for found in side["not_reruns"]]
    return {
        "warnings": warnings,
        "test": {"text": significance_rule(),
                 "name": "one run per side: difference of winsorized means on effective steps (autocorrelation time of "
                         "both runs: the larger of the bias-corrected AR(1) and Geyer's initial positive sequence "
                         "estimates), Student's t, Welch, two-sided; several runs per side: Student's t on the runs' "
                         "means, pooled between-run variance",
                 "sees": "beyond within-run noise; offsets between nodes or reruns need several runs per side"
                 if len(base["runs"]) < 2 or len(new["runs"]) < 2 else "beyond the spread between reruns",
                 "alpha": ALPHA, "runs_alpha": RUNS_ALPHA, "min_change": MIN_CHANGE, "min_steps": MIN_STEPS,
                 "warmup_steps": WARMUP_STEPS, "warmup_share": WARMUP_SHARE},
        "base": _run_notes(base),
        "new": _run_notes(new),
        "matched_by": matched_by,
        "unmatched": {"base": [name for name in base["engines"] if name not in {b for b, _ in pairs}
                               and name not in new["partial_engines"]],
                      "new": [name for name in new["engines"] if name not in {n for _, n in pairs}
                              and name not in base["partial_engines"]]},
        "partial": {"base": base["partial_engines"], "new": new["partial_engines"]},
        "engines": engines,
        "trace_settings": settings_differences(base["settings"].get(None, {}), new["settings"].get(None, {}))
        if None in base["settings"] and None in new["settings"] else [],
        "operators": _operators(base, new, top),
    }
