"""Whether a figure changed between two runs beyond run-to-run noise: the warm-up rule and the test.

Per-step figures are not independent: real step times drift (thermal throttling, length-bucketed
batches, a neighbour's load), so consecutive steps are alike and 300 steps hold far fewer independent
looks.  A test that takes them for independent (Mann-Whitney's U, which this replaces) called two runs
of one unchanged job changed in 7-9 % of pairs at a nominal 1 %.  So the difference of the two runs'
means is divided by its standard error with each run's steps counted as *effective steps* ``n / tau``:
``tau``, the run's integrated autocorrelation time, is the larger of two estimates, the lag-1 AR(1) one
(``(1 + r) / (1 - r)``, ``r`` corrected for its small-sample bias) and Geyer's initial positive sequence
(which follows drift of any shape), kept between 1 and ``n``; the p-value is Student's t with Welch's
degrees of freedom on the effective steps, in pure Python (``ds-profutils diff`` imports no scipy).
This is done twice, on the runs' ranks among both (so that a few steps of a second on a shared machine
do not swamp the standard error) and on their values (which keep the size of a change), and the
smaller p-value, doubled, is the test's.  Simulated in ``tests/test_diff_drift.py``: AR(1) runs
(correlation 0.9, 3 % spread, 300 steps) are called changed in 0.6 % of unchanged pairs and a 6 %
slower run is found in 93 %; with 12 % of steps a fraction of a second slow, a 20 ms slower run of 36
steps is still found.

With thousands of steps the test alone finds a 0.3 % shift nobody should act on, so a change counts
only where the test says so at p < ``ALPHA`` AND the medians differ by at least ``MIN_CHANGE`` of a
stated scale (the figure's own base median, or the step time's for a part of the step).
"""
from __future__ import annotations

import math
import operator
from statistics import fmean, median
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .student import t_two_sided_p

__all__ = ["ALPHA", "MIN_CHANGE", "MIN_STEPS", "WARMUP_SHARE", "WARMUP_STEPS", "compare", "drift_test", "effective_steps",
           "percentile", "significance_rule", "warmup_steps"]

ALPHA = 0.01
"""A change is beyond noise where the test's two-sided p-value is below this ..."""
MIN_CHANGE = 0.02
"""... and the medians differ by at least this share of the scale (the base median, or the base step time)."""
WARMUP_STEPS = 2
"""The first recorded train steps of each run left out: at least this many ..."""
WARMUP_SHARE = 0.10
"""... or this share of the run's recorded train steps (rounded up), whichever is more."""
MIN_STEPS = 3
"""Steps after warm-up each run needs for the test (fewer: no p-value, never a change)."""
_MAX_LAG = 2000  # Geyer's sequence stops far earlier on any series that does not drift for thousands of steps
_MAX_LAG1 = 0.99  # a lag-1 correlation is taken as at most this (tau <= 199): a run of one repeated value


def warmup_steps(steps: int) -> int:
    """How many leading recorded train steps of a run of ``steps`` are warm-up (all of a run of 2 or fewer)."""
    return min(steps, max(WARMUP_STEPS, math.ceil(WARMUP_SHARE * steps)))


def significance_rule() -> str:
    """The rule in words, as the output states it."""
    return (f"per-step figures after warm-up (the first {WARMUP_STEPS} recorded train steps or "
            f"{WARMUP_SHARE:.0%}, whichever is more): the difference of the runs' means over its standard error, "
            f"on their ranks among both and on their values, the smaller p-value doubled; each run's steps counted "
            f"as effective steps (steps / tau, tau its autocorrelation time: the larger of the bias-corrected lag-1 AR(1) estimate and Geyer's "
            f"initial positive sequence), so that drifting steps are not taken for independent ones; Student's t "
            f"with Welch's degrees of freedom on the effective steps; a change is significant where p < {ALPHA:g} "
            f"and the medians differ by >= {MIN_CHANGE:.0%} (of the base median; for a part of the step, of the "
            f"base median step time)")


def effective_steps(values: Sequence[float]) -> Tuple[Optional[float], float]:
    """(lag-1 autocorrelation, effective steps ``n / tau``) of a series in step order; tau >= 1, so a run never
    counts as more steps than it has.  (None, n) for a series too short or too flat to estimate it from."""
    count = len(values)
    mean = fmean(values) if count else 0.0
    centred = [value - mean for value in values]
    total = sum(value * value for value in centred)
    if count < 3 or total <= 0.0:
        return None, float(count)

    def lag(k: int) -> float:
        return sum(map(operator.mul, centred, centred[k:])) / total  # zip stops at the shorter: count - k terms

    lag1 = lag(1)
    corrected = min(_MAX_LAG1, max(0.0, lag1 + (1 + 4 * lag1) / count))  # Kendall's bias of the lag-1 estimate
    tau = (1 + corrected) / (1 - corrected)
    # Geyer's initial positive sequence: tau = -1 + 2 * sum of the pair sums rho(2m) + rho(2m + 1), taken while
    # positive and kept non-increasing (past that point the sample autocorrelations are noise).
    geyer, previous, pair = -1.0, math.inf, 0
    while 2 * pair + 1 < min(count, _MAX_LAG):
        term = 1.0 + lag1 if pair == 0 else lag(2 * pair) + lag(2 * pair + 1)
        if term <= 0.0:
            break
        previous = min(previous, term)
        geyer += 2 * previous
        pair += 1
    tau = min(max(tau, geyer, 1.0), float(count))  # a run is at least one independent look, at most its steps
    return lag1, count / tau


def _ranks(base: Sequence[float], new: Sequence[float]) -> Tuple[List[float], List[float]]:
    """Each run's values replaced by their ranks among both runs' (1-based; equal values share their mean)."""
    values = [*base, *new]
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            ranks[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return ranks[:len(base)], ranks[len(base):]


def _mean_difference_p(base: Sequence[float], new: Sequence[float]) -> Tuple[float, Dict[str, Any]]:
    """The two-sided p-value of the difference of the runs' means on their effective steps, and the figures used."""
    found = [effective_steps(run) for run in (base, new)]
    spread = []  # per run, the variance of its mean: the values' variance over its effective steps
    for run, (_, steps) in zip((base, new), found):
        mean = fmean(run)
        spread.append(sum((value - mean) ** 2 for value in run) / (len(run) - 1) / steps)
    difference = fmean(new) - fmean(base)
    error = spread[0] + spread[1]
    if error <= 0.0:  # each run one value: a change where they differ
        p_value = 1.0 if difference == 0 else 0.0
    else:
        freedom = error ** 2 / sum(part ** 2 / max(steps - 1, 1.0) for part, (_, steps) in zip(spread, found))
        p_value = t_two_sided_p(difference / math.sqrt(error), freedom)
    return p_value, {"autocorrelation": {"base": found[0][0], "new": found[1][0]},
                     "effective_steps": {"base": found[0][1], "new": found[1][1]}}


def drift_test(base: Sequence[float], new: Sequence[float]) -> Dict[str, Any]:
    """The two-sided p-value that ``base`` and ``new`` come from one drifting process, with the figures it used
    (per run: lag-1 autocorrelation and effective steps of its ranks); p None with fewer than ``MIN_STEPS`` of
    either (a run's correlation cannot be estimated from fewer).

    Two views of one question, each on effective steps: the runs' ranks among both (robust to a few steps of
    a second on a shared machine, which would swamp a mean) and their values (which keep the size of a
    change: two runs that each climb steadily, one far above the other, are one effective step each as
    ranks, and clearly apart as values).  The smaller p-value, doubled (Bonferroni), keeps the level.
    """
    if len(base) < MIN_STEPS or len(new) < MIN_STEPS:
        return {"p_value": None, "autocorrelation": {"base": None, "new": None},
                "effective_steps": {"base": None, "new": None}}
    by_rank, figures = _mean_difference_p(*_ranks(base, new))
    by_value, _ = _mean_difference_p(base, new)
    return {"p_value": min(1.0, 2 * min(by_rank, by_value)), **figures}


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
    test = drift_test(base, new)
    p_value = test["p_value"]
    low, high = before["median"], after["median"]
    change = None if low is None or high is None else high - low
    if scale is None:
        scale = low
    significant = (p_value is not None and p_value < ALPHA and change is not None and scale is not None
                   and abs(change) >= MIN_CHANGE * abs(scale) and change != 0)
    return {"base": low, "new": high, "change": change, "ratio": high / low if change is not None and low else None,
            "p_value": p_value, "significant": significant, "steps": {"base": len(base), "new": len(new)},
            "autocorrelation": test["autocorrelation"], "effective_steps": test["effective_steps"],
            "mean": {"base": before["mean"], "new": after["mean"]}, "p90": {"base": before["p90"], "new": after["p90"]}}
