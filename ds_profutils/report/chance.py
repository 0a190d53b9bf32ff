"""Is a count more than chance would give?  The exact one-sided binomial test, in pure Python.

The report's overall straggler verdict asks whether a rank (or a host) was a step's straggler more
often than it would be if the step stragglers fell on the ranks at random.  ``ds-profutils report``
must start in a fraction of a second and never import scipy, so the upper tail is summed here: terms
in log space (``lgamma``), from the count upwards, stopping once past the mode they no longer change
the sum.
"""
from __future__ import annotations

import math

__all__ = ["binomial_upper_tail"]

_NEGLIGIBLE = 1e-17  # a term this small relative to the sum cannot change a double


def binomial_upper_tail(count: int, trials: int, chance: float) -> float:
    """P(X >= count) for X ~ Binomial(trials, chance): the p-value of seeing ``count`` or more."""
    if count <= 0 or chance >= 1.0:
        return 1.0
    if count > trials or chance <= 0.0:
        return 0.0
    log_chance, log_other = math.log(chance), math.log1p(-chance)
    log_all = math.lgamma(trials + 1)
    mode = trials * chance
    total = 0.0
    for successes in range(count, trials + 1):
        term = math.exp(log_all - math.lgamma(successes + 1) - math.lgamma(trials - successes + 1)
                        + successes * log_chance + (trials - successes) * log_other)
        total += term
        if successes > mode and term <= total * _NEGLIGIBLE:
            break
    return min(1.0, total)
