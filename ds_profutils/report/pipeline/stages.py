"""A pipeline-parallel engine's stages: compute, send/recv and bubble per stage, against the schedule's ideal.

Read from the records of a ``PipelineEngine`` (``pipe_stage`` on each, docs/pipeline.md).  Stages do different
work, so they are compared by compute only, and only ranks of one stage are compared by the straggler test
(:func:`staged_view`: each stage's data-parallel group apart).  Torch-free, as all of report/.
"""
from __future__ import annotations

from collections import defaultdict
from statistics import median
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ..._stages import SLOW_STAGE_RATIO, SLOW_STAGE_STEPS, slow_stage
from ..._straggler import straggler_threshold
from ..records import FileRecords
from ..steps import StepView, own_gap_ms, step_view, tflops
from ...units import flops_rate, rank_ranges, share
from ..tables import percent, table, wrap

__all__ = ["SLOW_INPUT_SHARE", "ideal_bubble_share", "pipeline_lines", "pipeline_report", "staged_view"]

SLOW_INPUT_SHARE = 0.2
"""A stage whose micro batches' loading (its ``LoadMicroBatch`` instructions: the data iterator's ``next()`` and the
copy to the device) takes at least this share of its step median holds every stage back by its input: the others
wait for it in their receives, where no compute or collective shows it.  A data iterator that keeps up takes a few
percent (a tensor handed over)."""


def ideal_bubble_share(stages: int, micro_batches: int) -> Optional[float]:
    """The idle share of DeepSpeed's 1F1B ``TrainSchedule`` with equal stages and free transfers: (p-1)/(m+p-1)."""
    if stages < 1 or micro_batches < 1:
        return None
    return (stages - 1) / (micro_batches + stages - 1)


def _median(values: Sequence[float]) -> Optional[float]:
    known = [value for value in values if value == value]
    return median(known) if known else None


def _stages(files: Sequence[FileRecords]) -> Dict[int, List[FileRecords]]:
    stages: Dict[int, List[FileRecords]] = defaultdict(list)
    for records in files:
        if records.pipe_stage is not None:
            stages[records.pipe_stage].append(records)
    return dict(sorted(stages.items()))


def _stage_by_step(stage_files: Sequence[FileRecords], column: str) -> Dict[int, float]:
    """Per global step, the median over the stage's ranks of one per-step figure (``compute_ms``, ``bubble_ms``)."""
    by_step: Dict[int, List[float]] = defaultdict(list)
    for records in stage_files:
        for step, value in zip(records.global_steps, getattr(records, column)):
            if value == value:
                by_step[step].append(value)
    return {step: median(values) for step, values in by_step.items()}


def _per_step(stages: Mapping[int, Sequence[FileRecords]]) -> Dict[str, Any]:
    """Per train step (``global_steps``), each stage's compute and bubble (the median over its ranks; None where
    it has no record): the series ``ds-profutils diff`` compares stage by stage."""
    steps = sorted(set().union(*(records.global_steps for files in stages.values() for records in files)))
    per_step: Dict[str, Any] = {"global_steps": steps}
    for column in ("compute_ms", "bubble_ms"):
        by_stage = {stage: _stage_by_step(files, column) for stage, files in stages.items()}
        per_step[column] = {str(stage): [values.get(step) for step in steps] for stage, values in by_stage.items()}
    return per_step


def _slowest_stage(stages: Mapping[int, Sequence[FileRecords]]) -> Optional[int]:
    """The stage slow (:func:`ds_profutils._stages.slow_stage`) in at least ``SLOW_STAGE_STEPS`` of the steps all
    stages have."""
    computes = {stage: _stage_by_step(files, "compute_ms") for stage, files in stages.items()}
    common = set.intersection(*(set(steps) for steps in computes.values())) if computes else set()
    slow: Dict[int, int] = defaultdict(int)
    for step in common:
        stage = slow_stage({stage: steps[step] for stage, steps in computes.items()})
        if stage is not None:
            slow[stage] += 1
    named = [stage for stage, count in slow.items() if count >= SLOW_STAGE_STEPS * len(common)]
    return named[0] if common and named else None


def _stage_throughput(stage_files: Sequence[FileRecords]) -> Dict[str, Optional[float]]:
    """The stage's model TFLOP/s per rank (its layers' FLOPs over the iteration) and MFU, medians over its ranks'
    steps; None where the records have no FLOPs (or no peak, for MFU)."""
    achieved = _median([value for records in stage_files for value in tflops(records)])
    peak = next((records.peak_tflops for records in stage_files if records.peak_tflops), None)
    return {"tflops_median": achieved, "mfu_median": achieved / peak if achieved is not None and peak else None}


def pipeline_report(files: Sequence[FileRecords]) -> Optional[Dict[str, Any]]:
    """``engines.{name}.pipeline``: per stage (keys "0", "1", ...) its ranks and medians over its ranks' steps;
    the ideal bubble share, the stage imbalance and the slowest stage.  None for an engine without stages."""
    stages = _stages(files)
    if not stages:
        return None
    table_rows: Dict[str, Dict[str, Any]] = {}
    for stage, stage_files in stages.items():
        steps = [row for records in stage_files for row in zip(records.step_ms, records.compute_ms, records.p2p_ms,
                                                                records.bubble_ms, records.load_ms, records.gap_ms)]
        table_rows[str(stage)] = {
            "ranks": sorted(records.rank for records in stage_files),
            "steps": len(steps),
            "step_ms_median": _median([row[0] for row in steps]),
            "compute_ms_median": _median([row[1] for row in steps]),
            "p2p_ms_median": _median([row[2] for row in steps]),
            "bubble_ms_median": _median([row[3] for row in steps]),
            "bubble_share_median": _median([row[3] / row[0] for row in steps if row[0] > 0]),
            "load_ms_median": _median([row[4] for row in steps]),
            "gap_ms_median": _median([row[5] for row in steps]),
            **_stage_throughput(stage_files),
        }
    computes = {int(stage): row["compute_ms_median"] for stage, row in table_rows.items()
                if row["compute_ms_median"] is not None}
    middle = median(computes.values()) if computes else None
    first = next(iter(stages.values()))[0]
    return {
        "stages": table_rows,
        "pipe_stages": first.pipe_stages,
        "micro_batches": first.micro_batches,
        "ideal_bubble_share": ideal_bubble_share(first.pipe_stages or 0, first.micro_batches or 0),
        "stage_imbalance": max(computes.values()) / middle if middle else None,
        "slowest_stage": _slowest_stage(stages),
        "slow_stage_rule": {"ratio": SLOW_STAGE_RATIO, "steps_share": SLOW_STAGE_STEPS},
        **_slow_input(table_rows, files),
        "per_step": _per_step(stages),
    }


def _slow_input(stages: Mapping[str, Mapping[str, Any]], files: Sequence[FileRecords]) -> Dict[str, Any]:
    """What holds a pipeline back by its input, which its stages' compute does not show: ``slow_input_stage``, the
    stage whose loading is the largest share of its step, at least :data:`SLOW_INPUT_SHARE` (None otherwise), with
    that ``load_share``; and ``gap_stands_out``, the ranks whose median own gap between batches (the program's time
    outside ``train_batch()``, comparable across stages, less its collectives, eval batches and saves there: as a
    straggler's own gap) exceeds the other ranks' median by a step straggler's threshold (``gap_threshold_ms``), with
    their medians."""
    shares = {int(stage): row["load_ms_median"] / row["step_ms_median"] for stage, row in stages.items()
              if row["load_ms_median"] is not None and row["step_ms_median"]}
    slowest = max(shares, key=shares.__getitem__, default=None)
    if slowest is not None and shares[slowest] < SLOW_INPUT_SHARE:
        slowest = None
    threshold = straggler_threshold([row["step_ms_median"] for row in stages.values()
                                     if row["step_ms_median"] is not None])
    gaps = {records.rank: _median(own_gap_ms(records)) for records in files}
    standing_out = {}
    for rank, gap in sorted(gaps.items()):
        others = [other for peer, other in gaps.items() if peer != rank and other is not None]
        if gap is not None and others and gap - median(others) >= threshold:
            standing_out[rank] = gap
    return {"slow_input_stage": slowest, "load_share": shares.get(slowest) if slowest is not None else None,
            "gap_stands_out": standing_out, "gap_threshold_ms": threshold}


def staged_view(files: Sequence[FileRecords], trace_steps: Mapping[int, Mapping[int, float]]) -> StepView:
    """:func:`.steps.step_view`, with the straggler test run within each pipeline stage's ranks only (stages do
    different work: a slower stage is no straggler).  Without stages it is ``step_view`` itself."""
    view = step_view(files, trace_steps)
    stages = _stages(files)
    if len(stages) < 2:
        return view
    index = {step: position for position, step in enumerate(view.global_steps)}
    steps = len(view.global_steps)
    view.straggler, view.spread_ms, view.threshold_ms = [None] * steps, [None] * steps, [None] * steps
    view.straggler_steps, view.attributed_ms, view.waited_ms, view.p_values = {}, {}, {}, {}
    view.held_steps, view.held_p_values, view.straggler_step_numbers, view.straggler_step_thresholds = {}, {}, {}, {}
    view.tested_steps = 0
    for stage_files in stages.values():
        stage_view = step_view(stage_files, trace_steps)
        for step, straggler, spread, threshold in zip(stage_view.global_steps, stage_view.straggler,
                                                      stage_view.spread_ms, stage_view.threshold_ms):
            at = index[step]
            if spread is not None and (view.spread_ms[at] is None or spread > view.spread_ms[at]):
                view.straggler[at], view.spread_ms[at], view.threshold_ms[at] = straggler, spread, threshold
        for name in ("straggler_steps", "attributed_ms", "waited_ms", "p_values", "held_steps", "held_p_values",
                     "straggler_step_numbers", "straggler_step_thresholds"):  # each stage's own (the merged per-step
            # columns keep the stage with the larger spread)
            getattr(view, name).update(getattr(stage_view, name))
        view.tested_steps = max(view.tested_steps, stage_view.tested_steps)
    view.stage_of = {records.rank: stage for stage, stage_files in stages.items() for records in stage_files}
    return view


def pipeline_lines(pipeline: Optional[Mapping[str, Any]]) -> List[str]:
    """The stage table of the text report (nothing for an engine without stages)."""
    if pipeline is None:
        return []
    stages = pipeline["stages"].values()
    counted = any(row["tflops_median"] is not None for row in stages)
    with_peak = any(row["mfu_median"] is not None for row in stages)
    rows = [(stage, rank_ranges(row["ranks"]), row["step_ms_median"], row["compute_ms_median"], row["p2p_ms_median"],
             row["bubble_ms_median"], percent(row["bubble_share_median"]),
             *((flops_rate(row["tflops_median"]), ) if counted else ()), *((share(row["mfu_median"]), ) if with_peak else ()))
            for stage, row in pipeline["stages"].items()]
    slowest = pipeline["slowest_stage"]
    verdict = (f"SLOW STAGE: stage {slowest}" if slowest is not None else "no stage's compute stands out")
    imbalance = pipeline["stage_imbalance"]
    return ["", *wrap(f"Pipeline stages ({pipeline['pipe_stages']} stages, {pipeline['micro_batches']} micro batches; "
                      f"median per train step, ms; compute = forward and backward with the loss; p2p = sends and "
                      f"receives, waiting for the neighbour stage included; bubble = p2p + time outside the "
                      f"instructions; FLOP/s = the stage's layers' FLOPs over the iteration; ideal bubble share of "
                      f"the 1F1B schedule (p-1)/(m+p-1) = "
                      f"{percent(pipeline['ideal_bubble_share'])}): {verdict}"
                      + (f", slowest stage's compute {imbalance:.2f}x the median stage's" if imbalance else "")),
            *table(("stage", "ranks", "step", "compute", "p2p", "bubble", "bubble share",
                    *(("FLOP/s", ) if counted else ()), *(("MFU", ) if with_peak else ())), rows),
            *_input_lines(pipeline)]


def _input_lines(pipeline: Mapping[str, Any]) -> List[str]:
    """What holds the pipeline back by its input (:func:`_slow_input`), in words: each stage waits for it in its
    receives, so no stage's compute and no straggler shows it."""
    lines = []
    stage = pipeline["slow_input_stage"]
    if stage is not None:
        row = pipeline["stages"][str(stage)]
        lines += wrap(f"SLOW INPUT: stage {stage} loads its micro batches (LoadMicroBatch: the data iterator) for "
                      f"{row['load_ms_median']:,.1f} ms of its {row['step_ms_median']:,.1f} ms step "
                      f"({percent(pipeline['load_share'])}); every stage waits for it in its receives: a slow input "
                      f"pipeline (data loader workers, pinned memory, prefetch), not a slow stage")
    for rank, gap in pipeline["gap_stands_out"].items():
        lines += wrap(f"SLOW BETWEEN BATCHES: rank {rank} spends {gap:,.1f} ms between train_batch() calls (its own "
                      f"time: less collectives, eval batches and saves there), over the other ranks' median by "
                      f"{pipeline['gap_threshold_ms']:,.1f} ms or more; the other stages wait for it in their "
                      f"receives: a slow input pipeline or host work between steps")
    return lines
