"""The report's step-straggler rule, in one torch-free place for the report and the live metrics.

A rank slowed by anything outside the collectives arrives late at them, and the others sit inside until
it comes: per step, the rank with the *least* time inside the step's collectives is the one the others
waited for, but only where the spread across ranks is larger than noise.  The report applies this to
the records after the job; :mod:`ds_profutils.engine.live` applies it to each monitoring interval while
the job runs, so both name the same rank for the same steps.
"""
from __future__ import annotations

from statistics import median
from typing import Optional, Sequence

__all__ = ["STRAGGLER_MIN_SPREAD_MS", "STRAGGLER_STEP_SHARE", "step_straggler", "straggler_threshold"]

STRAGGLER_MIN_SPREAD_MS = 2.0
"""A step has a straggler only when max - min time inside its collectives across ranks is at least this ..."""
STRAGGLER_STEP_SHARE = 0.10
"""... and at least this share of the step's median step time (noise is not a straggler)."""


def straggler_threshold(step_ms: Sequence[float], share: float = STRAGGLER_STEP_SHARE) -> float:
    """The spread of time inside collectives a step needs to have a straggler, from its ranks' step times (NaN: a
    rank without the figure): ``share`` of their median, at least STRAGGLER_MIN_SPREAD_MS."""
    times = [value for value in step_ms if value == value]
    return max(STRAGGLER_MIN_SPREAD_MS, share * median(times) if times else 0.0)


def step_straggler(collective_ms: Sequence[float], step_ms: Sequence[float]) -> Optional[int]:
    """The index (into the sequences, one entry per rank) of the step's straggler, or None.

    ``collective_ms[i]`` is rank i's time inside the step's collectives, ``step_ms[i]`` its step time;
    NaN marks a rank without the figure.  None where fewer than two ranks have it or the spread is
    below ``max(STRAGGLER_MIN_SPREAD_MS, STRAGGLER_STEP_SHARE * median step time)``.
    """
    present = [(value, index) for index, value in enumerate(collective_ms) if value == value]
    if len(present) < 2:
        return None
    least, least_index = min(present)
    return least_index if max(present)[0] - least >= straggler_threshold(step_ms) else None
