"""One engine's joined step view (per global step and rank) and the rank the others wait for.

A rank slowed by anything outside the collectives (a data loader, a slow GPU, a sleep) does not wait:
its peers do, inside the next blocking collective or fetch.  So the straggler is not the rank with
the longest waits but the one with the *least* exposed wait in a step where the others waited
noticeably longer; their excess over that minimum is the time it cost them.  This follows
DeepSpeed's own comms straggler figure (latency minus the minimum across ranks).

The view is kept as rank-major arrays of doubles (NaN where a rank has no record of a step), 8 bytes
per rank, step and column, so 1024 ranks x 1000 steps stay in tens of MB.
"""
from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from statistics import median
from typing import Dict, List, Mapping, Optional, Sequence

from .records import FileRecords

__all__ = ["HOST_MAX_SHARE", "HOST_OVER_FAIR_SHARE", "STRAGGLER_MIN_SPREAD_MS", "STRAGGLER_OVERALL_SHARE",
           "STRAGGLER_STEP_SHARE", "Matrix", "StepView", "host_share_needed", "is_straggler", "step_view",
           "straggler_rule"]

STRAGGLER_MIN_SPREAD_MS = 2.0
"""A step has a straggler only when max - min exposed wait across ranks is at least this ..."""
STRAGGLER_STEP_SHARE = 0.10
"""... and at least this share of the step's median step time (noise is not a straggler)."""
STRAGGLER_OVERALL_SHARE = 0.5
"""A rank is flagged overall when it is the straggler in at least this share of the recorded train steps."""
HOST_OVER_FAIR_SHARE = 1.5
"""A host is flagged when its ranks are the step straggler this many times more often than its share of the
ranks would make them by chance (at least ``STRAGGLER_OVERALL_SHARE`` of the steps, at most ``HOST_MAX_SHARE``)."""
HOST_MAX_SHARE = 0.9


def host_share_needed(host_ranks: int, ranks: int) -> float:
    """The share of steps a host's ranks must be the straggler in for the host to be flagged: noise makes
    each rank the step straggler by chance, so a host of half the ranks gets about half the steps."""
    return max(STRAGGLER_OVERALL_SHARE, min(HOST_MAX_SHARE, HOST_OVER_FAIR_SHARE * host_ranks / ranks))


def straggler_rule() -> str:
    """The rule in words, with its thresholds, as the report prints it."""
    return (f"a step's straggler is the rank with the least exposed wait where the spread of exposed wait across "
            f"ranks (max - min) is >= max({STRAGGLER_MIN_SPREAD_MS:g} ms, {STRAGGLER_STEP_SHARE:.0%} of the step's "
            f"median step time); a rank is flagged STRAGGLER when it is the step straggler in >= "
            f"{STRAGGLER_OVERALL_SHARE:.0%} of the recorded train steps; with ranks on several hosts, a host is "
            f"flagged STRAGGLER HOST when its ranks are in >= {HOST_OVER_FAIR_SHARE:g}x its share of the ranks "
            f"(at least {STRAGGLER_OVERALL_SHARE:.0%}, at most {HOST_MAX_SHARE:.0%}) of them")


class Matrix:
    """ranks x steps doubles, rank-major; NaN where a rank has no value for a step."""

    def __init__(self, ranks: int, steps: int) -> None:
        self.ranks, self.steps = ranks, steps
        self.values = array("d", [math.nan]) * (ranks * steps)

    def rank_row(self, rank_index: int) -> memoryview:
        """One rank's values over the steps (a view, no copy)."""
        return memoryview(self.values)[rank_index * self.steps:(rank_index + 1) * self.steps]

    def step_column(self, step_index: int) -> array:
        """Every rank's value at one step (a copy)."""
        return self.values[step_index::self.steps]

    def rows(self) -> List[memoryview]:
        return [self.rank_row(index) for index in range(self.ranks)]

    def get(self, rank_index: int, step_index: int) -> Optional[float]:
        value = self.values[rank_index * self.steps + step_index]
        return None if math.isnan(value) else value


@dataclass
class StepView:
    """Per global step and rank: step time, fetch wait, other exposed (blocking collective) wait, exposed
    wait, busy time (step time - exposed wait) and the trace's step time; per step the straggler."""

    global_steps: List[int]
    ranks: List[int]
    step_ms: Matrix
    fetch_wait_ms: Matrix
    collective_wait_ms: Matrix
    exposed_wait_ms: Matrix
    busy_ms: Matrix
    trace_step_ms: Matrix
    peak_allocated_bytes: Matrix  # NaN where the records carry no "memory"
    straggler: List[Optional[int]] = field(default_factory=list)
    spread_ms: List[Optional[float]] = field(default_factory=list)
    threshold_ms: List[Optional[float]] = field(default_factory=list)
    straggler_steps: Dict[int, int] = field(default_factory=dict)
    attributed_ms: Dict[int, float] = field(default_factory=dict)  # others' excess wait in its straggler steps
    waited_ms: Dict[int, float] = field(default_factory=dict)  # its own excess wait in others' straggler steps

    def columns(self) -> Dict[str, Matrix]:
        return {"step_ms": self.step_ms, "fetch_wait_ms": self.fetch_wait_ms,
                "collective_wait_ms": self.collective_wait_ms, "exposed_wait_ms": self.exposed_wait_ms,
                "busy_ms": self.busy_ms, "trace_step_ms": self.trace_step_ms}


def _fill(matrix: Matrix, rank_index: int, positions: Optional[Sequence[int]], values: array) -> None:
    """One rank's values into its row: a slice copy when it has every step (``positions`` None)."""
    if positions is None:
        start = rank_index * matrix.steps
        matrix.values[start:start + matrix.steps] = values
        return
    row = rank_index * matrix.steps
    for position, value in zip(positions, values):
        matrix.values[row + position] = value


def step_view(files: Sequence[FileRecords], trace_steps: Mapping[int, Mapping[int, float]]) -> StepView:
    """The view over the train records of one engine's files (one per rank), with each rank's trace step
    times (``{rank: {global step: ms}}``) where a trace numbers its steps globally."""
    files = sorted((f for f in files if f.global_steps), key=lambda f: f.rank)
    all_steps = sorted(set().union(*(f.global_steps for f in files)))
    everything = array("q", all_steps)
    index = {step: position for position, step in enumerate(all_steps)}
    ranks, steps = len(files), len(all_steps)
    view = StepView(all_steps, [f.rank for f in files], *(Matrix(ranks, steps) for _ in range(7)))
    for rank_index, records in enumerate(files):
        positions = None if records.global_steps == everything else [index[s] for s in records.global_steps]
        exposed = array("d", map(float.__add__, records.fetch_wait_ms, records.collective_wait_ms))
        busy = array("d", map(float.__sub__, records.step_ms, exposed))
        for matrix, values in ((view.step_ms, records.step_ms), (view.fetch_wait_ms, records.fetch_wait_ms),
                               (view.collective_wait_ms, records.collective_wait_ms),
                               (view.exposed_wait_ms, exposed), (view.busy_ms, busy),
                               (view.peak_allocated_bytes, records.peak_allocated_bytes)):
            _fill(matrix, rank_index, positions, values)
        for step, ms in trace_steps.get(records.rank, {}).items():
            if step in index:
                view.trace_step_ms.values[rank_index * steps + index[step]] = ms
    _find_stragglers(view)
    return view


def _find_stragglers(view: StepView) -> None:
    """Per step, the straggler (if the spread clears the threshold), and who it cost what."""
    attributed = [0.0] * len(view.ranks)
    waited = [0.0] * len(view.ranks)
    counts = [0] * len(view.ranks)
    for step_index in range(len(view.global_steps)):
        exposed = view.exposed_wait_ms.step_column(step_index)
        present = [(value, rank_index) for rank_index, value in enumerate(exposed) if value == value]
        if len(present) < 2:
            view.straggler.append(None)
            view.spread_ms.append(None)
            view.threshold_ms.append(None)
            continue
        least, least_rank = min(present)
        spread = max(present)[0] - least
        step_times = [value for value in view.step_ms.step_column(step_index) if value == value]
        threshold = max(STRAGGLER_MIN_SPREAD_MS, STRAGGLER_STEP_SHARE * median(step_times))
        view.spread_ms.append(spread)
        view.threshold_ms.append(threshold)
        if spread < threshold:
            view.straggler.append(None)
            continue
        view.straggler.append(view.ranks[least_rank])
        counts[least_rank] += 1
        for value, rank_index in present:
            waited[rank_index] += value - least
        attributed[least_rank] += sum(value for value, _ in present) - least * len(present)
    view.straggler_steps = dict(zip(view.ranks, counts))
    view.attributed_ms = dict(zip(view.ranks, attributed))
    view.waited_ms = dict(zip(view.ranks, waited))


def is_straggler(view: StepView, rank: int) -> bool:
    """Flagged overall: the step straggler in at least half (``STRAGGLER_OVERALL_SHARE``) of the train steps."""
    steps = len(view.global_steps)
    return steps > 0 and view.straggler_steps.get(rank, 0) >= STRAGGLER_OVERALL_SHARE * steps
