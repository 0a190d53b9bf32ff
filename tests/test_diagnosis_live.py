"""The live ``ds_profutils/straggler_cause`` event and the console's word for it: the interval's straggler judged
by the same decision as the report (ds_profutils.diagnosis.causes) from every rank's packed interval."""
import pytest

from ds_profutils.engine.live.interval import interval_events
from ds_profutils.engine.live.sinks import console_line

from test_live_metrics import figures, rows_of


def cause_of(fast, slow, steps=4):
    rows = rows_of([[figures(s, **fast) for s in range(steps)], [figures(s, **slow) for s in range(steps)]])
    return dict((name, value) for name, value, _ in interval_events(rows, steps, 3, None))


# rank 0 waits 60 ms for rank 1 in the collectives each step; rank 1's step is as long, spent otherwise
WAITER = dict(step_ms=100.0, collective_ms=65.0, exposed_wait_ms=60.0, gap_ms=2.0, flops=10**12, tokens=1000,
              eval_ms=0.0, save_ms=0.0)


@pytest.mark.parametrize("slow, code", [
    (dict(step_ms=80.0, collective_ms=5.0, exposed_wait_ms=0.0, gap_ms=2.0, flops=2 * 10**12, tokens=2000), 1),
    (dict(step_ms=40.0, collective_ms=5.0, exposed_wait_ms=0.0, gap_ms=62.0, flops=10**12, tokens=1000), 2),
    (dict(step_ms=100.0, collective_ms=5.0, exposed_wait_ms=0.0, gap_ms=2.0, flops=10**12, tokens=1000), 3),
    # slower in every forward, 3 eval forwards between steps among them: its gap is eval time, no input pipeline
    (dict(step_ms=100.0, collective_ms=5.0, exposed_wait_ms=0.0, gap_ms=302.0, eval_ms=300.0, save_ms=0.0,
          flops=10**12, tokens=1000), 3),
    # as fast, but alone evaluating (or saving) between steps: late by its gap, its eval forwards: eval_or_save, as
    # the report counts such a step in cause_steps
    (dict(step_ms=40.0, collective_ms=5.0, exposed_wait_ms=0.0, gap_ms=62.0, eval_ms=60.0, save_ms=0.0,
          flops=10**12, tokens=1000), 6),
    (dict(step_ms=40.0, collective_ms=5.0, exposed_wait_ms=0.0, gap_ms=62.0, eval_ms=0.0, save_ms=60.0,
          flops=10**12, tokens=1000), 6),
])
def test_the_straggler_cause_code(slow, code):
    events = cause_of(WAITER, slow)
    assert events["ds_profutils/straggler_rank"] == 1 and events["ds_profutils/straggler_cause"] == code


def test_no_straggler_no_cause():
    even = dict(step_ms=100.0, collective_ms=10.0)
    events = cause_of(even, even)
    assert events["ds_profutils/straggler_rank"] == -1 and events["ds_profutils/straggler_cause"] == 0


def test_tokens_stand_in_where_a_rank_counted_no_flops():
    slow = dict(step_ms=80.0, collective_ms=5.0, exposed_wait_ms=0.0, gap_ms=2.0, flops=None, tokens=2000)
    assert cause_of(WAITER, slow)["ds_profutils/straggler_cause"] == 1


def test_the_console_line_gives_the_word():
    events = [("ds_profutils/step_ms", 5.0, 3), ("ds_profutils/straggler_rank", 1, 3),
              ("ds_profutils/straggler_cause", 1, 3)]
    assert console_line(events) == "ds_profutils step 3: step 5.0 ms, straggler rank 1 (more_work)"
    events[-1] = ("ds_profutils/straggler_cause", 2, 3)
    assert console_line(events).endswith("straggler rank 1 (input_pipeline)")
    events[-1] = ("ds_profutils/straggler_cause", 6, 3)
    assert console_line(events).endswith("straggler rank 1 (eval_or_save)")
