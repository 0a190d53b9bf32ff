"""Why a straggler arrived last: one pure decision from figures the records already hold.

The rank the others wait for (:mod:`ds_profutils.report.steps`) is late for one of a few reasons, told apart
in this order (DESIGN "Causes"):

1. ``input_pipeline``: its time between steps (its gap, outside forward, backward and step) stands out from
   the others' while its busy time does not: a slow data loader or host work between steps.
2. ``more_work``: it was given more work (counted FLOPs, else tokens, else samples) and does it at the others'
   pace: its busy time per unit of work is not above theirs.  Variable-length batches do this: not slow
   hardware, unbalanced data.
3. ``compute``: its busy time per unit of work is above the others' (a slow, throttled or shared device, a sleep
   in a hook).
4. ``communication``: only where device clocks separate waiting from transfer: its own compute stream stalled
   on collectives that the others were already in.
5. ``unknown``: no rule decides (e.g. host clocks, nothing else standing out).

Every threshold is a named constant; the same function serves the report (per rank over the run's medians, and
per step) and the live metrics (per interval), so they cannot disagree.  No torch, no deepspeed.
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Any, Dict, Optional, Sequence, Tuple

__all__ = ["CAUSES", "CAUSE_CODES", "COMPUTE_EXCESS_SHARE", "EVAL_OR_SAVE", "GAP_OVER_BUSY", "MORE_WORK_RATIO",
           "LIVE_CAUSES", "SAME_PACE_RATIO", "Figures", "decide_cause", "describe_cause", "late_by_gap",
           "step_cause"]

MORE_WORK_RATIO = 1.15
"""More work: the straggler's work median is at least this times the others' median.  Below it, work varies as
batches do (a few percent); a 15 % excess already costs a 2-rank job's step that share, which the straggler
test's 10 % per-step threshold can see."""
GAP_OVER_BUSY = 2.0
"""A straggler whose gap and busy time both stand out is late by its gap (``input_pipeline``) where the gap's excess
is at least this times the busy time's: on short CPU steps busy time varies by a few ms from step to step, as much
as the straggler threshold (10 % of the step), while a slow data loader adds its whole delay to the gap (a Trainer
rank sleeping 80 ms a batch: +160 ms gap, busy +/- 4 ms)."""
SAME_PACE_RATIO = 1.10
"""Busy time per unit of work at most this times the others' is the same pace (more work then explains the
lateness); above it the rank computes slower (``compute``).  The straggler test's own 10 % of the step: a pace
difference smaller than that cannot make a rank the step straggler by itself."""
COMPUTE_EXCESS_SHARE = 0.5
"""... and only where its busy time exceeds the others' by at least this share of the step straggler's threshold: a
slower pace makes a rank late by what it adds to its busy time.  Where busy time is most of the step, a pace
above ``SAME_PACE_RATIO`` adds about the threshold; a pipeline rank's busy time is its compute, a small part of its
step (the rest its sends and receives): a 2.2 ms compute 13% slower adds 0.3 ms to a 60 ms step whose threshold is
6 ms, and a rank that waited for its pipe neighbour would be called slow compute."""
CAUSES = ("more_work", "input_pipeline", "compute", "communication", "unknown")
EVAL_OR_SAVE = "eval_or_save"
"""A step's cause in ``cause_steps`` where the rank was late by its own eval forwards or checkpoint saves between
steps (``input_pipeline`` with ``gap_is_eval``): periodic saves or logging on one rank, no data loader's doing."""
LIVE_CAUSES = (*CAUSES, EVAL_OR_SAVE)
CAUSE_CODES: Dict[Optional[str], int] = {None: 0, **{cause: code for code, cause in enumerate(LIVE_CAUSES, 1)}}
"""The live event ``ds_profutils/straggler_cause``: 0 none, 1 more_work, 2 input_pipeline, 3 compute,
4 communication, 5 unknown, 6 eval_or_save (an interval's straggler late by its own eval forwards or saves, as a
step's cause in the report's ``cause_steps``)."""


@dataclass(frozen=True)
class Figures:
    """One rank's figures of a step (or medians over steps); None where not recorded.

    ``gap_ms``: its own time between steps (less the time inside collectives, eval forwards and checkpoint saves
    there, where recorded): its input pipeline's and host work's; ``host_gap_ms``: less the collectives only (its eval
    forwards and saves in it); ``work``: units of work per step; ``exposed_wait_ms``: what its compute stream stalled
    on collectives."""

    busy_ms: Optional[float]
    gap_ms: Optional[float] = None
    work: Optional[float] = None
    exposed_wait_ms: Optional[float] = None
    host_gap_ms: Optional[float] = None

    @property
    def busy_per_unit(self) -> Optional[float]:
        if self.busy_ms is None or not self.work:
            return None
        return self.busy_ms / self.work


def _others(others: Sequence[Figures], name: str) -> Optional[float]:
    values = [value for value in (getattr(figures, name) for figures in others) if value is not None]
    return median(values) if values else None


def late_by_gap(own: Figures, others: Sequence[Figures], threshold_ms: float, name: str = "gap_ms") -> bool:
    """Its gap (``name``: ``gap_ms``, or ``host_gap_ms`` with its eval forwards and saves) stands out from the others'
    by a step straggler's threshold, and its busy time does not: by less than the threshold, or by less than the
    gap's excess over ``GAP_OVER_BUSY`` (the gap is then most of its lateness)."""
    gap, busy, own_gap = _others(others, name), _others(others, "busy_ms"), getattr(own, name)
    if None in (gap, busy, own_gap, own.busy_ms):
        return False
    gap_excess = own_gap - gap
    return gap_excess >= threshold_ms and own.busy_ms - busy < max(threshold_ms, gap_excess / GAP_OVER_BUSY)


def _ratio(value: Optional[float], other: Optional[float]) -> Optional[float]:
    return None if value is None or not other else value / other


def decide_cause(own: Figures, others: Sequence[Figures], threshold_ms: float,
                 device_clock: bool = False) -> Tuple[str, Dict[str, Any]]:
    """The cause of a straggler's lateness (one of :data:`CAUSES`) and the figures that decided it.

    ``others``: the other ranks' figures of the same steps; ``threshold_ms``: the step straggler's threshold
    (what a lateness must reach to count); ``device_clock``: the waits were timed on the device, so a stall on
    its own collectives is told from waiting for a late peer."""
    busy_per_unit = [figures.busy_per_unit for figures in others if figures.busy_per_unit is not None]
    others_pace = median(busy_per_unit) if busy_per_unit else None
    others_work = _others(others, "work")
    with_work = own.busy_per_unit is not None and others_pace is not None
    pace_ratio = (_ratio(own.busy_per_unit, others_pace) if with_work
                  else _ratio(own.busy_ms, _others(others, "busy_ms")))  # no work known: busy per step
    figures: Dict[str, Any] = {
        "threshold_ms": threshold_ms,
        "gap_ms": own.gap_ms, "others_gap_ms": _others(others, "gap_ms"),
        "busy_ms": own.busy_ms, "others_busy_ms": _others(others, "busy_ms"),
        "work": own.work, "others_work": others_work, "work_ratio": _ratio(own.work, others_work),
        "busy_ms_per_unit": own.busy_per_unit if with_work else None,
        "others_busy_ms_per_unit": others_pace if with_work else None,
        "pace_ratio": pace_ratio,
    }
    if late_by_gap(own, others, threshold_ms):
        return "input_pipeline", figures
    work_ratio = figures["work_ratio"]
    if (with_work and work_ratio is not None and pace_ratio is not None and work_ratio >= MORE_WORK_RATIO
            and pace_ratio <= SAME_PACE_RATIO):
        return "more_work", figures
    others_busy = figures["others_busy_ms"]
    if (pace_ratio is not None and pace_ratio > SAME_PACE_RATIO  # a ratio: both busy times are known
            and own.busy_ms - others_busy >= COMPUTE_EXCESS_SHARE * threshold_ms):
        return "compute", figures
    if late_by_gap(own, others, threshold_ms, "host_gap_ms"):  # its eval forwards or saves between steps (alone)
        figures.update(gap_ms=own.host_gap_ms, others_gap_ms=_others(others, "host_gap_ms"), gap_is_eval=True)
        return "input_pipeline", figures
    waited = _others(others, "exposed_wait_ms")
    if device_clock and own.exposed_wait_ms is not None and waited is not None:
        figures.update(exposed_wait_ms=own.exposed_wait_ms, others_exposed_wait_ms=waited)
        if own.exposed_wait_ms - waited >= threshold_ms:
            return "communication", figures
    return "unknown", figures


_ADVICE = {
    "more_work": "balance the work per rank: token-budget batches, packing, length-grouped sampling by tokens",
    "input_pipeline": "a slow input pipeline or host work between steps, not slow compute",
    "compute": "a slow, throttled or shared device, or host work inside forward/backward/step",
    "communication": "its own collectives took longer with the others already in them",
    "unknown": "neither its gap, its work nor its pace stands out",
}
_EVAL_GAP_ADVICE = ("host work the others do not do between steps, not its input pipeline nor slow compute: spread "
                    "evaluation and saves over the ranks or run them less often")
"""An ``input_pipeline`` cause told by its eval forwards and checkpoint saves (``gap_is_eval``)."""


def step_cause(cause: str, figures: Dict[str, Any]) -> str:
    """``decide_cause``'s cause as a step's (``cause_steps``, the live event): ``EVAL_OR_SAVE`` where the gap that
    decided ``input_pipeline`` was the rank's own eval forwards and saves."""
    return EVAL_OR_SAVE if cause == "input_pipeline" and figures.get("gap_is_eval") else cause


def describe_cause(cause: str, figures: Dict[str, Any], unit: Optional[str],
                   steps: Optional[Dict[str, int]] = None) -> str:
    """The cause in words with the figures that decided it, as the report's straggler line gives it; ``steps``:
    the cause of each of its straggler steps, counted (shown where they are not all the one cause)."""
    per = f"ms per {unit}" if figures.get("busy_ms_per_unit") is not None else "ms per step"
    pace = (figures.get("busy_ms_per_unit"), figures.get("others_busy_ms_per_unit"))
    if pace[0] is None:
        pace = (figures.get("busy_ms"), figures.get("others_busy_ms"))
    parts = []
    if cause == "input_pipeline":
        parts.append(f"gap {figures['gap_ms']:,.1f} ms against {figures['others_gap_ms']:,.1f} ms"
                     + (", its eval forwards and checkpoint saves between steps" if figures.get("gap_is_eval") else ""))
    if figures.get("work_ratio") is not None:
        parts.append(f"{figures['work_ratio']:.2f}x the others' work ({figures['work']:,.4g} against "
                     f"{figures['others_work']:,.4g} {unit} per step)")
    if None not in pace:
        parts.append(f"busy {pace[0]:,.4g} against {pace[1]:,.4g} {per}")
    if cause == "communication":
        parts.append(f"exposed wait {figures['exposed_wait_ms']:,.1f} against {figures['others_exposed_wait_ms']:,.1f} ms")
    own = step_cause(cause, figures)
    by_step = "" if not steps or set(steps) == {own} else "; its straggler steps: " + ", ".join(
        f"{name} {count}" for name, count in sorted(steps.items(), key=lambda item: -item[1]))
    advice = _EVAL_GAP_ADVICE if own == EVAL_OR_SAVE else _ADVICE[cause]
    return f"cause: {cause} ({'; '.join(parts)}): {advice}{by_step}"
