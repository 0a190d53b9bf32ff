"""What every rank decides about captures from an interval's exchanged rows: the same pure function of the
same rows on every rank (shared/DESIGN.md, "The exchange goes both ways"), so no rank decides for the others.

Each row carries, after the rank's packed interval (:func:`..live.interval.pack_interval`), the
:data:`COLUMNS` capture columns: on rank 0's row the request it took from ``capture_request.json`` this
interval (its number, steps, how the ranks are chosen, the rank mask), and on every row the first step of
the last capture whose trace this rank wrote (so rank 0's manifest says ``done`` when every chosen rank
wrote).  Nothing here imports torch.

What fires an anomaly capture is stricter than the live straggler figure (``ds_profutils/straggler_rank``, the
report's 10% step rule, unchanged): a capture costs the job a trace, so the straggler must hold the others back
by a share of the step, steadily, for two intervals in a row (:data:`ANOMALY_LATE_SHARE`).
"""
from __future__ import annotations

import math
from bisect import insort
from dataclasses import dataclass, field
from statistics import median
from typing import Any, Dict, List, Optional, Sequence, Union

from ..._straggler import straggler_threshold
from ...config.models import MAX_LISTED_RANK
from ..live.decisions import known_rows
from ..live.interval import staged_straggler

__all__ = ["ANOMALY_LATE_SHARE", "COLUMNS", "CaptureDecider", "Plan", "Request", "late_steps",
           "request_columns", "suspects"]

COLUMNS = 5
"""Capture columns per row: request number (0: none), steps, ranks mode, rank mask, last written capture."""
ANOMALY_LATE_SHARE = 0.25
"""A straggler fires a capture only where, in more than half of the interval's steps (in each of the two
intervals), it reached the step's collectives at least this share of the step's median time after the
next-latest rank: every other rank waited that long for it (and at least ``STRAGGLER_MIN_SPREAD_MS``).

Why: the live figure's rule takes the spread to the rank that waited most, over 10% of the step; on shared
cores the scheduler staggers the ranks, and that spread clears 10% with no rank holding the others back.
Measured in four runs of test_capture_launcher's 4-rank jobs on a loaded host (8 or 12 gloo ranks on 2
cores beside a benchmark, steps of about 40 ms): in the 12 intervals where that rule named a rank of an even job,
it was ahead of the next-latest by a median 0.3-2.8 ms (at most 7% of the step), and 17 of 950 steps (2%) had a
rank 25% ahead.  A rank slowed by 60 ms from step 40 was ahead by a median 48-61 ms, 31-64% of the step, in each
of 108 intervals; 8 of its 540 steps fell below 25%.  A quarter of the step sits well clear of both: a rank the
others wait a quarter of a step for, step after step."""
_SUSPECTS, _ALL, _LIST = 0, 1, 2


@dataclass(frozen=True)
class Request:
    """One ``ds-profutils capture`` request as rank 0 took it; ``number`` counts this job's requests."""

    number: int
    steps: int
    ranks: Union[str, List[int], None]  # "suspects", None (every rank) or global ranks
    request_id: str = ""
    requested_at: Optional[float] = None


@dataclass
class Plan:
    """A decided capture: every rank holds the same one, decided from the same rows."""

    reason: str  # "request", "straggler" or "step_jump"
    steps: int
    ranks: List[int]  # global ranks that trace
    why: Dict[str, str]  # why each rank was chosen, by rank
    figures: Dict[str, Any]  # what fired it
    first_step: int  # S: the first step every rank reaches after every rank holds the decision
    request_number: int = 0


def request_columns(request: Optional[Request], wrote: int) -> List[float]:
    """A row's capture columns: ``request`` (rank 0's, this interval; else none) and ``wrote``, the first step
    of the last capture this rank wrote (-1: none)."""
    if request is None:
        return [0.0, 0.0, 0.0, 0.0, float(wrote)]
    if request.ranks == "suspects":
        mode, mask = _SUSPECTS, 0
    elif request.ranks is None:
        mode, mask = _ALL, 0
    else:
        mode, mask = _LIST, sum(1 << rank for rank in request.ranks if rank <= MAX_LISTED_RANK)
    return [float(request.number), float(request.steps), float(mode), float(mask), float(wrote)]


def _arrivals(rows: Sequence[Sequence[float]], steps: int) -> List[float]:
    """Each row's arrival figure: its time inside collectives over the interval (the late rank waits least)."""
    return [sum(row[steps:2 * steps]) for row in rows]


def suspects(rows: Sequence[Sequence[float]], steps: int, ranks: Sequence[int]) -> Dict[int, str]:
    """The ranks that matter, by global rank with why: the straggler (else the slowest rank, the least arrival
    figure), the rank that waited most for it, and one median rank; at most 3.  ``rows`` are the rows with
    figures, ``ranks`` their global ranks."""
    if not rows:
        return {}
    arrivals = _arrivals(rows, steps)
    order = sorted(range(len(rows)), key=lambda index: (arrivals[index], index))
    straggler, _ = staged_straggler(rows, steps)
    chosen: Dict[int, str] = {}
    if straggler >= 0:
        chosen[ranks[straggler]] = "straggler: the others waited for it in most of the interval's steps"
    else:
        chosen[ranks[order[0]]] = "slowest: least time waiting in collectives over the interval"
    rest = [index for index in order if ranks[index] not in chosen]
    if rest:
        chosen[ranks[rest[-1]]] = "waited most: most time waiting in collectives over the interval"
        rest = rest[:-1]
    if rest:
        chosen[ranks[rest[len(rest) // 2]]] = "median: for comparison"
    return chosen


def _sorted_median(values: Sequence[float]) -> float:
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def late_steps(rows: Sequence[Sequence[float]], steps: int, straggler: int) -> List[float]:
    """In each step of the interval where ``straggler`` (a row index) was clearly late, how long after the
    next-latest rank it reached the collectives, in ms: the least time any other rank spent inside them less its own,
    where that is at least ``max(STRAGGLER_MIN_SPREAD_MS, ANOMALY_LATE_SHARE * the step's median step time)``.
    Ranks without the step's figure (NaN) are left out, as the step rule leaves them; a step where the straggler or
    every other rank lacks it is not late."""
    late = []
    for index in range(steps):
        own = rows[straggler][steps + index]
        others = [row[steps + index] for position, row in enumerate(rows)
                  if position != straggler and not math.isnan(row[steps + index])]
        if math.isnan(own) or not others:
            continue
        ahead = min(others) - own
        if ahead >= straggler_threshold([row[index] for row in rows], ANOMALY_LATE_SHARE):
            late.append(ahead)
    return late


@dataclass
class CaptureDecider:
    """The capture decisions of one engine, fed every exchanged interval in order (the same on every rank).

    ``settings`` is the ``"trace_capture"`` section; ``ranks`` the group's global ranks (row r = ranks[r]).
    """

    settings: Any
    ranks: List[int]
    made: int = 0  # captures decided (max_captures counts every capture)
    busy_until: int = -1  # the last step of the latest capture
    _straggler: int = -1  # the last interval's clearly late straggler (it must last two intervals, not one hiccup)
    _jumped: bool = False  # the last interval's slowest median step was a jump
    _step_history: List[float] = field(default_factory=list)  # each earlier interval's slowest median step, sorted

    def decide(self, index: int, rows: Sequence[Sequence[float]], columns: Sequence[Sequence[float]], steps: int,
               global_step: int, lag: int) -> Union[Plan, str, None]:
        """The capture exchange ``index``'s rows decide (a :class:`Plan`), a refusal's reason (a string) for a
        request that cannot be met, or None.  ``global_step`` is the interval's last step, ``lag`` how many
        exchanges later every rank holds these rows (the boundary ``lag`` intervals on, where a rank whose copy
        is not read yet waits for it): the capture starts at the step after that boundary.  The decision
        depends on the rows alone (not on when a rank read them), so every rank takes the same."""
        first_step = global_step + lag * steps + 1
        known = known_rows(rows)
        figures = [list(rows[position]) for position in known]
        ranks = [self.ranks[position] for position in known]
        anomaly = self._anomaly(figures, steps, ranks) if self.settings.on_anomaly else None
        number = int(columns[0][0]) if columns and not math.isnan(columns[0][0]) else 0
        if number > 0:
            if global_step < self.busy_until:
                return f"a capture is running (steps up to {self.busy_until}); ask again once it is written"
            return self._request(number, columns[0], figures, steps, ranks, first_step)
        if anomaly is None or global_step < self.busy_until:
            return None
        if self.made >= self.settings.max_captures:
            return None
        if self.made and global_step < self.busy_until + self.settings.cooldown_steps:
            return None
        reason, fired = anomaly
        return self._plan(reason, self.settings.steps, suspects(figures, steps, ranks), fired, first_step)

    def _request(self, number: int, column: Sequence[float], figures: List[List[float]], steps: int,
                 ranks: List[int], first_step: int) -> Union[Plan, str]:
        if self.made >= self.settings.max_captures:
            return f"trace_capture.max_captures ({self.settings.max_captures}) captures were made already"
        mode, mask = int(column[2]), int(column[3])
        if mode == _ALL:
            why = {rank: "asked for: every rank" for rank in self.ranks}
        elif mode == _LIST:
            why = {rank: "asked for" for rank in self.ranks if rank <= MAX_LISTED_RANK and mask >> rank & 1}
        else:
            why = suspects(figures, steps, ranks) or {self.ranks[0]: "no figures this interval: rank 0"}
        if not why:
            return "none of the ranks asked for is in this engine's group"
        return self._plan("request", int(column[1]), why, {}, first_step, number)

    def _plan(self, reason: str, steps: int, why: Dict[int, str], fired: Dict[str, Any], first_step: int,
              request_number: int = 0) -> Plan:
        self.made += 1
        self.busy_until = first_step + steps - 1
        return Plan(reason, steps, sorted(why), {str(rank): text for rank, text in sorted(why.items())}, fired,
                    first_step, request_number)

    def _anomaly(self, rows: List[List[float]], steps: int, ranks: List[int]) -> Optional[tuple]:
        """("straggler" | "step_jump", figures) when this interval's rows show one, else None; keeps the
        history either rule needs (so it runs on every interval while anomaly captures are on).  A straggler counts
        only when it was clearly late (:func:`late_steps`) in more than half of the interval's steps."""
        if not rows:
            return None
        straggler, stage = staged_straggler(rows, steps)  # late against its own stage's ranks only
        late = late_steps([rows[index] for index in stage], steps, stage.index(straggler)) if straggler >= 0 else []
        if 2 * len(late) <= steps:
            straggler = -1
        sustained = straggler >= 0 and straggler == self._straggler
        self._straggler = straggler
        slowest = max(median(row[:steps]) for row in rows)
        history = self._step_history  # sorted: the run's median so far at once, however long the job
        run_median = _sorted_median(history) if len(history) >= 2 else None
        insort(history, slowest)
        jumped = run_median is not None and slowest >= self.settings.step_jump * run_median
        jump_sustained, self._jumped = jumped and self._jumped, jumped
        if sustained:
            return "straggler", {"straggler_rank": ranks[straggler], "intervals": 2,
                                 "late_steps": len(late), "late_ms_median": round(median(late), 3),
                                 "arrival_ms": {str(rank): round(value, 3)
                                                for rank, value in zip(ranks, _arrivals(rows, steps))}}
        if jump_sustained:
            return "step_jump", {"slowest_median_step_ms": round(slowest, 3), "intervals": 2,
                                 "run_median_step_ms": round(run_median, 3),
                                 "step_jump": self.settings.step_jump}
        return None
