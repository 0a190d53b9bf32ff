"""One monitoring interval: a rank's figures packed for the gather, and rank 0's events from all ranks'.

Every rank packs its interval into one flat list of floats (NaN for a figure it does not know), so the
cross-rank exchange is a single small tensor per interval.  Rank 0 unpacks the ranks' rows and turns
them into the events, each taken over ranks and steps as :data:`EVENT_NAMES` documents (and
docs/live_metrics.md says for users).  Nothing here imports torch: the rules are plain arithmetic and are
tested without a process group.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import median
from typing import Dict, List, Optional, Sequence, Tuple

from ..._stages import slow_stage
from ..._straggler import step_straggler, straggler_threshold
from ...diagnosis.causes import CAUSE_CODES, Figures, decide_cause, step_cause

__all__ = ["EVENT_NAMES", "PIPELINE_EVENT_NAMES", "Event", "StepFigures", "interval_cause", "interval_events",
           "pack_interval", "packed_length", "pipeline_events", "staged_straggler"]

Event = Tuple[str, float, int]
"""``(name, value, global_step)``: what DeepSpeed's ``MonitorMaster.write_events`` takes, and every sink."""

EVENT_NAMES: Dict[str, str] = {
    "ds_profutils/step_ms": "median over the interval's steps of each rank's step time (forward start to the "
                            "end of engine.step()), the largest over ranks",
    "ds_profutils/iteration_ms": "median over the interval's steps of each rank's iteration time (end of the "
                                 "previous optimizer step to the end of this one), the largest over ranks",
    "ds_profutils/gap_ms": "median over the interval's steps of each rank's time outside forward, backward and "
                           "step (data loading, callbacks, logging), less its time waiting in the frameworks' own "
                           "torch.distributed collectives there (the records' gap_collective_ms), the largest over ranks",
    "ds_profutils/eval_ms": "of the gap, the time inside the engine's eval and no-grad forwards (an eval loop), each "
                            "rank's sum over the interval's steps, the largest over ranks; left out when zero on "
                            "every rank",
    "ds_profutils/save_ms": "of the gap, the time inside engine.save_checkpoint(), each rank's sum over the "
                            "interval's steps, the largest over ranks; left out when zero on every rank",
    "ds_profutils/tflops": "model TFLOP/s per rank: each rank's FLOPs of the interval over its wall time (the "
                           "sum of its iteration times), averaged over the ranks that count FLOPs",
    "ds_profutils/mfu": "tflops over the accelerator's peak TFLOP/s (a fraction, 0.041 = 4.1%)",
    "ds_profutils/tokens_per_s": "all ranks' tokens of the interval over its wall time (the slowest rank's)",
    "ds_profutils/exposed_wait_share": "time blocked in collectives and fetch waits over step time, summed over "
                                       "all ranks and the interval's steps (a fraction)",
    "ds_profutils/peak_allocated_gib": "highest peak allocated memory of any rank in any step of the interval, GiB",
    "ds_profutils/straggler_rank": "the rank the others waited for in more than half of the interval's steps "
                                   "(the report's step rule), -1 when none",
    "ds_profutils/straggler_cause": "why that rank was late, over the interval (ds_profutils.diagnosis.causes): "
                                    "0 none, 1 more_work, 2 input_pipeline, 3 compute, 4 communication, 5 unknown, "
                                    "6 eval_or_save",
}
"""Every event LiveMetrics sends, in the order sent, and over which ranks and steps it is taken.  An event
whose inputs are unknown (no FLOPs counted, no peak, no tokens, no memory figure) is left out."""
PIPELINE_EVENT_NAMES: Dict[str, str] = {
    "ds_profutils/bubble_share": "a pipeline's bubble (send/recv instructions and time outside instructions) over "
                                 "step time, summed over all ranks and the interval's steps (a fraction)",
    "ds_profutils/slowest_stage": "a pipeline's stage whose median compute over the interval is >= 1.25x the "
                                  "median stage's (docs/pipeline.md), -1 when none",
}
"""Sent after :data:`EVENT_NAMES` for a ``PipelineEngine`` only (its rows carry the stage figures)."""

_GIB = float(1 << 30)
_NAN = float("nan")


@dataclass
class StepFigures:
    """One optimizer step on this rank, as the recorder hands it to :meth:`LiveMetrics.step_finished`."""

    global_step: int
    step_ms: float  # forward start to end of engine.step(), all micro steps of the step
    iteration_ms: Optional[float]  # end of the previous optimizer step to end of this one (None for the first)
    gap_ms: Optional[float]  # iteration_ms minus the time inside forward/backward/step and the frameworks' collectives
    flops: Optional[int]  # model FLOPs of the step's micro steps (forward+backward), None if unknown
    tokens: Optional[int]
    samples: Optional[int]
    exposed_wait_ms: float  # time blocked in collectives/fetch waits
    collective_ms: float  # time inside collectives (incl. waiting for late peers), the frameworks' between steps too
    peak_allocated_bytes: Optional[int]
    # a PipelineEngine's stage and the step's compute and bubble (docs/pipeline.md); None for other engines
    pipe_stage: Optional[int] = None
    compute_ms: Optional[float] = None
    bubble_ms: Optional[float] = None
    # of gap_ms: the time inside the engine's eval and no-grad forwards, and inside engine.save_checkpoint()
    eval_ms: float = 0.0
    save_ms: float = 0.0


# Positions of the per-rank totals after the two per-step columns (step_ms, collective_ms).
_ITERATION, _GAP, _WALL, _FLOPS, _TOKENS, _WAIT, _STEP_SUM, _PEAK = range(8)
_TOTALS = 8
_PIPELINE_TOTALS = 3
# after the totals, a pipeline stage's: stage, median compute and bubble sum (NaN in every other engine's rows)
_STAGE, _COMPUTE, _BUBBLE = range(_TOTALS, _TOTALS + _PIPELINE_TOTALS)
_GAP_PARTS = 3
_UNKNOWN = CAUSE_CODES["unknown"]
# then the sums over the interval of the gap's eval and save times, and the median of the gap without them (the
# input pipeline's and host work's, what a cause weighs: a slow eval forward is no slow data loader)
_EVAL, _SAVE, _INPUT_GAP = range(_TOTALS + _PIPELINE_TOTALS, _TOTALS + _PIPELINE_TOTALS + _GAP_PARTS)


def packed_length(steps: int) -> int:
    """How many floats :func:`pack_interval` gives for an interval of ``steps`` steps (an empty row's length)."""
    return 2 * steps + _TOTALS + _PIPELINE_TOTALS + _GAP_PARTS


def _known_sum(values: Sequence[Optional[float]]) -> float:
    """The sum, or NaN when any value is unknown (a partial sum would pass for the whole)."""
    return _NAN if any(value is None for value in values) else float(sum(values))


def pack_interval(steps: Sequence[StepFigures]) -> List[float]:
    """This rank's interval as :func:`packed_length` floats: per step its step and collective times (the
    straggler rule needs each step across ranks), then its medians and sums, then a pipeline stage's figures,
    then the sums of the gap's eval and save times and the median gap without them; NaN where unknown (every row
    has one length, an empty row's included: the exchange gathers equal rows)."""
    iterations = [step.iteration_ms for step in steps if step.iteration_ms is not None]
    gaps = [step.gap_ms for step in steps if step.gap_ms is not None]
    input_gaps = [max(step.gap_ms - step.eval_ms - step.save_ms, 0.0) for step in steps if step.gap_ms is not None]
    peaks = [step.peak_allocated_bytes for step in steps if step.peak_allocated_bytes is not None]
    # the first step after attach has no iteration time: its step time is the best known part of it
    wall = sum(step.step_ms if step.iteration_ms is None else step.iteration_ms for step in steps)
    totals = [
        median(iterations) if iterations else _NAN,
        median(gaps) if gaps else _NAN,
        wall,
        _known_sum([step.flops for step in steps]),
        _known_sum([step.tokens for step in steps]),
        sum(step.exposed_wait_ms for step in steps),
        sum(step.step_ms for step in steps),
        max(peaks) if peaks else _NAN,
        *_pipeline_totals(steps),
        sum(step.eval_ms for step in steps),
        sum(step.save_ms for step in steps),
        median(input_gaps) if input_gaps else _NAN,
    ]
    return [step.step_ms for step in steps] + [step.collective_ms for step in steps] + totals


def _pipeline_totals(steps: Sequence[StepFigures]) -> List[float]:
    """A pipeline rank's stage, median compute and bubble sum over the interval (NaN where not a pipeline)."""
    if not steps or steps[-1].pipe_stage is None:
        return [_NAN] * _PIPELINE_TOTALS
    computes = [step.compute_ms for step in steps if step.compute_ms is not None]
    return [float(steps[-1].pipe_stage), median(computes) if computes else _NAN,
            sum(step.bubble_ms or 0.0 for step in steps)]


def pipeline_events(totals: Sequence[Sequence[float]]) -> Dict[str, Optional[float]]:
    """``bubble_share`` and ``slowest_stage`` from every rank's totals (none where no rank is a pipeline stage):
    each stage's compute is the median of its ranks' medians, slow as :func:`..._stages.slow_stage` says."""
    staged = [total for total in totals if len(total) > _STAGE and not math.isnan(total[_COMPUTE])]
    if not staged:
        return {}
    stage_computes: Dict[int, List[float]] = {}
    for total in staged:
        stage_computes.setdefault(int(total[_STAGE]), []).append(total[_COMPUTE])
    slowest = slow_stage({stage: median(values) for stage, values in stage_computes.items()})
    step_sum = sum(total[_STEP_SUM] for total in staged)
    return {"ds_profutils/bubble_share": sum(total[_BUBBLE] for total in staged) / step_sum if step_sum > 0 else None,
            "ds_profutils/slowest_stage": -1 if slowest is None else slowest}


def _largest(values: Sequence[float]) -> Optional[float]:
    known = [value for value in values if not math.isnan(value)]
    return max(known) if known else None


def interval_straggler(rows: Sequence[Sequence[float]], steps: int) -> int:
    """The rank that was the step straggler in more than half of the interval's steps, else -1."""
    counts = [0] * len(rows)
    for index in range(steps):
        straggler = step_straggler([row[steps + index] for row in rows], [row[index] for row in rows])
        if straggler is not None:
            counts[straggler] += 1
    most = max(range(len(rows)), key=counts.__getitem__)
    return most if 2 * counts[most] > steps else -1


def interval_cause(rows: Sequence[Sequence[float]], steps: int, straggler: int) -> int:
    """The straggler's cause code (:data:`~ds_profutils.diagnosis.causes.CAUSE_CODES`) from each rank's interval
    totals: busy and exposed wait per step, its gap median, FLOPs (else tokens) per step; 0 without a straggler.
    The live figures are host times, so communication is never named here."""
    if straggler < 0:
        return CAUSE_CODES[None]
    totals = [row[2 * steps:] for row in rows]
    work = next((column for column in (_FLOPS, _TOKENS) if not any(math.isnan(t[column]) for t in totals)), None)
    # a pipeline rank's own work is its compute (its sends and receives wait for the neighbour stage), as the report's
    figures = [Figures(busy_ms=(t[_STEP_SUM] - t[_WAIT]) / steps if math.isnan(t[_COMPUTE]) else t[_COMPUTE],
                       gap_ms=None if math.isnan(t[_INPUT_GAP]) else t[_INPUT_GAP],
                       work=None if work is None else t[work] / steps,
                       host_gap_ms=None if math.isnan(t[_GAP]) else t[_GAP])
               for t in totals]
    threshold = straggler_threshold([median(row[:steps]) for row in rows])
    cause, decided = decide_cause(figures[straggler], figures[:straggler] + figures[straggler + 1:], threshold)
    return CAUSE_CODES[step_cause(cause, decided)]  # as the report's cause_steps count it


def _stage_groups(rows: Sequence[Sequence[float]], steps: int) -> List[List[int]]:
    """The rows' indices by pipeline stage, one group where the rows carry no stage: ranks are compared within a
    stage only, as the report does (stages do different work, and wait for each other in p2p, not collectives)."""
    groups: Dict[float, List[int]] = {}
    for index, row in enumerate(rows):
        stage = row[2 * steps + _STAGE]
        groups.setdefault(-1.0 if math.isnan(stage) else stage, []).append(index)
    return list(groups.values())


def _straggler_and_cause(rows: Sequence[Sequence[float]], steps: int) -> Tuple[int, List[int], int]:
    """The interval's straggler (its row index, -1: none), tested within each pipeline stage's rows only
    (:func:`_stage_groups`), its stage's row indices and its cause code among them.  Where several stages name one,
    the first whose own figures say why it is late (a cause other than unknown): a rank that only waited in its sends
    and receives for a slow rank of its pipe, its own compute at its peers' pace, is late because of that rank."""
    first = None
    for members in _stage_groups(rows, steps):
        member_rows = [rows[index] for index in members]
        at = interval_straggler(member_rows, steps) if len(members) > 1 else -1
        if at >= 0:
            cause = interval_cause(member_rows, steps, at)
            if cause != _UNKNOWN:
                return members[at], members, cause
            first = first or (members[at], members, cause)
    return first or (-1, [], CAUSE_CODES[None])


def staged_straggler(rows: Sequence[Sequence[float]], steps: int) -> Tuple[int, List[int]]:
    """The interval's straggler (its row index, -1: none) and its stage's row indices (:func:`_straggler_and_cause`)."""
    straggler, members, _ = _straggler_and_cause(rows, steps)
    return straggler, members


def interval_events(rows: Sequence[Sequence[float]], steps: int, global_step: int,
                    peak_tflops: Optional[float]) -> List[Event]:
    """Rank 0's events for one interval of ``steps`` steps from every rank's packed row (row r = rank r)."""
    totals = [row[2 * steps:] for row in rows]
    figures: Dict[str, Optional[float]] = {
        "ds_profutils/step_ms": max(median(row[:steps]) for row in rows),
        "ds_profutils/iteration_ms": _largest([total[_ITERATION] for total in totals]),
        "ds_profutils/gap_ms": _largest([total[_GAP] for total in totals]),
        "ds_profutils/eval_ms": _largest([total[_EVAL] for total in totals]) or None,  # none: left out
        "ds_profutils/save_ms": _largest([total[_SAVE] for total in totals]) or None,
    }
    wall_s = max(total[_WALL] for total in totals) / 1e3
    rates = [total[_FLOPS] / (total[_WALL] / 1e3) / 1e12 for total in totals
             if not math.isnan(total[_FLOPS]) and total[_WALL] > 0]
    tflops = sum(rates) / len(rates) if rates else None
    figures["ds_profutils/tflops"] = tflops
    figures["ds_profutils/mfu"] = tflops / peak_tflops if tflops is not None and peak_tflops else None
    tokens = [total[_TOKENS] for total in totals]
    known_tokens = wall_s > 0 and not any(math.isnan(value) for value in tokens)
    figures["ds_profutils/tokens_per_s"] = sum(tokens) / wall_s if known_tokens else None
    step_sum = sum(total[_STEP_SUM] for total in totals)
    figures["ds_profutils/exposed_wait_share"] = (sum(total[_WAIT] for total in totals) / step_sum
                                                  if step_sum > 0 else None)
    peak = _largest([total[_PEAK] for total in totals])
    figures["ds_profutils/peak_allocated_gib"] = peak / _GIB if peak is not None else None
    straggler, _, cause = _straggler_and_cause(rows, steps)
    figures["ds_profutils/straggler_rank"], figures["ds_profutils/straggler_cause"] = straggler, cause
    figures.update(pipeline_events(totals))
    return [(name, value, global_step) for name, value in figures.items() if value is not None]
