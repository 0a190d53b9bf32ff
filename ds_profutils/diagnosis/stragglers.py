"""Work per rank and the cause of each straggler, over one engine's step view.

The report's step view (:class:`ds_profutils.report.steps.StepView`) holds, per rank and global step, the
busy time, the gap between steps, the exposed wait and the work of the step in one unit; this module reads
it (duck-typed: the view's matrices give ``rank_row`` and ``step_column``) and applies
:func:`.causes.decide_cause` to each named straggler's medians, and to every step straggler's step.
"""
from __future__ import annotations

from collections import Counter
from statistics import median
from typing import Any, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

from .causes import Figures, decide_cause, step_cause

__all__ = ["WORK_UNITS", "rank_causes", "rank_work", "work_imbalance", "work_unit"]

WORK_UNITS: Tuple[Tuple[str, str, float], ...] = (("flops", "gflop", 1e-9), ("tokens", "token", 1.0),
                                                  ("samples", "sample", 1.0))
"""(record field, unit, scale) in the order of preference: counted FLOPs follow attention's growth with sequence
length, tokens do not; samples know nothing of length."""


class _Rows(Protocol):
    def rank_row(self, rank_index: int) -> Sequence[float]: ...

    def step_column(self, step_index: int) -> Sequence[float]: ...


class _View(Protocol):
    ranks: List[int]
    busy_ms: _Rows
    own_busy_ms: _Rows  # busy time, or a pipeline rank's compute: what a cause weighs
    own_gap_ms: _Rows
    host_gap_ms: _Rows
    work: _Rows
    exposed_wait_ms: _Rows
    global_steps: List[int]
    straggler: List[Optional[int]]
    straggler_step_numbers: Mapping[int, List[int]]  # per rank, the global steps it was the step straggler of
    straggler_step_thresholds: Mapping[int, List[float]]  # and their thresholds (a pipeline stage's own)
    threshold_ms: List[Optional[float]]
    stage_of: Mapping[int, int]  # a pipeline's ranks: their stage (empty: one group)


def work_unit(recorded: Mapping[str, bool]) -> Optional[Tuple[str, str, float]]:
    """The first of :data:`WORK_UNITS` that every rank recorded (``recorded``: field -> every rank has it)."""
    return next((unit for unit in WORK_UNITS if recorded.get(unit[0])), None)


def _median(values: Sequence[float]) -> Optional[float]:
    present = [value for value in values if value == value]
    return median(present) if present else None


def rank_work(view: _View) -> Dict[int, Dict[str, Optional[float]]]:
    """Per rank: the median work per step and the median busy time per unit of work (None: no work recorded)."""
    table = {}
    for index, rank in enumerate(view.ranks):
        work, busy = view.work.rank_row(index), view.busy_ms.rank_row(index)
        table[rank] = {"work_median": _median(work),
                       "busy_ms_per_unit_median": _median([b / w if w > 0 else float("nan")
                                                           for b, w in zip(busy, work)])}
    return table


def work_imbalance(view: _View) -> Optional[float]:
    """The most work over the least across ranks in one step, within each pipeline stage (``stage_of``; empty: one
    group), its median over the steps; the largest of the stages' (None: no step with two ranks' work).  Per step:
    batches of varying length draw each rank's work anew every step, an imbalance the ranks' medians (equal where
    every rank draws alike) hide, and one every step makes the others wait for."""
    groups: Dict[Optional[int], List[int]] = {}
    for index, rank in enumerate(view.ranks):
        groups.setdefault(view.stage_of.get(rank), []).append(index)
    stage_ratios = []
    for members in groups.values():
        ratios = []
        for step_index in range(len(view.straggler)):
            column = view.work.step_column(step_index)
            work = [column[index] for index in members if column[index] > 0]  # NaN compares False: left out
            if len(work) > 1:
                ratios.append(max(work) / min(work))
        if ratios:
            stage_ratios.append(median(ratios))
    return max(stage_ratios) if stage_ratios else None


def _none(value: float) -> Optional[float]:
    return None if value != value else value


def _step_figures(view: _View, step_index: int) -> List[Figures]:
    columns = (view.own_busy_ms, view.own_gap_ms, view.work, view.exposed_wait_ms, view.host_gap_ms)
    values = [column.step_column(step_index) for column in columns]
    return [Figures(*(_none(column[index]) for column in values)) for index in range(len(view.ranks))]


def _peers(view: _View, at: int) -> List[int]:
    """The indices of the ranks a rank is compared with: the others of its pipeline stage (stages do different
    work), every other rank without stages."""
    stage = view.stage_of.get(view.ranks[at])
    return [index for index, rank in enumerate(view.ranks) if index != at and view.stage_of.get(rank) == stage]


def rank_causes(view: _View, named: Sequence[int], device_clock: bool = False) -> Dict[int, Dict[str, Any]]:
    """Per rank: ``cause`` and ``cause_figures`` (a named straggler's, from its medians over the run, against the
    ranks it is compared with; None for a rank not named) and ``cause_steps``, the cause of each step it was the
    step straggler of, counted."""
    medians = [Figures(*(_median(column.rank_row(index))
                         for column in (view.own_busy_ms, view.own_gap_ms, view.work, view.exposed_wait_ms,
                                        view.host_gap_ms)))
               for index in range(len(view.ranks))]
    thresholds = [value for value in view.threshold_ms if value is not None]
    threshold = median(thresholds) if thresholds else None
    steps: Dict[int, Counter] = {rank: Counter() for rank in view.ranks}
    position = {step: step_index for step_index, step in enumerate(view.global_steps)}
    for late, straggled in view.straggler_step_numbers.items():  # a pipeline's: each stage's own stragglers
        at = view.ranks.index(late)
        for step, step_threshold in zip(straggled, view.straggler_step_thresholds[late]):
            figures = _step_figures(view, position[step])
            cause, decided = decide_cause(figures[at], [figures[peer] for peer in _peers(view, at)], step_threshold,
                                          device_clock)
            steps[late][step_cause(cause, decided)] += 1
    table = {}
    for index, rank in enumerate(view.ranks):
        cause = figures = None
        # a pipeline rank's own stage's threshold (the merged view's per step is the larger spread's stage's)
        own = view.straggler_step_thresholds.get(rank) if view.stage_of else None
        rank_threshold = median(own) if own else threshold
        if rank in named and rank_threshold is not None:
            cause, figures = decide_cause(medians[index], [medians[peer] for peer in _peers(view, index)],
                                          rank_threshold, device_clock)
        table[rank] = {"cause": cause, "cause_figures": figures, "cause_steps": dict(steps[rank])}
    return table
