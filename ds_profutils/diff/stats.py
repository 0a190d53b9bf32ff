"""Whether a figure changed between two sides (one run or several each) beyond noise: the warm-up rule and the test.

Per-step figures are not independent: real step times drift (thermal throttling, length-bucketed batches, a
neighbour's load), so consecutive steps are alike and 300 steps hold far fewer independent looks.  So a run's
mean has the standard error of its *effective steps* ``n / tau``: ``tau``, the integrated autocorrelation time,
is the larger of the lag-1 AR(1) estimate (``(1 + r) / (1 - r)``, ``r`` corrected for its small-sample bias)
and Geyer's initial positive sequence (which follows drift of any shape), kept between 1 and ``n``.  Both runs
of a comparison are one job's steps, so ``tau`` is estimated from all of them at once (each run about its own
mean): twice the steps make a steadier estimate, which is where the test's power comes from.  Runs of very
different lengths (one over ``_POOLED_LENGTHS`` times another) each keep their own: 3 steps beside 5,000 tell
nothing about each other's correlation.

A few steps of a second on a shared machine would swamp a mean's standard error, so the values are first
winsorized: each run's steps kept within ``WINSOR`` robust standard deviations (1.4826 x the median absolute
deviation from each run's median, one scale for all runs) of its median.  Drifting steps are not touched (4
standard deviations), the outliers are held at the limit.

One run per side: the difference of the two (winsorized) means over its standard error, Student's t with
Welch's degrees of freedom on the effective steps, pure Python (no scipy).  It sees changes beyond the noise
*within* a run; an offset between nodes or reruns of one job (1.5 % apart: called changed in 16 % of pairs)
looks the same as a change, and only several runs per side separate the two.  Several runs per side: each
run's mean is one look, and the test is Student's t on the runs' means with the pooled variance between the
runs of each side (at least a run mean's own within-run variance), ``runs - 2`` degrees of freedom.

Simulated in ``tests/test_diff_drift.py`` (AR(1), correlation 0.9, 3 % spread, 300 steps): one run per side,
unchanged pairs are called changed in about 1 % and a 6 % slower run is found in about 97 %; three runs per
side with run levels 1.5 % apart (sd of two runs' difference): unchanged about 3 %, 6 % slower about 97 %.  With thousands of steps
the test alone finds a 0.3 % shift nobody should act on, so a change counts only where the test says so AND
the medians differ by at least ``MIN_CHANGE`` of a stated scale (the figure's own base median, or the step
time's for a part of the step).
"""
from __future__ import annotations

import math
import operator
from statistics import fmean, median
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .student import t_two_sided_p

__all__ = ["ALPHA", "FEW_EFFECTIVE_STEPS", "MIN_CHANGE", "MIN_STEPS", "RUNS_ALPHA", "WARMUP_SHARE", "WARMUP_STEPS",
           "WINSOR", "compare", "compare_runs", "drift_test", "effective_steps", "percentile", "significance_rule",
           "unchanged_words", "verdict_words", "warmup_steps"]

ALPHA = 0.01
"""One run per side: a change is beyond noise where the test's two-sided p-value is below this ..."""
RUNS_ALPHA = 0.05
"""... several runs per side: below this.  Three runs a side leave the t-test on their means 4 degrees of
freedom: at 0.01 it finds a 6 % slower configuration in half the cases; at 0.05 (with the ``MIN_CHANGE`` gate)
unchanged reruns whose levels are 1.5 % apart (sd of two runs' difference) are called changed in 2.7 % and 97 %
of the slower ones are found (4,000 and 3,000 simulated sides) ..."""
MIN_CHANGE = 0.02
"""... and the medians differ by at least this share of the scale (the base median, or the base step time)."""
WARMUP_STEPS = 2
"""The first recorded train steps of each run left out: at least this many ..."""
WARMUP_SHARE = 0.10
"""... or this share of the run's recorded train steps (rounded up), whichever is more."""
MIN_STEPS = 3
"""Steps after warm-up each run needs for the test (fewer: no p-value, never a change)."""
WINSOR = 4.0
"""Values beyond this many robust standard deviations from their run's median are held at that limit."""
FEW_EFFECTIVE_STEPS = 5.0
"""One run per side: with fewer effective steps than this on either side, "no significant change" is said to be
weak.  n effective steps a side leave the test about 2n - 2 degrees of freedom, so at p < 0.01 a change must pass
4.6 standard errors at 3 a side, 9.9 at 2, 64 at 1.  A 12-step run whose steps drift together has about 1, and a
+255% change went unseen in one."""
_ROBUST_SD = 1.4826  # the median absolute deviation of a normal sample times this is its standard deviation
_MAX_LAG = 2000  # Geyer's sequence stops far earlier on any series that does not drift for thousands of steps
_MAX_LAG1 = 0.99  # a lag-1 correlation is taken as at most this (tau <= 199): a run of one repeated value
_POOLED_LENGTHS = 2.0  # runs within this factor of each other's length share one autocorrelation estimate

Runs = Sequence[Sequence[float]]


def warmup_steps(steps: int) -> int:
    """How many leading recorded train steps of a run of ``steps`` are warm-up (all of a run of 2 or fewer)."""
    return min(steps, max(WARMUP_STEPS, math.ceil(WARMUP_SHARE * steps)))


def verdict_words(figure: Mapping[str, Any], more: str = "SLOWER", less: str = "FASTER") -> str:
    """A compared figure's verdict in words (``more``/``less``: its direction's names): beyond which noise it
    changed, or why it was not tested, or that it did not change (:func:`unchanged_words`)."""
    if figure["significant"]:
        beyond = "within-run noise" if figure["method"] == "within runs" else "the spread between reruns"
        return (more if figure["change"] > 0 else less) + f", beyond {beyond}"
    if figure["p_value"] is None:
        return (f"too few steps after warm-up to test ({figure['steps']['base']} and {figure['steps']['new']}; the "
                f"test needs {MIN_STEPS} or more in each)")
    return unchanged_words(figure)


def unchanged_words(figure: Mapping[str, Any]) -> str:
    """How a tested figure that did not change beyond noise is said: plainly, or weakly where one run per side
    has too few effective steps for the test to see any but a very large change (:data:`FEW_EFFECTIVE_STEPS`)."""
    effective = figure.get("effective_steps") or {}
    if figure.get("method") == "within runs" and None not in effective.values() and \
            min(effective.values(), default=FEW_EFFECTIVE_STEPS) < FEW_EFFECTIVE_STEPS:
        return (f"no significant change, but with {effective['base']:.1f} and {effective['new']:.1f} effective steps "
                "(the steps drift together) the test sees only very large changes: record longer runs")
    return "no significant change"


def significance_rule() -> str:
    """The rule in words, as the output states it."""
    return (f"per-step figures after warm-up (the first {WARMUP_STEPS} recorded train steps or "
            f"{WARMUP_SHARE:.0%}, whichever is more), each run's steps held within {WINSOR:g} robust standard "
            f"deviations of its median; each run's mean has the standard error of its effective steps (steps / tau, "
            f"tau the autocorrelation time of all runs' steps: the larger of the bias-corrected lag-1 AR(1) estimate "
            f"and Geyer's initial positive sequence), so that drifting steps are not taken for independent ones; one "
            f"run per side: Student's t with Welch's degrees of freedom on the effective steps, p < {ALPHA:g} (this "
            f"sees changes beyond within-run noise; offsets between nodes or reruns need several runs per side); "
            f"several runs per side: Student's t on the runs' means, pooled between-run variance, p < {RUNS_ALPHA:g}; "
            f"and the medians differ by >= {MIN_CHANGE:.0%} (of the base median; for a part of the step, of the "
            f"base median step time)")


def _winsorized(runs: Runs) -> List[List[float]]:
    """Each run's values held within ``WINSOR`` robust standard deviations (one scale for all runs) of its median."""
    centres = [median(run) for run in runs]
    scale = _ROBUST_SD * median([abs(value - centre) for run, centre in zip(runs, centres) for value in run])
    if scale <= 0.0:
        return [list(run) for run in runs]
    return [[min(centre + WINSOR * scale, max(centre - WINSOR * scale, value)) for value in run]
            for run, centre in zip(runs, centres)]


def _autocorrelation(runs: Runs) -> Tuple[Optional[float], float]:
    """(lag-1 autocorrelation, autocorrelation time tau >= 1) of the runs' steps, each run about its own mean;
    (None, 1.0) where they are too short or too flat to estimate it from."""
    centred = [[value - mean for value in run] for run, mean in ((run, fmean(run)) for run in runs)]
    total = sum(value * value for run in centred for value in run)
    shortest = min(len(run) for run in centred)
    if shortest < 3 or total <= 0.0:
        return None, 1.0

    def lag(k: int) -> float:  # zip stops at the shorter: len - k terms per run
        return sum(sum(map(operator.mul, run, run[k:])) for run in centred) / total

    lag1 = lag(1)
    per_run = sum(len(run) for run in centred) / len(centred)
    corrected = min(_MAX_LAG1, max(0.0, lag1 + (1 + 4 * lag1) / per_run))  # Kendall's bias of the lag-1 estimate
    tau = (1 + corrected) / (1 - corrected)
    # Geyer's initial positive sequence: tau = -1 + 2 * sum of the pair sums rho(2m) + rho(2m + 1), taken while
    # positive and kept non-increasing (past that point the sample autocorrelations are noise).
    geyer, previous, pair = -1.0, math.inf, 0
    while 2 * pair + 1 < min(shortest, _MAX_LAG):
        term = 1.0 + lag1 if pair == 0 else lag(2 * pair) + lag(2 * pair + 1)
        if term <= 0.0:
            break
        previous = min(previous, term)
        geyer += 2 * previous
        pair += 1
    return lag1, max(tau, geyer, 1.0)


def _autocorrelation_times(runs: Runs) -> Tuple[Optional[float], List[float]]:
    """(lag-1 autocorrelation, tau per run): one estimate from all runs where their lengths are alike, else each
    run's own (the lag-1 figure then the longest run's)."""
    lengths = [len(run) for run in runs]
    if max(lengths) <= _POOLED_LENGTHS * min(lengths):
        lag1, tau = _autocorrelation(runs)
        return lag1, [tau] * len(runs)
    found = [_autocorrelation([run]) for run in runs]
    return found[lengths.index(max(lengths))][0], [tau for _, tau in found]


def effective_steps(values: Sequence[float]) -> Tuple[Optional[float], float]:
    """(lag-1 autocorrelation, effective steps ``n / tau``) of one series in step order; tau between 1 and n."""
    if len(values) < 3:
        return None, float(len(values))
    lag1, tau = _autocorrelation([values])
    return lag1, len(values) / min(tau, float(len(values)))


def _mean_variance(run: Sequence[float], tau: float) -> Tuple[float, float]:
    """(effective steps, variance of the mean) of one run with autocorrelation time ``tau``."""
    steps = len(run) / min(tau, float(len(run)))
    mean = fmean(run)
    return steps, sum((value - mean) ** 2 for value in run) / (len(run) - 1) / steps


def _within(base: Sequence[float], new: Sequence[float], taus: Sequence[float]) -> Tuple[float, Dict[str, float]]:
    """One run per side: the two-sided p of the difference of means on effective steps, and those steps."""
    (base_steps, base_var), (new_steps, new_var) = _mean_variance(base, taus[0]), _mean_variance(new, taus[1])
    difference, error = fmean(new) - fmean(base), base_var + new_var
    if error <= 0.0:  # each run one repeated value: a change where they differ
        return (1.0 if difference == 0 else 0.0), {"base": base_steps, "new": new_steps}
    freedom = error ** 2 / (base_var ** 2 / max(base_steps - 1, 1.0) + new_var ** 2 / max(new_steps - 1, 1.0))
    return t_two_sided_p(difference / math.sqrt(error), freedom), {"base": base_steps, "new": new_steps}


def _between(base: Runs, new: Runs, taus: Sequence[float]) -> Tuple[float, Dict[str, float]]:
    """Several runs per side: Student's t on the runs' means, the pooled variance between the runs of each side
    (at least a run mean's within-run variance: a run mean varies at least that much), runs - 2 freedom."""
    sides = (base, new)
    within = [[_mean_variance(run, tau) for run, tau in zip(side, side_taus)]
              for side, side_taus in zip(sides, (taus[:len(base)], taus[len(base):]))]
    means = [[fmean(run) for run in side] for side in sides]
    spread = sum((mean - fmean(side)) ** 2 for side in means for mean in side) / (len(base) + len(new) - 2)
    spread = max(spread, fmean([variance for side in within for _, variance in side]))
    difference = fmean(means[1]) - fmean(means[0])
    error = spread * (1 / len(base) + 1 / len(new))
    steps = {run: sum(found for found, _ in side) for run, side in zip(("base", "new"), within)}
    if error <= 0.0:
        return (1.0 if difference == 0 else 0.0), steps
    return t_two_sided_p(difference / math.sqrt(error), len(base) + len(new) - 2), steps


def drift_test(base: Runs, new: Runs) -> Dict[str, Any]:
    """The two-sided p-value that the runs of ``base`` and ``new`` come from one drifting job, with the figures it
    used (lag-1 autocorrelation of all runs, effective steps per side, the method and its level); p None where a
    run has fewer than ``MIN_STEPS`` (its correlation cannot be estimated from fewer)."""
    several = len(base) > 1 and len(new) > 1
    found: Dict[str, Any] = {"p_value": None, "autocorrelation": None, "effective_steps": {"base": None, "new": None},
                             "method": "between runs" if several else "within runs",
                             "alpha": RUNS_ALPHA if several else ALPHA}
    if not base or not new or min(len(run) for run in (*base, *new)) < MIN_STEPS:
        return found
    runs = _winsorized([*base, *new])
    lag1, taus = _autocorrelation_times(runs)
    if several:
        p_value, steps = _between(runs[:len(base)], runs[len(base):], taus)
    else:
        p_value, steps = _within(runs[0], runs[1], taus)
    return {**found, "p_value": p_value, "autocorrelation": lag1, "effective_steps": steps}


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


def compare_runs(base: Runs, new: Runs, scale: Optional[float] = None) -> Dict[str, Any]:
    """One figure of two sides, each one run or several (a list of per-step values per run): the medians of all
    their steps, their change and ratio, the test, and the verdict.

    ``scale``: what ``MIN_CHANGE`` is a share of (default: the base median).  ``mean`` and ``p90`` are shown
    beside the medians; the means of the parts of a step add up to the step's.
    """
    before = _summary([value for run in base for value in run])
    after = _summary([value for run in new for value in run])
    base, new = [run for run in base if run], [run for run in new if run]
    test = drift_test(base, new)
    p_value = test["p_value"]
    low, high = before["median"], after["median"]
    change = None if low is None or high is None else high - low
    if scale is None:
        scale = low
    significant = (p_value is not None and p_value < test["alpha"] and change is not None and scale is not None
                   and abs(change) >= MIN_CHANGE * abs(scale) and change != 0)
    return {"base": low, "new": high, "change": change, "ratio": high / low if change is not None and low else None,
            "p_value": p_value, "significant": significant, "method": test["method"], "alpha": test["alpha"],
            "runs": {"base": len(base), "new": len(new)},
            "steps": {"base": sum(map(len, base)), "new": sum(map(len, new))},
            "autocorrelation": test["autocorrelation"], "effective_steps": test["effective_steps"],
            "mean": {"base": before["mean"], "new": after["mean"]}, "p90": {"base": before["p90"], "new": after["p90"]}}


def compare(base: Sequence[float], new: Sequence[float], scale: Optional[float] = None) -> Dict[str, Any]:
    """:func:`compare_runs` of one run per side."""
    return compare_runs([base], [new], scale)
