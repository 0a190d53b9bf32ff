"""One engine's joined step view (per global step and rank) and the rank the others wait for.

A rank slowed by anything outside the collectives (a data loader, a slow GPU, a sleep) arrives late at
the step's collectives, and the others sit inside them until it comes.  So per step the rank with the
*least* time inside the collectives arrived last: it is that step's straggler, and the others' excess
over that minimum is the wait it caused (DeepSpeed's comms straggler figure: latency minus the minimum
across ranks).  This names a rank slowed in backward too (the gradient collectives make every rank's step
equally long, so step time cannot), and it holds for collectives overlapped on a side stream: schema 3's
``collective_ms`` is the time inside every collective, stalling the compute stream or not.  Records
without it (schema 2 or older) fall back to the exposed wait (fetch waits and blocking collectives).

Overall, a rank is named when it was the step straggler more often than chance makes it: with no slow
rank, each step's least time falls on any rank alike, 1/ranks.  A one-sided exact binomial test of its
count against that, at ``STRAGGLER_LEVEL / ranks`` (the chance that a run with no slow rank names any
rank is at most ``STRAGGLER_LEVEL``), decides; so two noisy ranks, each the step straggler about half the
time, are not named in turn.  A host: the same test against its share of the ranks, at
``STRAGGLER_LEVEL / hosts``.

The view is kept as rank-major arrays of doubles (NaN where a rank has no record of a step), 8 bytes
per rank, step and column, so 1024 ranks x 1000 steps stay in tens of MB.
"""
from __future__ import annotations

import math
from array import array
from collections import Counter
from dataclasses import dataclass, field
from statistics import median
from typing import Any, Dict, List, Mapping, Optional, Sequence

from .._straggler import STRAGGLER_MIN_SPREAD_MS, STRAGGLER_STEP_SHARE, straggler_threshold
from ..diagnosis.stragglers import WORK_UNITS, work_unit
from .chance import binomial_upper_tail
from .records import FileRecords

__all__ = ["ARRIVAL_FIGURES", "arrival_ms", "host_gap_ms", "own_gap_ms", "STRAGGLER_LEVEL",
           "STRAGGLER_MIN_SPREAD_MS", "STRAGGLER_STEP_SHARE", "Matrix", "StepView", "chance_p_value",
           "held_back_in_some_steps", "host_stragglers", "is_straggler", "reach", "step_view", "steps_to_name",
           "tflops", "straggler_rule"]

STRAGGLER_LEVEL = 0.025
"""The overall verdict's level, shared by the ranks (each is tested at ``STRAGGLER_LEVEL / ranks``).  The
largest round level that names a rank which is the straggler of 9 of 10 steps of a 2-rank run
(p = 11/1024 = 0.0107 <= 0.0125) and keeps the chance that a run without a slow rank names one under
2.5% even when every step's spread clears the thresholds by jitter alone (the worst case)."""
ARRIVAL_FIGURES = {"collective_ms": "time inside collectives", "exposed_wait_ms": "exposed wait"}
"""The per-rank figures the step straggler is found by, best first, and their names in the text."""


def straggler_rule() -> str:
    """The rule in words, with its thresholds and level, as the report prints it."""
    return (f"a step's straggler is the rank with the least time inside the step's collectives (collective_ms; "
            f"records without it, schema 2 or older: the least exposed wait) where the spread across ranks "
            f"(max - min) is >= max({STRAGGLER_MIN_SPREAD_MS:g} ms, {STRAGGLER_STEP_SHARE:.0%} of the step's median "
            f"step time): it arrived last, and the others' excess is the wait it caused; a rank is flagged STRAGGLER "
            f"when it is the step straggler more often than chance allows: a one-sided exact binomial test of its "
            f"count against 1/ranks per recorded train step, p <= {STRAGGLER_LEVEL:.1%} / ranks (so a run with no "
            f"slow rank names one in at most {STRAGGLER_LEVEL:.1%} of runs); a rank not flagged but the step "
            f"straggler of more of the steps where a rank held the others back than chance allows (the same test over "
            f"those steps only) is listed HELD BACK IN SOME STEPS: slow in part of the run; with ranks on several "
            f"hosts, a host is flagged STRAGGLER HOST by the same test against its share of the ranks, p <= "
            f"{STRAGGLER_LEVEL:.1%} / hosts")


def steps_to_name(tested_steps: int, ranks: int, compared: Optional[int] = None) -> Optional[int]:
    """The fewest of ``tested_steps`` a rank must be the step straggler in to be named (None: no count is
    enough, too few steps), at the level of ``ranks`` ranks, each step's chance 1/``compared`` (the ranks compared
    with each other: a pipeline stage's; default all).  The tail shrinks as the count grows, so a bisection
    finds it."""
    compared = ranks if compared is None else compared
    if compared < 2 or tested_steps < 1:
        return None
    level = STRAGGLER_LEVEL / ranks
    if binomial_upper_tail(tested_steps, tested_steps, 1 / compared) > level:
        return None
    low, high = 1, tested_steps  # the answer is in [low, high]
    while low < high:
        middle = (low + high) // 2
        if binomial_upper_tail(middle, tested_steps, 1 / compared) <= level:
            high = middle
        else:
            low = middle + 1
    return low


def reach(view: "StepView") -> str:
    """What the test can see in this run, in words: how many steps name a rank, and what it cannot see."""
    ranks, compared, tested = len(view.ranks), view.compared_ranks, view.tested_steps
    within = " in a pipeline stage" if view.stage_of else ""
    if view.stage_of and compared < 2:
        return ("no rank can be named: ranks are compared only within a pipeline stage, and each stage here has "
                "one rank (a slow stage is named SLOW STAGE instead)")
    needed = steps_to_name(tested, ranks, compared)
    thresholds = [value for value in view.threshold_ms if value is not None]
    threshold = f" (here {median(thresholds):.1f} ms at the median step)" if thresholds else ""
    named = (f"a rank is named when it is the step straggler in at least {needed} of the {tested} tested steps of "
             f"{compared} ranks{within}" if needed is not None else
             f"no rank can be named: {tested} tested steps of {compared} ranks{within} are too few for any count "
             "to pass")
    return (f"{named}; a rank slower by less than the per-step threshold{threshold} is never a step straggler, so "
            "it is not flagged however many steps it lasts (its own busy time in the ranks table shows it)")


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
    wait, busy time (step time - exposed wait), time inside collectives (the step's, and the frameworks'
    ``torch.distributed`` collectives between steps: :func:`arrival_ms`), the trace's step time and the
    peak allocated bytes; per step the straggler, found by ``arrival`` (a key of ``ARRIVAL_FIGURES``)."""

    global_steps: List[int]
    ranks: List[int]
    step_ms: Matrix
    fetch_wait_ms: Matrix
    collective_wait_ms: Matrix
    exposed_wait_ms: Matrix
    busy_ms: Matrix
    collective_ms: Matrix
    trace_step_ms: Matrix
    peak_allocated_bytes: Matrix
    iteration_ms: Matrix  # end of the previous optimizer step to the end of this one (NaN: not recorded)
    gap_ms: Matrix  # its part outside forward, backward and step
    own_gap_ms: Matrix  # the gap less the frameworks' collectives, eval forwards and saves in it (own_gap_ms)
    host_gap_ms: Matrix  # the gap less the frameworks' collectives only (its eval forwards and saves in it)
    tflops: Matrix  # the step's model FLOPs over its iteration, TFLOP/s
    work: Matrix  # the step's work in ``work_unit`` (diagnosis.stragglers.WORK_UNITS)
    own_busy_ms: Matrix  # what a straggler's cause weighs: busy time, a pipeline rank's compute (not its p2p waits)
    work_unit: Optional[str] = None  # None: no work recorded on every rank
    stage_of: Dict[int, int] = field(default_factory=dict)  # a pipeline's ranks: their stage (causes within it)
    arrival: str = "collective_ms"
    straggler: List[Optional[int]] = field(default_factory=list)
    spread_ms: List[Optional[float]] = field(default_factory=list)
    threshold_ms: List[Optional[float]] = field(default_factory=list)
    straggler_steps: Dict[int, int] = field(default_factory=dict)
    attributed_ms: Dict[int, float] = field(default_factory=dict)  # others' excess wait in its straggler steps
    waited_ms: Dict[int, float] = field(default_factory=dict)  # its own excess wait in others' straggler steps
    tested_steps: int = 0  # steps with at least two ranks: those that could have a straggler
    p_values: Dict[int, float] = field(default_factory=dict)  # by chance: its straggler steps or more
    held_steps: Dict[int, int] = field(default_factory=dict)  # its comparison's steps where a rank held others back
    held_p_values: Dict[int, float] = field(default_factory=dict)  # by chance: its share of those steps or more
    straggler_step_numbers: Dict[int, List[int]] = field(default_factory=dict)  # the global steps it held others back
    straggler_step_thresholds: Dict[int, List[float]] = field(default_factory=dict)  # theirs, in its comparison

    @property
    def compared_ranks(self) -> int:
        """How many ranks a step's straggler is found among: a pipeline stage's (the largest), else all."""
        return max(Counter(self.stage_of.values()).values()) if self.stage_of else len(self.ranks)

    def columns(self) -> Dict[str, Matrix]:
        return {"step_ms": self.step_ms, "fetch_wait_ms": self.fetch_wait_ms,
                "collective_wait_ms": self.collective_wait_ms, "exposed_wait_ms": self.exposed_wait_ms,
                "busy_ms": self.busy_ms, "collective_ms": self.collective_ms, "trace_step_ms": self.trace_step_ms,
                "peak_allocated_bytes": self.peak_allocated_bytes, "iteration_ms": self.iteration_ms,
                "gap_ms": self.gap_ms, "own_gap_ms": self.own_gap_ms, "host_gap_ms": self.host_gap_ms,
                "tflops": self.tflops, "work": self.work}


def _fill(matrix: Matrix, rank_index: int, positions: Optional[Sequence[int]], values: array) -> None:
    """One rank's values into its row: a slice copy when it has every step (``positions`` None)."""
    if positions is None:
        start = rank_index * matrix.steps
        matrix.values[start:start + matrix.steps] = values
        return
    row = rank_index * matrix.steps
    for position, value in zip(positions, values):
        matrix.values[row + position] = value


def tflops(records: FileRecords) -> array:
    """Per step, the model FLOPs of its train micro steps over its iteration, in TFLOP/s (NaN: either missing)."""
    return array("d", (flops / iteration / 1e9 if iteration > 0 else math.nan
                       for flops, iteration in zip(records.flops, records.iteration_ms)))


def arrival_ms(records: FileRecords) -> array:
    """Per step, the time inside collectives the straggler test compares: in-step ``collective_ms`` plus
    ``gap_collective_ms``, the frameworks' own ``torch.distributed`` collectives between steps (the Trainer's
    token-count gather, where the ranks that loaded their batches early wait for the late one)."""
    if not records.gap_collective_ms:
        return records.collective_ms
    return array("d", (inside + gap if gap == gap else inside
                       for inside, gap in zip(records.collective_ms, records.gap_collective_ms)))


def own_gap_ms(records: FileRecords) -> array:
    """Per step, the gap less its time inside the frameworks' collectives, eval forwards and checkpoint saves: waiting
    there for a late peer is no slow input pipeline of one's own (the late rank's own gap is what stands out), nor is
    a slow eval forward (its compute) or save."""
    return _gap_less(records, records.gap_collective_ms, records.eval_ms, records.save_ms)


def host_gap_ms(records: FileRecords) -> array:
    """Per step, the gap less its time inside the frameworks' collectives only: the host's own work between steps,
    eval forwards and checkpoint saves included."""
    return _gap_less(records, records.gap_collective_ms)


def _gap_less(records: FileRecords, *parts: Sequence[float]) -> array:
    own = array("d", records.gap_ms)
    for part in parts:
        for index, value in enumerate(part):
            if value == value:  # NaN: not recorded (files of earlier writers)
                own[index] -= value
    return own


def step_view(files: Sequence[FileRecords], trace_steps: Mapping[int, Mapping[int, float]]) -> StepView:
    """The view over the train records of one engine's files (one per rank), with each rank's trace step
    times (``{rank: {global step: ms}}``) where a trace numbers its steps globally."""
    files = sorted((f for f in files if f.global_steps), key=lambda f: f.rank)
    all_steps = sorted(set().union(*(f.global_steps for f in files)))
    everything = array("q", all_steps)
    index = {step: position for position, step in enumerate(all_steps)}
    ranks, steps = len(files), len(all_steps)
    # Arrival from the time inside collectives only where every rank recorded it in every step.
    arrival = "exposed_wait_ms" if any(f.without_collective_ms for f in files) else "collective_ms"
    unit = work_unit({name: bool(files) and all(any(v == v for v in getattr(f, name)) for f in files)
                      for name, _, _ in WORK_UNITS})
    view = StepView(all_steps, [f.rank for f in files], *(Matrix(ranks, steps) for _ in range(15)), arrival=arrival,
                    work_unit=unit and unit[1])
    for rank_index, records in enumerate(files):
        positions = None if records.global_steps == everything else [index[s] for s in records.global_steps]
        exposed = array("d", map(float.__add__, records.fetch_wait_ms, records.collective_wait_ms))
        busy = array("d", map(float.__sub__, records.step_ms, exposed))
        # a pipeline rank's own work is its compute: its sends and receives wait for the neighbour stage's rank
        own = records.compute_ms if records.pipe_stage is not None else busy
        for matrix, values in ((view.step_ms, records.step_ms), (view.fetch_wait_ms, records.fetch_wait_ms),
                               (view.collective_ms, arrival_ms(records)),
                               (view.collective_wait_ms, records.collective_wait_ms),
                               (view.exposed_wait_ms, exposed), (view.busy_ms, busy), (view.own_busy_ms, own),
                               (view.peak_allocated_bytes, records.peak_allocated_bytes),
                               (view.iteration_ms, records.iteration_ms), (view.gap_ms, records.gap_ms),
                               (view.own_gap_ms, own_gap_ms(records)),
                               (view.host_gap_ms, host_gap_ms(records)),
                               (view.tflops, tflops(records)),
                               (view.work, array("d", (value * unit[2] for value in getattr(records, unit[0])))
                                if unit else array("d", [math.nan]) * len(records.global_steps))):
            _fill(matrix, rank_index, positions, values)
        for step, ms in trace_steps.get(records.rank, {}).items():
            if step in index:
                view.trace_step_ms.values[rank_index * steps + index[step]] = ms
    _find_stragglers(view)
    return view


def _find_stragglers(view: StepView) -> None:
    """Per step, the straggler (if the spread clears the threshold), and who it cost what; per rank, the
    chance of being the step straggler that often with no slow rank."""
    attributed = [0.0] * len(view.ranks)
    waited = [0.0] * len(view.ranks)
    view.straggler_step_numbers = {rank: [] for rank in view.ranks}
    view.straggler_step_thresholds = {rank: [] for rank in view.ranks}
    arrival = getattr(view, view.arrival)
    for step_index in range(len(view.global_steps)):
        inside = arrival.step_column(step_index)
        present = [(value, rank_index) for rank_index, value in enumerate(inside) if value == value]
        if len(present) < 2:
            view.straggler.append(None)
            view.spread_ms.append(None)
            view.threshold_ms.append(None)
            continue
        view.tested_steps += 1
        least, least_rank = min(present)
        spread = max(present)[0] - least
        threshold = straggler_threshold(view.step_ms.step_column(step_index))
        view.spread_ms.append(spread)
        view.threshold_ms.append(threshold)
        if spread < threshold:
            view.straggler.append(None)
            continue
        late = view.ranks[least_rank]
        view.straggler.append(late)
        view.straggler_step_numbers[late].append(view.global_steps[step_index])
        view.straggler_step_thresholds[late].append(threshold)
        for value, rank_index in present:
            waited[rank_index] += value - least
        attributed[least_rank] += sum(value for value, _ in present) - least * len(present)
    counts = [len(view.straggler_step_numbers[rank]) for rank in view.ranks]
    view.straggler_steps = dict(zip(view.ranks, counts))
    view.attributed_ms = dict(zip(view.ranks, attributed))
    view.waited_ms = dict(zip(view.ranks, waited))
    view.p_values = {rank: chance_p_value(view, count, 1 / len(view.ranks)) for rank, count in zip(view.ranks, counts)}
    held = sum(counts)
    view.held_steps = dict.fromkeys(view.ranks, held)
    view.held_p_values = {rank: binomial_upper_tail(count, held, 1 / len(view.ranks))
                          for rank, count in zip(view.ranks, counts)}


def chance_p_value(view: StepView, count: int, share: float) -> float:
    """The chance that ranks holding ``share`` of the ranks are the straggler of ``count`` or more of the
    view's tested steps when the stragglers fall on the ranks at random."""
    return binomial_upper_tail(count, view.tested_steps, share)


def is_straggler(view: StepView, rank: int) -> bool:
    """Flagged overall: the step straggler more often than chance allows (``STRAGGLER_LEVEL`` over the ranks)."""
    return rank in view.p_values and view.p_values[rank] <= STRAGGLER_LEVEL / len(view.ranks)


def held_back_in_some_steps(view: StepView, rank: int) -> bool:
    """Not flagged, yet the straggler of more of the steps where any rank held the others back than chance allows (the
    same test over those steps only): a rank slow in part of the run (from its middle on, every other step: a
    loader's workers, the longer batches), which the test over every step cannot see however long the run, since
    the steps where nobody was late count against it."""
    return (not is_straggler(view, rank) and rank in view.held_p_values
            and view.held_p_values[rank] <= STRAGGLER_LEVEL / len(view.ranks))


def host_stragglers(view: StepView, hosts: Mapping[str, Sequence[int]]) -> Dict[str, Dict[str, Any]]:
    """Per host (``{host: its ranks}``), the steps whose straggler was one of its ranks, the chance of that many
    with its share of the ranks, and whether that is under ``STRAGGLER_LEVEL / hosts``.

    A slow node slows all its ranks alike, so each step's least time inside the collectives falls on any one
    of them and no single rank stands out; the host does.
    """
    host_of = {rank: host for host, ranks in hosts.items() for rank in ranks}
    counts = Counter(host_of.get(rank) for rank in view.straggler if rank is not None)
    stepping = set(view.ranks)  # ranks with train steps: those a step's straggler is drawn from
    verdicts = {}
    for host, ranks in hosts.items():
        p_value = chance_p_value(view, counts[host], len(stepping.intersection(ranks)) / len(stepping)
                                 if stepping else 0.0)
        verdicts[host] = {"straggler_steps": counts[host], "straggler_p_value": p_value,
                          "straggler": p_value <= STRAGGLER_LEVEL / len(hosts)}
    return verdicts
