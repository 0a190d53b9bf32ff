"""The live pipeline figures (engine/live): ``bubble_share`` and ``slowest_stage`` from every rank's interval,
and the console line with them; a non-pipeline engine's rows and events stay as they were."""
from __future__ import annotations

from typing import List, Optional

import pytest

from ds_profutils.engine.live import EVENT_NAMES, PIPELINE_EVENT_NAMES, StepFigures, console_line
from ds_profutils.diagnosis.causes import CAUSE_CODES
from ds_profutils.engine.live.interval import interval_events, pack_interval, packed_length


def interval(stage: Optional[int], compute_ms: float, steps: int = 4) -> List[StepFigures]:
    return [StepFigures(global_step=step, step_ms=100.0, iteration_ms=101.0, gap_ms=1.0, flops=None, tokens=None,
                        samples=4, exposed_wait_ms=5.0, collective_ms=5.0, peak_allocated_bytes=None,
                        pipe_stage=stage, compute_ms=None if stage is None else compute_ms,
                        bubble_ms=None if stage is None else 100.0 - compute_ms) for step in range(steps)]


def events_of(*ranks: List[StepFigures]) -> dict:
    rows = [pack_interval(steps) for steps in ranks]
    return {name: value for name, value, _ in interval_events(rows, len(ranks[0]), 3, None)}


def test_a_slow_stage_and_the_bubble_share() -> None:
    events = events_of(interval(0, 20.0), interval(1, 60.0))
    assert events["ds_profutils/slowest_stage"] == 1
    assert events["ds_profutils/bubble_share"] == pytest.approx((80.0 + 40.0) / 200.0)
    assert list(events)[-2:] == list(PIPELINE_EVENT_NAMES)
    line = console_line([(name, value, 3) for name, value in events.items()])
    assert line.endswith("bubble 60%, slowest stage 1")


def test_balanced_stages_name_none() -> None:
    events = events_of(interval(0, 50.0), interval(1, 55.0))
    assert events["ds_profutils/slowest_stage"] == -1
    assert "no slow stage" in console_line([(name, value, 3) for name, value in events.items()])


def test_stage_compute_is_the_median_over_its_ranks() -> None:
    """Stage 1's three data-parallel ranks: one slow rank is not a slow stage (the median of 60, 20 and 20)."""
    events = events_of(*(interval(0, 20.0) for _ in range(3)), interval(1, 60.0), interval(1, 20.0), interval(1, 20.0))
    assert events["ds_profutils/slowest_stage"] == -1


def test_no_pipeline_events_for_other_engines() -> None:
    steps = interval(None, 0.0)
    assert len(pack_interval(steps)) == packed_length(len(steps))  # the pipeline columns NaN
    assert set(events_of(steps, steps)) <= set(EVENT_NAMES)


def waiting(stage: int, waited_ms: float, steps: int = 4) -> List[StepFigures]:
    """A stage's rank that waited ``waited_ms`` in collectives each step (the slower stage's neighbour waits)."""
    return [StepFigures(global_step=step, step_ms=100.0, iteration_ms=101.0, gap_ms=1.0, flops=None, tokens=None,
                        samples=4, exposed_wait_ms=waited_ms, collective_ms=waited_ms, peak_allocated_bytes=None,
                        pipe_stage=stage, compute_ms=60.0 - waited_ms, bubble_ms=waited_ms) for step in range(steps)]


def test_the_live_straggler_is_never_named_across_stages() -> None:
    """Stage 0 waits 40 ms a step for stage 1 (which waits 5): a slower stage, no straggler, as in the report."""
    events = events_of(waiting(0, 40.0), waiting(1, 5.0))
    assert events["ds_profutils/straggler_rank"] == -1 and events["ds_profutils/straggler_cause"] == 0


def test_the_live_straggler_within_a_stage_is_named_by_its_row() -> None:
    """Stage 1's two data-parallel ranks: the one that waited least (row 3) held its peer back."""
    events = events_of(waiting(0, 40.0), waiting(0, 40.0), waiting(1, 45.0), waiting(1, 5.0))
    assert events["ds_profutils/straggler_rank"] == 3


def pipe(stage: int, compute_ms: float, p2p_ms: float, inside_ms: float, steps: int = 4) -> List[StepFigures]:
    """A rank of a 2-stage, 2-way data-parallel pipeline: its compute, its sends and receives, its time inside the
    stage's gradient all-reduce."""
    return [StepFigures(global_step=step, step_ms=60.0, iteration_ms=61.0, gap_ms=1.0, flops=None, tokens=None,
                        samples=4, exposed_wait_ms=inside_ms, collective_ms=inside_ms, peak_allocated_bytes=None,
                        pipe_stage=stage, compute_ms=compute_ms, bubble_ms=p2p_ms + 1.0) for step in range(steps)]


def test_the_live_straggler_is_the_slow_rank_not_its_pipe_neighbour_that_waited_for_it() -> None:
    """Rank 3 (stage 1) computes 44 ms a step where its peer computes 3; rank 1 (stage 0, rank 3's pipe) waits for it
    in its receives, so it too reaches its stage's all-reduce last, at its peer's pace.  Named: rank 3, compute (its
    own compute stands out), not rank 1 (stage 0 comes first; its busy time with the waits in it looked like compute)."""
    events = events_of(pipe(0, 2.3, 4.5, 49.6), pipe(0, 2.4, 46.4, 7.8), pipe(1, 2.9, 4.1, 50.1), pipe(1, 44.1, 4.7, 8.3))
    assert events["ds_profutils/straggler_rank"] == 3
    assert events["ds_profutils/straggler_cause"] == CAUSE_CODES["compute"]
