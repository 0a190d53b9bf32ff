"""Live metrics (ds_profutils.engine.live) in one process: the interval, the events' names and values,
the straggler choice, the sinks and their failures.  The 2-rank gather: test_live_metrics_launcher.py."""
import logging
import math
from types import SimpleNamespace

import pytest

from ds_profutils._straggler import step_straggler
from ds_profutils.engine.live import (EVENT_NAMES, ConsoleSink, LiveMetrics, StepFigures, console_line,
                                      monitor_sink)
from ds_profutils.engine.live.decisions import STOP, UNREAD, decide
from ds_profutils.logging import warning_once
from ds_profutils.engine.live.interval import interval_events, pack_interval, packed_length

GIB = 1 << 30


class Recorded:
    """A sink that keeps what it was sent."""

    def __init__(self):
        self.writes = []

    def write(self, events):
        self.writes.append(list(events))


def figures(global_step, step_ms=100.0, iteration_ms=120.0, gap_ms=20.0, flops=2 * 10**12, tokens=1000,
            exposed_wait_ms=10.0, collective_ms=30.0, peak=2 * GIB, eval_ms=4.0, save_ms=2.0):
    return StepFigures(global_step=global_step, step_ms=step_ms, iteration_ms=iteration_ms, gap_ms=gap_ms,
                       flops=flops, tokens=tokens, samples=4, exposed_wait_ms=exposed_wait_ms,
                       collective_ms=collective_ms, peak_allocated_bytes=peak, eval_ms=eval_ms, save_ms=save_ms)


def live(interval=3, console=False, peak_tflops=None, sinks=None):
    return LiveMetrics(SimpleNamespace(monitor_interval=interval, console=console), peak_tflops, sinks or [])


def test_events_every_interval_at_its_last_step_with_every_name_in_order():
    sink = Recorded()
    metrics = live(interval=3, peak_tflops=100.0, sinks=[sink])
    for step in range(10, 18):
        metrics.step_finished(figures(step))
    assert [{s for _, _, s in write} for write in sink.writes] == [{12}, {15}]
    assert [[name for name, _, _ in write] for write in sink.writes] == [list(EVENT_NAMES)] * 2
    metrics.close()  # the unfinished interval (steps 16, 17) is dropped: no gather at close
    assert len(sink.writes) == 2


def test_values_of_one_rank():
    sink = Recorded()
    metrics = live(interval=4, peak_tflops=50.0, sinks=[sink])
    steps = [
        figures(0, step_ms=100.0, iteration_ms=None, gap_ms=None, peak=1 * GIB),
        figures(1, step_ms=104.0, iteration_ms=130.0, gap_ms=26.0, peak=3 * GIB),
        figures(2, step_ms=96.0, iteration_ms=110.0, gap_ms=14.0, peak=2 * GIB),
        figures(3, step_ms=300.0, iteration_ms=320.0, gap_ms=20.0, peak=None),
    ]
    for step in steps:
        metrics.step_finished(step)
    got = {name: value for name, value, _ in sink.writes[0]}
    wall_s = (100.0 + 130.0 + 110.0 + 320.0) / 1e3  # the first step has no iteration time: its step time
    assert got["ds_profutils/step_ms"] == pytest.approx(102.0)  # medians: one slow step moves them little
    assert got["ds_profutils/iteration_ms"] == pytest.approx(130.0)
    assert got["ds_profutils/gap_ms"] == pytest.approx(20.0)
    assert got["ds_profutils/tflops"] == pytest.approx(4 * 2.0 / wall_s)
    assert got["ds_profutils/mfu"] == pytest.approx(4 * 2.0 / wall_s / 50.0)
    assert got["ds_profutils/tokens_per_s"] == pytest.approx(4000 / wall_s)
    assert got["ds_profutils/exposed_wait_share"] == pytest.approx(40.0 / 600.0)
    assert got["ds_profutils/peak_allocated_gib"] == pytest.approx(3.0)
    assert got["ds_profutils/straggler_rank"] == -1  # one rank: nobody to wait for


@pytest.mark.parametrize("unknown, in_steps, missing", [
    ({"flops": None}, [1], {"tflops", "mfu"}),  # a sum that misses a step would pass for the whole
    ({"tokens": None}, [1], {"tokens_per_s"}),
    ({"peak": None}, [0, 1], {"peak_allocated_gib"}),  # medians and maxima: over the steps that have them
    ({"iteration_ms": None, "gap_ms": None}, [0, 1], {"iteration_ms", "gap_ms"}),
])
def test_an_unknown_figure_leaves_its_events_out(unknown, in_steps, missing):
    sink = Recorded()
    metrics = live(interval=2, peak_tflops=100.0, sinks=[sink])
    for step in range(2):
        metrics.step_finished(figures(step, **(unknown if step in in_steps else {})))
    names = {name for name, _, _ in sink.writes[0]}
    assert names == {name for name in EVENT_NAMES if name.split("/")[1] not in missing}


def test_no_mfu_without_a_peak():
    sink = Recorded()
    metrics = live(interval=1, sinks=[sink])
    metrics.step_finished(figures(0))
    assert "ds_profutils/tflops" in {n for n, _, _ in sink.writes[0]} - {"ds_profutils/mfu"}
    assert "ds_profutils/mfu" not in {n for n, _, _ in sink.writes[0]}


def rows_of(per_rank):
    """Packed rows of several ranks: per_rank[r] = that rank's list of StepFigures."""
    return [pack_interval(steps) for steps in per_rank]


def test_across_ranks_worst_rank_sums_and_per_rank_means():
    slow = [figures(s, step_ms=150.0, iteration_ms=200.0, gap_ms=80.0, collective_ms=5.0, flops=None, peak=5 * GIB)
            for s in range(4)]
    fast = [figures(s, step_ms=140.0, iteration_ms=200.0, gap_ms=3.0, collective_ms=85.0, exposed_wait_ms=80.0)
            for s in range(4)]
    events = dict((name, value) for name, value, _ in interval_events(rows_of([fast, slow]), 4, 3, 10.0))
    assert events["ds_profutils/step_ms"] == 150.0 and events["ds_profutils/gap_ms"] == 80.0
    # only rank 0 counted FLOPs: the per-rank mean is over the ranks that did
    assert events["ds_profutils/tflops"] == pytest.approx(4 * 2.0 / 0.8)
    assert events["ds_profutils/mfu"] == pytest.approx(4 * 2.0 / 0.8 / 10.0)
    assert events["ds_profutils/tokens_per_s"] == pytest.approx(8000 / 0.8)  # all ranks' tokens
    assert events["ds_profutils/exposed_wait_share"] == pytest.approx((320 + 40) / (560 + 600))
    assert events["ds_profutils/peak_allocated_gib"] == 5.0
    assert events["ds_profutils/straggler_rank"] == 1  # least time inside the collectives: it came last


def collective_rows(per_step_collectives, step_ms=100.0):
    """Rows of ranks whose collective time per step is per_step_collectives[step][rank]."""
    ranks = len(per_step_collectives[0])
    return rows_of([[figures(s, step_ms=step_ms, collective_ms=per_step_collectives[s][r])
                     for s in range(len(per_step_collectives))] for r in range(ranks)])


@pytest.mark.parametrize("collectives, straggler", [
    ([[40, 5, 41]] * 4, 1),  # rank 1 every step
    ([[40, 5, 41], [40, 5, 41], [40, 5, 41], [5, 40, 41]], 1),  # 3 of 4 steps
    ([[40, 5, 41], [40, 5, 41], [5, 40, 41], [5, 40, 41]], -1),  # 2 of 4: not most of the steps
    ([[40, 31, 39]] * 4, -1),  # spread 9 ms < 10% of the 100 ms step
    ([[40, 30, 39]] * 4, 1),  # spread 10 ms: at the threshold
])
def test_straggler_is_the_step_straggler_of_most_steps(collectives, straggler):
    events = dict((name, value) for name, value, _ in interval_events(collective_rows(collectives), 4, 3, None))
    assert events["ds_profutils/straggler_rank"] == straggler


def test_the_step_rule_threshold_is_two_ms_at_least():
    assert step_straggler([3.0, 1.1], [5.0, 5.0]) is None  # spread 1.9 ms, 10% of 5 ms is 0.5 ms
    assert step_straggler([3.0, 1.0], [5.0, 5.0]) == 1
    assert step_straggler([3.0, float("nan")], [5.0, 5.0]) is None  # one rank with the figure


def test_console_line():
    events = [("ds_profutils/step_ms", 123.4, 40), ("ds_profutils/iteration_ms", 130.1, 40),
              ("ds_profutils/gap_ms", 6.7, 40), ("ds_profutils/tflops", 12.3, 40), ("ds_profutils/mfu", 0.041, 40),
              ("ds_profutils/tokens_per_s", 5120.0, 40), ("ds_profutils/exposed_wait_share", 0.08, 40),
              ("ds_profutils/peak_allocated_gib", 1.2, 40), ("ds_profutils/straggler_rank", 1, 40)]
    assert console_line(events) == ("ds_profutils step 40: step 123.4 ms, iteration 130.1 ms (gap 6.7), "
                                    "12.3 TFLOP/s, MFU 4.1%, 5,120 tok/s, wait 8%, peak 1.2 GiB, straggler rank 1")
    parts = events[:3] + [("ds_profutils/eval_ms", 80.1, 40), ("ds_profutils/save_ms", 35.0, 40)]
    assert console_line(parts) == ("ds_profutils step 40: step 123.4 ms, iteration 130.1 ms "
                                   "(gap 6.7; eval 80.1 ms, save 35.0 ms in the interval)")
    assert console_line(parts[:4]) == ("ds_profutils step 40: step 123.4 ms, iteration 130.1 ms "
                                       "(gap 6.7; eval 80.1 ms in the interval)")
    short = [("ds_profutils/step_ms", 5.0, 3), ("ds_profutils/straggler_rank", -1, 3)]
    assert console_line(short) == "ds_profutils step 3: step 5.0 ms, no straggler"


@pytest.mark.parametrize("console", [True, False])
def test_console_setting(console, capsys):
    metrics = live(interval=2, console=console)
    assert any(isinstance(sink, ConsoleSink) for sink in metrics.sinks) == console
    for step in range(4):
        metrics.step_finished(figures(step))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ds_profutils step")]
    assert [line.split(":")[0] for line in lines] == (["ds_profutils step 1", "ds_profutils step 3"] if console else [])


@pytest.mark.parametrize("reads", ["nothing", "a sink", "the console", "a rider"])
def test_the_exchange_stops_after_the_first_interval_where_nothing_reads_it(reads, ds_caplog):
    """The step records alone (no console line, no monitor, no framework reporting, no capture) keep no
    collective of ours on the step path: a blocking all-gather every interval that nobody reads."""
    warning_once.cache_clear()  # said once per process: each case says it afresh
    metrics = live(interval=2, console=reads == "the console", sinks=[Recorded()] if reads == "a sink" else [])
    if reads == "a rider":
        metrics.rider = SimpleNamespace(width=1, columns=lambda: [0.0], received=lambda *args: None)
    for step in range(6):
        metrics.step_finished(figures(step))
    assert metrics._gather.launched == (1 if reads == "nothing" else 3)
    assert metrics.stopped == (reads == "nothing")
    late = type("Late", (Recorded, ), {})()
    metrics.add_sink(late)  # too late where the exchange stopped: said, never a wait
    metrics.step_finished(figures(6))
    metrics.step_finished(figures(7))
    assert len(late.writes) == (0 if reads == "nothing" else 1)
    assert ("Late get no live events" in ds_caplog.text) == (reads == "nothing")


def test_on_the_deferred_path_the_stop_comes_two_intervals_on_and_a_sink_given_meanwhile_is_told(ds_caplog):
    warning_once.cache_clear()  # said once per process: this test says it afresh
    metrics = LiveMetrics(SimpleNamespace(monitor_interval=1, console=False), None, [], defer=True)
    metrics.step_finished(figures(0))  # its rows say nobody reads them: every rank stops at exchange 2
    assert not metrics.stopped
    metrics.add_sink(Recorded())
    assert "Recorded get no live events" in ds_caplog.text
    for step in range(1, 5):
        metrics.step_finished(figures(step))
    assert metrics.stopped and metrics._gather.launched == 2


@pytest.mark.parametrize("flags, unread", [((UNREAD, UNREAD), True), ((UNREAD, 0), False), ((0, UNREAD), False),
                                           ((UNREAD | STOP, UNREAD), True)])
def test_the_exchange_is_unread_only_where_every_rank_says_so(flags, unread):
    """Sinks may be given on rank 0 alone (the events are rank 0's): one rank that reads keeps every rank in."""
    assert decide(flags).unread == unread
    assert decide(flags).stop == any(flag & STOP for flag in flags)


def test_a_failing_sink_is_loud_once_and_the_others_go_on(ds_caplog):

    class Broken:

        def write(self, events):
            raise OSError("disk full")

    sink = Recorded()
    metrics = live(interval=1, sinks=[Broken(), sink])
    for step in range(3):
        metrics.step_finished(figures(step))
    assert len(sink.writes) == 3
    errors = [r for r in ds_caplog.records if r.levelno == logging.ERROR and "live metrics" in r.getMessage()]
    assert len(errors) == 1 and "Broken" in errors[0].getMessage() and "disk full" in errors[0].getMessage()


def test_deepspeed_monitor_sink_only_where_a_monitor_is_enabled_on_deepspeeds_samples_axis():
    written = []
    engine = SimpleNamespace(monitor=SimpleNamespace(enabled=True, write_events=written.append), global_steps=8,
                             global_samples=64, train_batch_size=lambda: 8)
    assert monitor_sink(SimpleNamespace(monitor=SimpleNamespace(enabled=False))) is None
    assert monitor_sink(SimpleNamespace()) is None
    sink = monitor_sink(engine)
    metrics = live(interval=1, peak_tflops=100.0, sinks=[sink, None])  # None: an engine without a monitor
    metrics.step_finished(figures(7))  # the 8th step (numbered from 0) ended: 64 samples trained
    engine.global_steps, engine.global_samples = 10, 80
    sink.write([("ds_profutils/step_ms", 1.0, 7)])  # step 7's events written 2 steps later (deferred)
    assert [name for name, _, _ in written[0]] == list(EVENT_NAMES)
    assert [{step for _, _, step in write} for write in written] == [{64}, {64}]


def test_wandbs_monitor_gets_a_deferred_interval_at_the_present_samples_the_others_at_their_own():
    """W&B drops every point below a step already logged, and DeepSpeed logs its own at the present samples."""
    wandb, csv = [], []
    monitor = SimpleNamespace(enabled=True, wandb_monitor=SimpleNamespace(write_events=wandb.append),
                              csv_monitor=SimpleNamespace(write_events=csv.append), tb_monitor=None,
                              comet_monitor=None, write_events=None)
    engine = SimpleNamespace(monitor=monitor, global_steps=10, global_samples=80, train_batch_size=lambda: 8)
    monitor_sink(engine).write([("ds_profutils/step_ms", 1.0, 7)])  # step 7's events written 2 steps later
    assert wandb == [[("ds_profutils/step_ms", 1.0, 80)]] and csv == [[("ds_profutils/step_ms", 1.0, 64)]]


@pytest.mark.parametrize("interval", [0, -1, 2.0, True, None])
def test_a_bad_interval_names_the_key(interval):
    with pytest.raises(ValueError, match="step_metrics.monitor_interval"):
        live(interval=interval)


def test_packed_rows_mark_unknown_with_nan():
    row = pack_interval([figures(0, iteration_ms=None, gap_ms=None, flops=None, tokens=None, peak=None)])
    assert len(row) == packed_length(1) == 2 + 8 + 3 + 3 and row[:2] == [100.0, 30.0]
    # the eight totals, the three pipeline columns (NaN outside a pipeline), then the gap's eval and save sums and
    # the median gap without them (unknown without a gap)
    assert [math.isnan(value) for value in row[2:]] == [True, True, False, True, True, False, False, True,
                                                        True, True, True, False, False, True]
    assert row[-3:-1] == [4.0, 2.0]
    assert pack_interval([figures(0, gap_ms=20.0), figures(1, gap_ms=30.0)])[-1] == 19.0  # (14 + 24) / 2


def test_eval_and_save_are_each_ranks_sum_over_the_interval_the_largest_over_ranks():
    evaluating = [figures(s, eval_ms=[0.0, 80.0, 0.0, 5.0][s], save_ms=[0.0, 0.0, 35.0, 0.0][s]) for s in range(4)]
    quiet = [figures(s, eval_ms=1.0, save_ms=0.0) for s in range(4)]
    events = dict((name, value) for name, value, _ in interval_events(rows_of([quiet, evaluating]), 4, 3, None))
    assert (events["ds_profutils/eval_ms"], events["ds_profutils/save_ms"]) == (85.0, 35.0)
    names = list(EVENT_NAMES)
    assert names.index("ds_profutils/gap_ms") + 1 == names.index("ds_profutils/eval_ms")  # sent beside the gap
    assert names.index("ds_profutils/eval_ms") + 1 == names.index("ds_profutils/save_ms")


def test_eval_and_save_are_left_out_when_zero_on_every_rank_and_an_empty_row_keeps_the_length():
    sink = Recorded()
    metrics = live(interval=2, sinks=[sink])
    metrics.step_finished(figures(0, eval_ms=0.0, save_ms=0.0))
    metrics.optimizer_step_ended(0)
    metrics.step_finished(figures(1, eval_ms=0.0, save_ms=3.0))
    metrics.optimizer_step_ended(1)
    names = {name for name, _, _ in sink.writes[0]}
    assert "ds_profutils/save_ms" in names and "ds_profutils/eval_ms" not in names
    assert len(pack_interval([figures(0), figures(1)])) == packed_length(2)  # an empty row's length: one exchange
