"""The diff's test on drifting steps, simulated: real step times drift (throttling, length-bucketed batches,
neighbours), so consecutive steps are alike and a test that takes them for independent ones calls an
unchanged job changed far more often than it claims (Mann-Whitney's U: 7-9 % of pairs at a nominal 1 %).

Runs of 300 steps with AR(1) drift, correlation 0.9 and 3 % spread (the marginal standard deviation), as
``ds-profutils diff`` sees them: warm-up left out, then :func:`compare`.  Goals (DESIGN.md "Diff"):
unchanged pairs called changed in <= 2 %, a 6 % slower run found in >= 90 %.  Seeded, so the rates are
fixed numbers; run with ``-s`` to see them.
"""
from __future__ import annotations

import math
import random

import pytest

from ds_profutils.diff.stats import compare, effective_steps, warmup_steps

STEPS, CORRELATION, SPREAD = 300, 0.9, 0.03
UNCHANGED_PAIRS, SLOWER_PAIRS = 1000, 300


def drifting_run(rng: random.Random, slower: float = 0.0) -> list:
    """One run's step times (ms) after warm-up: 100 ms * (1 + slower) times an AR(1) drift of SPREAD."""
    innovation = SPREAD * math.sqrt(1 - CORRELATION ** 2)
    drift = rng.gauss(0.0, SPREAD)
    steps = []
    for _ in range(STEPS):
        steps.append(100.0 * (1 + slower) * (1 + drift))
        drift = CORRELATION * drift + rng.gauss(0.0, innovation)
    return steps[warmup_steps(STEPS):]


def rate(rng: random.Random, pairs: int, slower: float) -> float:
    return sum(compare(drifting_run(rng), drifting_run(rng, slower))["significant"] for _ in range(pairs)) / pairs


def test_unchanged_drifting_runs_are_called_changed_in_at_most_2_percent_of_pairs():
    called = rate(random.Random(2026), UNCHANGED_PAIRS, 0.0)
    print(f"unchanged AR(1) pairs called changed: {called:.1%} of {UNCHANGED_PAIRS}")
    assert called <= 0.02


def test_a_6_percent_slower_drifting_run_is_found_in_at_least_90_percent_of_pairs():
    found = rate(random.Random(2027), SLOWER_PAIRS, 0.06)
    print(f"6% slower AR(1) runs found: {found:.1%} of {SLOWER_PAIRS}")
    assert found >= 0.90


def test_the_effective_steps_follow_the_correlation():
    """AR(1) with correlation 0.9 has an autocorrelation time of 19 steps: ~14 effective steps in 270; steps
    drawn independently count as what they are."""
    rng = random.Random(5)
    lag1, steps = effective_steps(drifting_run(rng))
    assert 0.75 < lag1 < 0.97 and 6 < steps < 30
    lag1, steps = effective_steps([rng.gauss(100.0, 3.0) for _ in range(270)])
    assert abs(lag1) < 0.15 and steps == pytest.approx(270, rel=0.25)


def test_the_figures_the_test_used_are_in_its_result():
    found = compare(drifting_run(random.Random(8)), drifting_run(random.Random(9), 0.10))
    assert found["significant"] and found["p_value"] < 0.01
    assert set(found["autocorrelation"]) == set(found["effective_steps"]) == {"base", "new"}
    assert all(steps < 60 for steps in found["effective_steps"].values())


def test_a_slower_run_on_a_shared_machine_is_found_through_its_slow_steps():
    """36 steps after warm-up, 12 % of them 0.2-1 s slow (other jobs on the machine): a mean's standard error
    drowns in them, the ranks do not.  A run 20 ms slower (of 28 ms) is found; an unchanged one is not called."""
    rng = random.Random(3)

    def run(slower_ms: float) -> list:
        return [28.0 + slower_ms + rng.expovariate(1 / 3) + (rng.uniform(200, 1000) if rng.random() < 0.12 else 0.0)
                for _ in range(36)]

    found = sum(compare(run(0.0), run(20.0))["significant"] for _ in range(200)) / 200
    called = sum(compare(run(0.0), run(0.0))["significant"] for _ in range(300)) / 300
    print(f"shared machine: 20 ms slower found {found:.1%} of 200, unchanged called {called:.1%} of 300")
    assert found >= 0.95 and called <= 0.02
