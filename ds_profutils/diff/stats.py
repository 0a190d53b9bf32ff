"""Whether a figure changed between two runs beyond run-to-run noise: the warm-up rule and the test.

Per-step figures are not normal (a few slow steps: a garbage collection, a checkpoint, a neighbour's
job), so the test compares ranks, not means: a two-sided Mann-Whitney U test, normal approximation
with tie and continuity correction, in pure Python (``ds-profutils diff`` imports no scipy and starts
in a fraction of a second).  With thousands of steps the test alone finds a 0.3 % shift nobody should
act on, so a change counts only where the test says so at p < ``ALPHA`` AND the medians differ by at
least ``MIN_CHANGE`` of a stated scale (the figure's own base median, or the step time's for a part
of the step).  A few steps after warm-up are needed to reach that level at all: 6 in each run where
both have as many, 3 in one run beside thousands in the other; with 2 or fewer in a run, never.
"""
from __future__ import annotations

import math
from statistics import fmean, median
from typing import Any, Dict, Optional, Sequence

__all__ = ["ALPHA", "MIN_CHANGE", "WARMUP_SHARE", "WARMUP_STEPS", "compare", "mann_whitney_p", "percentile",
           "significance_rule", "warmup_steps"]

ALPHA = 0.01
"""A change is beyond noise where the test's two-sided p-value is below this ..."""
MIN_CHANGE = 0.02
"""... and the medians differ by at least this share of the scale (the base median, or the base step time)."""
WARMUP_STEPS = 2
"""The first recorded train steps of each run left out: at least this many ..."""
WARMUP_SHARE = 0.10
"""... or this share of the run's recorded train steps (rounded up), whichever is more."""


def warmup_steps(steps: int) -> int:
    """How many leading recorded train steps of a run of ``steps`` are warm-up (all of a run of 2 or fewer)."""
    return min(steps, max(WARMUP_STEPS, math.ceil(WARMUP_SHARE * steps)))


def significance_rule() -> str:
    """The rule in words, as the output states it."""
    return (f"per-step figures after warm-up (the first {WARMUP_STEPS} recorded train steps or "
            f"{WARMUP_SHARE:.0%}, whichever is more) compared by a two-sided Mann-Whitney U test (normal "
            f"approximation, tie- and continuity-corrected); a change is significant where p < {ALPHA:g} and the "
            f"medians differ by >= {MIN_CHANGE:.0%} (of the base median; for a part of the step, of the base "
            f"median step time)")


def mann_whitney_p(base: Sequence[float], new: Sequence[float]) -> Optional[float]:
    """Two-sided p-value that ``base`` and ``new`` come from one distribution; None with fewer than 2 of either."""
    n1, n2 = len(base), len(new)
    if n1 < 2 or n2 < 2:
        return None
    pooled = sorted([(value, True) for value in base] + [(value, False) for value in new])
    total = n1 + n2
    base_rank_sum = 0.0
    ties = 0  # sum of t^3 - t over groups of t equal values
    start = 0
    while start < total:
        end = start
        while end + 1 < total and pooled[end + 1][0] == pooled[start][0]:
            end += 1
        mean_rank = (start + end) / 2 + 1  # ranks are 1-based; equal values share their mean rank
        base_rank_sum += mean_rank * sum(1 for _, from_base in pooled[start:end + 1] if from_base)
        group = end - start + 1
        ties += group ** 3 - group
        start = end + 1
    u = base_rank_sum - n1 * (n1 + 1) / 2
    variance = n1 * n2 / 12 * ((total + 1) - ties / (total * (total - 1)))
    if variance <= 0:  # every value equal
        return 1.0
    z = max(0.0, abs(u - n1 * n2 / 2) - 0.5) / math.sqrt(variance)
    return math.erfc(z / math.sqrt(2))


def percentile(values: Sequence[float], share: float) -> float:
    """The ``share`` quantile of ``values`` (not empty), linear between the two nearest."""
    ordered = sorted(values)
    position = share * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def _summary(values: Sequence[float]) -> Dict[str, Optional[float]]:
    if not values:
        return {"median": None, "p90": None, "mean": None}
    return {"median": median(values), "p90": percentile(values, 0.9), "mean": fmean(values)}


def compare(base: Sequence[float], new: Sequence[float], scale: Optional[float] = None) -> Dict[str, Any]:
    """One figure of two runs: medians, their change and ratio, the test, and the verdict.

    ``scale``: what ``MIN_CHANGE`` is a share of (default: the base median).  ``mean`` and ``p90`` are
    shown beside the medians; the means of the parts of a step add up to the step's.
    """
    before, after = _summary(base), _summary(new)
    p_value = mann_whitney_p(base, new)
    low, high = before["median"], after["median"]
    change = None if low is None or high is None else high - low
    if scale is None:
        scale = low
    significant = (p_value is not None and p_value < ALPHA and change is not None and scale is not None
                   and abs(change) >= MIN_CHANGE * abs(scale) and change != 0)
    return {"base": low, "new": high, "change": change, "ratio": high / low if change is not None and low else None,
            "p_value": p_value, "significant": significant, "steps": {"base": len(base), "new": len(new)},
            "mean": {"base": before["mean"], "new": after["mean"]}, "p90": {"base": before["p90"], "new": after["p90"]}}
