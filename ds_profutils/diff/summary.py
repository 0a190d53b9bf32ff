"""What ``ds-profutils diff`` keeps of one run: the report's figures, reduced to what is compared.

Each run is read by the report itself (:func:`ds_profutils.report.build.build_report`: the same readers, the same
straggler verdict), then reduced, per engine, to one value per recorded train step: the step time, the
iteration and the gap between steps as the largest over ranks (the step the job took: the slowest rank's,
as the live figures give it), the step time also as the mean over ranks beside its parts (so the parts add
up to it), the memory peak as the highest rank's, TFLOP/s and MFU as the mean over ranks;
per rank the medians after warm-up, the straggler verdict, and the per-step event and collective
figures.  The reduction is a few numbers per step and rank at most; the report and its step view
(80-odd bytes per rank and step) are dropped before the other run is read, so two 1024-rank x
1000-step runs are never in memory at once.
"""
from __future__ import annotations

from pathlib import Path
from statistics import fmean, median
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from ..report.build import build_report
from .settings import run_settings
from .stats import warmup_steps
from ..report.steps import Matrix, StepView

__all__ = ["ITERATION", "MEMORY", "PARTS", "SERIES", "STEP_MEAN", "summarize_run"]

PARTS = ("busy_ms", "fetch_wait_ms", "collective_wait_ms")
"""The parts of a step (busy = step - fetch wait - blocking collective wait): they add up to the step."""
MEMORY = "peak_allocated_bytes"
"""A step's memory peak: the highest of its records' (schema 3 ``memory``); per step of a run, the highest rank's."""
STEP_MEAN = "step_ms_mean"
"""The step time per step as the mean over ranks: what the parts (means over ranks too) add up to."""
SERIES = ("step_ms", *PARTS, MEMORY, "iteration_ms", "gap_ms")
"""Per rank, the medians kept of these (iteration and gap where the records carry them)."""
ITERATION = ("iteration_ms", "gap_ms", "tflops", "mfu")
"""What a user's iteration took (the step, and the gap between steps: data loading, callbacks, logging: per step
the largest over ranks) and the throughput (per step the mean over ranks; MFU: TFLOP/s over the run's peak);
compared where both runs carry them."""


def _per_step(matrix: Matrix, pick: Callable[[Sequence[float]], float]) -> List[Optional[float]]:
    """Per step, ``pick`` over the ranks with a value (None where none has one)."""
    values = []
    for index in range(matrix.steps):
        present = [value for value in matrix.step_column(index) if value == value]
        values.append(pick(present) if present else None)
    return values


def _rank_medians(view: StepView, warmup: int) -> Dict[int, Dict[str, Optional[float]]]:
    """Per rank, the median of each series over its steps after warm-up (None: no value)."""
    medians: Dict[int, Dict[str, Optional[float]]] = {rank: {} for rank in view.ranks}
    for name in SERIES:
        matrix = getattr(view, name)
        for rank_index, rank in enumerate(view.ranks):
            present = [value for value in matrix.rank_row(rank_index)[warmup:] if value == value]
            medians[rank][name] = median(present) if present else None
    return medians


def _per_step_figures(totals: Mapping[str, Any], steps: int) -> Dict[str, Optional[float]]:
    """An event's or collective's totals (the report's medians across ranks) per recorded train step."""
    count = totals["count"]
    figures = {"count": count / steps, "time_ms": totals["time_ms"]["median"] / steps}
    if "numel" in totals:
        figures["numel"] = totals["numel"] / steps
        figures["numel_per_event"] = totals["numel"] / count if count else None
        figures["bytes"] = None if totals["bytes"] is None else totals["bytes"] / steps
    return figures


def _engine(engine: Mapping[str, Any]) -> Dict[str, Any]:
    view: StepView = engine["steps"]
    steps = len(view.global_steps)
    summary = engine["ranks_summary"]
    stragglers = [rank for rank, row in summary.items() if row["straggler"]]
    series = {name: _per_step(getattr(view, name), fmean) for name in PARTS}
    for name in ("step_ms", "iteration_ms", "gap_ms"):
        series[name] = _per_step(getattr(view, name), max)
    series[STEP_MEAN] = _per_step(view.step_ms, fmean)
    series[MEMORY] = _per_step(view.peak_allocated_bytes, max)
    series["tflops"] = _per_step(view.tflops, fmean)
    peak = engine["peak_tflops"]
    series["mfu"] = [None if value is None or not peak else value / peak for value in series["tflops"]]
    return {
        "global_steps": list(view.global_steps),
        "warmup": warmup_steps(steps),
        "series": series,
        "ranks": _rank_medians(view, warmup_steps(steps)),
        "stragglers": stragglers,
        "straggler_hosts": list(engine.get("straggler_hosts", [])),
        "straggler_steps": {rank: summary[rank].get("straggler_steps") for rank in stragglers},
        "events": {name: {"numel_unit": totals["numel_unit"], **_per_step_figures(totals, steps)}
                   for name, totals in engine["events"].get("train", {}).items()} if steps else {},
        "collectives": {op: _per_step_figures(totals, steps) for op, totals in engine["collectives"].items()}
        if steps else {},
        "advice": engine.get("advice", []),
        "config": engine.get("config", {}),
        "pipeline": engine.get("pipeline"),  # a pipeline's stages (diff/stages.py)
    }


def summarize_run(directory: Path, top_ops: int) -> Dict[str, Any]:
    """One run's figures as the diff compares them; raises :class:`ds_profutils.report.build.ReportError` where the report would."""
    report = build_report(directory, top_ops)
    return {
        "directory": str(directory),
        "engines": {name: _engine(engine) for name, engine in report["engines"].items()},
        "incomplete": report["incomplete"],
        "problems": sum(found["count"] for found in report["problems"]),
        "superseded": sum(engine["superseded_records"] for engine in report["engines"].values()),
        "hosts": len(report["hosts"]),
        "traces": {rank: {"file": trace["file"], "steps": len(trace["steps"])}
                   for rank, trace in report["traces"].items()},
        "settings": run_settings(Path(directory), report),
    }
