"""ds_profutils.timer: DeepSpeed's numbers and API, bounded memory, lazy events, real errors."""
import copy
import inspect
import logging
import pickle
import random
import statistics
import types

import deepspeed.comm as dist
import deepspeed.utils.timer as ds_timer
import pytest
from deepspeed.utils.logging import logger as ds_logger

import ds_profutils._stats as stats
import ds_profutils._timers.host as host_timer
import ds_profutils._timers.throughput as throughput_timer
import ds_profutils.timer as timer
from ds_profutils.exceptions import InvalidArgumentError
from ds_profutils.timer import NoopTimer, SynchronizedWallClockTimer, ThroughputTimer, trim_mean


class ScriptedClock:
    """Hands out the same nanosecond stamps to our timer (``_clock_ns``) and DeepSpeed's (``time.time``)."""

    def __init__(self, durations_ns, gap_ns=1_000):
        stamps, now = [], 1_000_000_000
        for duration in durations_ns:
            stamps += [now, now + duration]
            now += duration + gap_ns
        self.stamps = stamps
        self.ours = iter(stamps)
        self.theirs = iter(stamps)

    def install(self, monkeypatch):
        monkeypatch.setattr(host_timer, "_clock_ns", lambda: next(self.ours))
        monkeypatch.setattr(ds_timer, "time", types.SimpleNamespace(time=lambda: next(self.theirs) / 1e9))


def both_timers(monkeypatch, durations_ns):
    """Our timer group and DeepSpeed's, each fed the same clock."""
    ScriptedClock(durations_ns).install(monkeypatch)
    return SynchronizedWallClockTimer(), ds_timer.SynchronizedWallClockTimer()


def run_pairs(groups, name, count):
    for group in groups:
        for _ in range(count):
            group(name).start()
            group(name).stop()


def test_public_names_and_signatures_match_deepspeed():
    for name in timer.__all__:
        assert hasattr(ds_timer, name), name
    pairs = [
        (SynchronizedWallClockTimer, ds_timer.SynchronizedWallClockTimer,
         ["__init__", "get_timers", "memory_usage", "log", "get_mean"]),
        (SynchronizedWallClockTimer.Timer, ds_timer.SynchronizedWallClockTimer.Timer,
         ["__init__", "start", "stop", "reset", "elapsed", "mean"]),
        (NoopTimer, ds_timer.NoopTimer, ["__init__", "__call__", "get_timers", "log", "get_mean"]),
        (NoopTimer.Timer, ds_timer.NoopTimer.Timer, ["start", "stop", "reset", "elapsed", "mean"]),
        (ThroughputTimer, ds_timer.ThroughputTimer,
         ["__init__", "update_epoch_count", "start", "stop", "avg_samples_per_sec"]),
    ]
    for ours, theirs, methods in pairs:
        for method in methods:
            ours_params = list(inspect.signature(getattr(ours, method)).parameters.values())
            theirs_params = list(inspect.signature(getattr(theirs, method)).parameters.values())
            assert [(p.name, p.kind, p.default) for p in ours_params] == \
                [(p.name, p.kind, p.default) for p in theirs_params], f"{ours.__name__}.{method}"
    for constant in ("FORWARD_GLOBAL_TIMER", "BACKWARD_REDUCE_MICRO_TIMER", "STEP_GLOBAL_TIMER", "TIME_EPSILON"):
        assert getattr(timer, constant) == getattr(ds_timer, constant)


def test_module_names_deepspeed_code_uses_are_deepspeeds_own():
    assert {"CudaEventTimer", "PSUTILS_INSTALLED", "NoopTimer"} <= set(timer.__all__)
    assert timer.CudaEventTimer is ds_timer.CudaEventTimer
    assert timer.PSUTILS_INSTALLED is ds_timer.PSUTILS_INSTALLED
    assert timer.NoopTimer is ds_timer.NoopTimer  # holds nothing: DeepSpeed's own


def test_elapsed_and_mean_equal_deepspeeds_for_the_same_sequence(monkeypatch):
    rng = random.Random(0)
    durations = [rng.randrange(1_000, 5_000_000) for _ in range(200)]
    ours, theirs = both_timers(monkeypatch, durations)
    # Pairs, a read while running (which cuts the interval in two), reads with and without reset.
    script = [("pairs", 7), ("elapsed", False), ("pairs", 20), ("start", ), ("elapsed", False), ("stop", ),
              ("mean", ), ("elapsed", True), ("pairs", 30), ("mean", ), ("reset", ), ("pairs", 3), ("mean", )]
    run_script(ours, theirs, script)


def run_script(ours, theirs, script, attributes=False):
    """Play ``script`` on timer "fwd" of both groups; what each read returns (and, with ``attributes``, what a
    user reads off the timers after each step) is DeepSpeed's."""
    for step in script:
        results = []
        for group in (ours, theirs):
            t = group("fwd")
            if step[0] == "pairs":
                run_pairs([group], "fwd", step[1])
            elif step[0] == "elapsed":
                results.append(t.elapsed(reset=step[1]))
            elif step[0] == "mean":
                results.append(t.mean())
            else:
                getattr(t, step[0])()
        if results:
            assert results[0] == pytest.approx(float(results[1]), rel=1e-9), step
        if attributes:
            assert_reads_as(ours("fwd"), theirs("fwd"), step)


@pytest.mark.parametrize("count", [0, 1, 4, 5, 14, 15, 16, 64, 65, 257, 325, 4095, 4096])
def test_mean_is_exact_while_every_duration_is_kept(monkeypatch, count):
    rng = random.Random(count)
    durations = [rng.choice([rng.randrange(1_000, 2_000), rng.randrange(10**6, 10**8)]) for _ in range(count)]
    ours, theirs = both_timers(monkeypatch, durations)
    run_pairs([ours, theirs], "step", count)
    assert ours("step").mean() == pytest.approx(float(theirs("step").mean()), rel=1e-9)
    assert ours.get_mean(["step", "absent"], normalizer=4.0) == \
        pytest.approx(theirs.get_mean(["step", "absent"], normalizer=4.0), rel=1e-9)


def lognormal(count, seed=1):
    rng = random.Random(seed)
    return [int(10**6 * rng.lognormvariate(0, 1)) for _ in range(count)]


def periodic(count):
    """A timer around gradient-accumulation micro steps: every 4th one also reduces and is 10x slower."""
    rng = random.Random(2)
    return [int(rng.uniform(0.9, 1.1) * (10**7 if i % 4 == 3 else 10**6)) for i in range(count)]


@pytest.mark.parametrize("durations", [lognormal(4_097), lognormal(50_000), periodic(50_000)],
                         ids=["lognormal-4097", "lognormal-50000", "periodic-50000"])
def test_mean_beyond_the_sample_is_a_close_estimate_even_for_skewed_or_periodic_durations(monkeypatch, durations):
    ours, theirs = both_timers(monkeypatch, durations)
    run_pairs([ours, theirs], "step", len(durations))
    # Over 40 sampler seeds the error's spread was 2.3 % (lognormal, 50k) and 0.1 % (periodic): 7 % is
    # three of those, so this holds for any seed, and the old tail guess (off by 90 %) fails it.
    assert ours("step").mean() == pytest.approx(float(theirs("step").mean()), rel=0.07)
    assert ours("step").elapsed() == pytest.approx(theirs("step").elapsed(), rel=1e-9)


def test_memory_is_bounded_however_many_pairs():
    t = SynchronizedWallClockTimer()("loop")
    pairs = 20 * stats.SAMPLE_SIZE + 3
    for _ in range(pairs):
        t.start()
        t.stop()
    assert len(t._durations.sample) == stats.SAMPLE_SIZE
    assert t._durations.count == pairs


def test_the_sample_beyond_its_size_is_uniform():
    """Reservoir sampling keeps each duration with the same chance: the sample's index mean is the stream's."""
    durations = stats.DurationStats("uniform")
    for value in range(100_000):
        durations.add(float(value))
    kept = durations.sample
    assert len(kept) == len(set(kept)) == stats.SAMPLE_SIZE
    assert statistics.mean(kept) == pytest.approx(50_000, rel=0.05)
    # Every tenth of the stream holds about a tenth of the sample.
    tenths = [sum(1 for value in kept if lo <= value < lo + 10_000) for lo in range(0, 100_000, 10_000)]
    assert all(0.75 <= share / (stats.SAMPLE_SIZE / 10) <= 1.25 for share in tenths), tenths
    assert (durations.count, durations.min, durations.max) == (100_000, 0.0, 99_999.0)  # exact


def test_the_sample_is_the_same_for_the_same_name_and_differs_across_names():
    streams = {name: stats.DurationStats(name) for name in ("a", "a2", "b")}
    for stream in streams.values():
        for value in range(20_000):
            stream.add(value)
    a, a2, b = (sorted(stream.sample) for stream in streams.values())
    again = stats.DurationStats("a")
    for value in range(20_000):
        again.add(value)
    assert sorted(again.sample) == a and a != a2 and a != b


def test_stop_without_start_and_start_twice_raise_real_errors():
    group = SynchronizedWallClockTimer()
    with pytest.raises(InvalidArgumentError, match=r"timer 'fwd' is not started; call start\(\) before stop\(\)"):
        group("fwd").stop()
    group("fwd").start()
    with pytest.raises(InvalidArgumentError, match="timer 'fwd' has already been started"):
        group("fwd").start()
    # DeepSpeed raised AssertionError; handlers written for it still catch ours.
    with pytest.raises(AssertionError):
        group("fwd").start()
    group("fwd").stop()
    assert not group("fwd").started_


def test_reset_discards_a_running_interval_as_deepspeed_does(monkeypatch):
    ours, theirs = both_timers(monkeypatch, [5_000_000, 7_000_000])
    for group in (ours, theirs):
        group("x").start()
        group("x").reset()
        group("x").start()
        group("x").stop()
    assert not ours("x").started_
    assert ours("x").elapsed() == pytest.approx(theirs("x").elapsed(), rel=1e-9)


@pytest.fixture
def deepspeed_logger_at_warning(caplog):
    """The DeepSpeed logger at WARNING, as in a run that asked for no INFO logging."""
    caplog.set_level(logging.WARNING, logger=ds_logger.name)


def test_log_prints_what_deepspeed_prints_whatever_the_log_level(monkeypatch, capsys, deepspeed_logger_at_warning):
    ours, theirs = both_timers(monkeypatch, [3_000_000, 1_250_000, 8_000_000, 2_000_000])
    run_pairs([ours, theirs], "fwd", 1)
    run_pairs([ours, theirs], "bwd", 1)
    outputs = []
    for group in (ours, theirs):
        group.log(["fwd", "bwd", "missing"], normalizer=2.0, reset=False)
        group.log(["fwd"], ranks=[1, 2])
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    # Before deepspeed.comm is initialized every process prints, as rank -1.
    assert outputs[0] == "[Rank -1] time (ms) | fwd: 1.50 | bwd: 0.62\n[Rank -1] time (ms) | fwd: 3.00\n"


def test_log_prints_on_the_given_ranks_only(monkeypatch, capsys, deepspeed_logger_at_warning):
    ours, theirs = both_timers(monkeypatch, [3_000_000, 3_000_000])
    run_pairs([ours, theirs], "fwd", 1)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    outputs = []
    for group in (ours, theirs):
        group.log(["fwd"], reset=False)  # default ranks [0]: not this rank
        group.log(["fwd"], reset=False, ranks=[1, 2])
        group.log(["fwd"], reset=False, ranks=[-1])
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] == "[Rank 1] time (ms) | fwd: 3.00\n" * 2


def test_log_ignores_memory_breakdown_as_deepspeed_does(monkeypatch, capsys, deepspeed_logger_at_warning):
    # DeepSpeed's engine passes memory_breakdown with every timer log; its timers ignore it.
    ours, theirs = both_timers(monkeypatch, [1_000_000, 1_000_000])
    run_pairs([ours, theirs], "fwd", 1)
    monkeypatch.setattr(timer, "get_accelerator", lambda: FakeAccelerator(host_timers=True))
    outputs = []
    for group in (ours, theirs):
        group.log(["fwd"], memory_breakdown=True)
        group.log([], memory_breakdown=True)
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] == "[Rank -1] time (ms) | fwd: 1.00\n[Rank -1] time (ms)\n"
    # memory_usage() itself stays, with DeepSpeed's format.
    assert SynchronizedWallClockTimer.memory_usage() == (
        " | mem_allocated: 1.0000 GB | max_mem_allocated: 2.0000 GB | "
        "cache_allocated: 3.0000 GB | max_cache_allocated: 4.0000 GB")


def test_log_and_get_mean_reject_a_bad_normalizer():
    group = SynchronizedWallClockTimer()
    with pytest.raises(InvalidArgumentError, match=r"log: normalizer must be > 0, got 0"):
        group.log(["fwd"], normalizer=0)
    with pytest.raises(InvalidArgumentError, match=r"get_mean: normalizer must be > 0, got -1"):
        group.get_mean(["fwd"], normalizer=-1)


def test_group_deep_copies_and_pickles_as_deepspeeds_does(monkeypatch):
    ours, theirs = both_timers(monkeypatch, [2_000_000, 3_000_000, 4_000_000])
    run_pairs([ours, theirs], "fwd", 2)
    ours("bwd").start()
    theirs("bwd").start()
    theirs_copy = copy.deepcopy(theirs)
    assert theirs_copy("fwd").elapsed(reset=False) == pytest.approx(5.0)
    for ours_copy in (copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))):
        assert type(ours_copy) is SynchronizedWallClockTimer and ours_copy is not ours
        assert list(ours_copy.timers) == ["fwd", "bwd"]
        assert type(ours_copy("fwd")) is type(ours("fwd")) and ours_copy("fwd").name_ == "fwd"
        assert ours_copy("fwd").mean() == pytest.approx(float(theirs_copy("fwd").mean()), rel=1e-9)
        assert ours_copy("bwd").started_ and theirs_copy("bwd").started_
        ours_copy("fwd").reset()  # the copy is independent of the original
        assert ours_copy("fwd").elapsed() == 0 and ours("fwd").elapsed(reset=False) == pytest.approx(5.0)


@pytest.mark.parametrize("cls", [SynchronizedWallClockTimer, ds_timer.SynchronizedWallClockTimer],
                         ids=["ours", "deepspeed"])
def test_group_behaves_as_deepspeeds_object_not_as_a_mapping(cls):
    group, other = cls(), cls()
    group("a")
    assert group  # DeepSpeed's optimizers guard every timer call with `if self.timers:`
    assert group != other and group == group
    assert {group: 1}[group] == 1
    assert not isinstance(group, dict)
    with pytest.raises(TypeError):
        len(group)
    with pytest.raises(TypeError):
        iter(group)
    with pytest.raises(TypeError):
        group["a"]  # noqa: B018


def test_group_creates_each_timer_once():
    group = SynchronizedWallClockTimer()
    assert group("a") is group("a")
    assert type(group.timers) is dict and group.get_timers() is group.timers
    assert group.timers == {"a": group("a")}
    assert isinstance(group("a"), SynchronizedWallClockTimer.Timer)
    group.log(["b"])
    group.get_mean(["b"])
    assert list(group.timers) == ["a"]  # reading a timer that does not exist does not create it
    with pytest.raises(KeyError):
        group.timers["b"]  # a plain dict, as DeepSpeed's: looking a name up creates nothing
    group.timers["c"] = marker = SynchronizedWallClockTimer.Timer("c")
    assert group("c") is marker  # the group reads the dict users see, as DeepSpeed's does


ATTRIBUTES = ("name_", "started_", "start_time", "end_time", "use_host_timer", "start_event")


def assert_reads_as(ours, theirs, step):
    """What a user reads off our timer is what DeepSpeed's shows (the float lists to rounding)."""
    assert {name: getattr(ours, name) for name in ATTRIBUTES} == {name: getattr(theirs, name) for name in ATTRIBUTES}, step
    assert ours.event_timers == pytest.approx(theirs.event_timers, rel=1e-9), step
    if theirs.elapsed_records is None:
        assert ours.elapsed_records is None, step
    else:
        assert ours.elapsed_records == pytest.approx(theirs.elapsed_records, rel=1e-9), step


def test_timer_attributes_read_as_deepspeeds_through_a_run(monkeypatch):
    monkeypatch.setattr(host_timer, "_EPOCH_OFFSET_NS", 0)  # our stamps then read as DeepSpeed's time.time() values
    ours, theirs = both_timers(monkeypatch, [1_000_000 * (i + 1) for i in range(12)])
    script = ["start", "stop", "start", "stop", "read", "start", "read", "abandon", "start", "stop", "mean",
              "start", "reset", "start", "stop", "elapsed"]
    for step in script:
        for group in (ours, theirs):
            t = group("fwd")
            if step == "read":
                t.elapsed(reset=False)
            elif step == "abandon":
                t.started_ = False  # what DeepSpeed's own reset() does, and users do
            else:
                getattr(t, step)()
        assert_reads_as(ours("fwd"), theirs("fwd"), step)
    assert ours("fwd").start_time > 0 and ours("fwd").end_time > ours("fwd").start_time


def test_assigning_started_starts_or_abandons_an_interval(monkeypatch):
    stamps = iter([1_000_000_000, 2_000_000_000, 2_007_000_000])  # abandoned start; start, stop 7 ms later
    monkeypatch.setattr(host_timer, "_clock_ns", lambda: next(stamps))
    monkeypatch.setattr(host_timer, "_EPOCH_OFFSET_NS", 0)
    t = SynchronizedWallClockTimer()("fwd")
    t.started_ = True  # starts now (DeepSpeed's would time from a stale start_time)
    assert t.started_ and t.start_time == 1.0
    t.started_ = True  # already running: nothing changes
    t.started_ = False  # abandons the interval: nothing recorded, start() accepted again
    assert not t.started_ and t.event_timers == [] and t.start_time == 1.0
    t.start()
    t.stop()
    assert t.event_timers == pytest.approx([0.007]) and t.elapsed() == pytest.approx(7.0)


def test_event_timers_stay_bounded_and_exact_while_they_fit():
    t = SynchronizedWallClockTimer()("loop")
    for _ in range(3):
        t.start()
        t.stop()
    assert len(t.event_timers) == 3 and all(0 <= d < 1 for d in t.event_timers)
    for _ in range(5 * stats.SAMPLE_SIZE):
        t.start()
        t.stop()
    assert len(t.event_timers) == stats.SAMPLE_SIZE  # DeepSpeed's list would hold all 20483
    assert t.elapsed_records is None
    t.mean()
    assert len(t.elapsed_records) == stats.SAMPLE_SIZE
    t.reset()
    assert t.event_timers == [] and t.elapsed_records is None


def test_noop_timer_accepts_every_call_and_measures_nothing():
    noop = NoopTimer()
    handle = noop("anything")
    handle.start()
    handle.stop(reset=True, record=True)
    handle.reset()
    assert handle.elapsed(reset=False) == 0 and handle.mean() == 0
    assert noop.get_timers() == {}
    assert noop.get_mean(["fwd"]) is None and ds_timer.NoopTimer().get_mean(["fwd"]) is None
    assert noop.log(["fwd"], memory_breakdown=True) is None


def test_trim_mean_matches_deepspeeds_and_keeps_input_order():
    rng = random.Random(2)
    for n in (0, 1, 2, 9, 10, 11, 15, 100):
        data = [rng.uniform(0, 10) for _ in range(n)]
        snapshot = list(data)
        assert trim_mean(data, 0.1) == pytest.approx(float(ds_timer.trim_mean(data, 0.1)), rel=1e-12)
        assert data == snapshot
    with pytest.raises(InvalidArgumentError, match=r"trim_percent must be within \[0, 1\], got 1.5"):
        trim_mean([1.0], 1.5)


# --- accelerator events -------------------------------------------------------------------------


ENGINE_MICRO = [ds_timer.FORWARD_MICRO_TIMER, ds_timer.BACKWARD_MICRO_TIMER, ds_timer.BACKWARD_INNER_MICRO_TIMER,
                ds_timer.BACKWARD_REDUCE_MICRO_TIMER, ds_timer.STEP_MICRO_TIMER]
ENGINE_GLOBAL = [ds_timer.FORWARD_GLOBAL_TIMER, ds_timer.BACKWARD_GLOBAL_TIMER, ds_timer.BACKWARD_INNER_GLOBAL_TIMER,
                 ds_timer.BACKWARD_REDUCE_GLOBAL_TIMER, ds_timer.STEP_GLOBAL_TIMER]


def engine_timer_step(group):
    """DeepSpeed 0.19's engine with wall_clock_breakdown, one step: its ten timers started and stopped
    (backward's pair open around inner and allreduce), all read without reset, then both logs (with reset).
    Returns the values read."""
    pairs = [[micro, whole] for micro, whole in zip(ENGINE_MICRO, ENGINE_GLOBAL)]
    forward, backward, inner, reduce, step = pairs
    for names, action in ((forward, "start"), (forward, "stop"), (backward, "start"), (inner, "start"),
                          (inner, "stop"), (reduce, "start"), (reduce, "stop"), (backward, "stop"),
                          (step, "start"), (step, "stop")):
        for name in names:
            getattr(group(name), action)()
    read = [group(name).elapsed(reset=False) for name in ENGINE_MICRO + ENGINE_GLOBAL]
    group.log(names=ENGINE_MICRO, memory_breakdown=False)
    group.log(ENGINE_GLOBAL)
    return read


def test_the_engines_timer_use_step_after_step_reads_and_logs_as_deepspeeds(monkeypatch, capsys,
                                                                          deepspeed_logger_at_warning):
    # Each timer read twice a step, reset by the log every step: the read of a few pending durations.
    monkeypatch.setattr(host_timer, "_EPOCH_OFFSET_NS", 0)
    rng = random.Random(1)
    steps = 6
    # Stamps 10 us apart at least, so every figure is whole hundredths of a ms: no rounding of a half in log().
    ScriptedClock([10_000 * rng.randrange(1, 900) for _ in range(10 * steps)], gap_ns=10_000).install(monkeypatch)
    ours, theirs = SynchronizedWallClockTimer(), ds_timer.SynchronizedWallClockTimer()
    for step in range(steps):
        read, lines = [], []
        for group in (ours, theirs):
            read.append(engine_timer_step(group))
            lines.append(capsys.readouterr().out)
        assert read[0] == pytest.approx(read[1], rel=1e-9), step
        assert lines[0] == lines[1] and lines[0].count("\n") == 2, step
        for name in ENGINE_MICRO + ENGINE_GLOBAL:
            assert_reads_as(ours(name), theirs(name), (step, name))
            assert ours(name).elapsed(reset=False) == 0.0 and ours(name).mean() == theirs(name).mean() == 0


def test_reads_after_the_durations_were_folded_equal_deepspeeds(monkeypatch):
    # More durations than are held pending (FOLD_EVERY): reads sum the statistics, then start afresh.
    monkeypatch.setattr(host_timer, "_EPOCH_OFFSET_NS", 0)
    rng = random.Random(2)
    ours, theirs = both_timers(monkeypatch, [rng.randrange(1_000, 900_000) for _ in range(stats.FOLD_EVERY + 520)])
    script = [("pairs", stats.FOLD_EVERY + 500), ("elapsed", False), ("pairs", 7), ("elapsed", False), ("mean", ),
              ("elapsed", True), ("pairs", 5), ("elapsed", False), ("start", ), ("elapsed", True), ("stop", ),
              ("mean", ), ("elapsed", True)]
    run_script(ours, theirs, script, attributes=True)


class FakeEvent:
    """Records what the timer asks of an event; times and completion are scripted by the accelerator."""

    def __init__(self, accelerator, enable_timing=False):
        assert enable_timing
        self.accelerator = accelerator
        self.time_ms = None
        self.synchronized = False

    def record(self):
        self.accelerator.calls.append("record")
        self.time_ms = self.accelerator.device_time_ms
        self.accelerator.device_time_ms += 2.0
        self.index = len(self.accelerator.recorded)
        self.stream = self.accelerator.stream
        self.accelerator.recorded.append(self)

    def done(self):
        # Events on the main stream complete in order; one on a side stream only when waited for.
        return self.synchronized if self.stream == "side" else self.index < self.accelerator.finished

    def query(self):
        self.accelerator.calls.append("query")
        return self.done()

    def synchronize(self):
        self.accelerator.calls.append("synchronize")
        self.synchronized = True
        if self.stream == "main":
            self.accelerator.finished = max(self.accelerator.finished, self.index + 1)

    def elapsed_time(self, end):
        self.accelerator.calls.append("elapsed_time")
        if not (self.done() and end.done()):
            raise RuntimeError("CUDA error: device not ready")  # what torch raises
        return end.time_ms - self.time_ms


class FakeAccelerator:
    """A device accelerator (no host timers) whose events complete only when the test says so."""

    def __init__(self, host_timers=False):
        self.host_timers = host_timers
        self.calls, self.recorded = [], []
        self.device_time_ms = 0.0
        self.finished = 0  # main-stream events with index below this have completed on the device
        self.stream = "main"  # the stream events are recorded on
        self.made = 0  # events made

    def use_host_timers(self):
        return self.host_timers

    @property
    def Event(self):
        def make(enable_timing=False):
            self.made += 1
            return FakeEvent(self, enable_timing)

        return make

    def memory_allocated(self):
        return 1 * 1024**3

    def max_memory_allocated(self):
        return 2 * 1024**3

    def memory_cached(self):
        return 3 * 1024**3

    def max_memory_cached(self):
        return 4 * 1024**3

    def synchronize(self):
        self.calls.append("device_synchronize")


@pytest.fixture
def device(monkeypatch):
    accelerator = FakeAccelerator()
    for module in (timer, throughput_timer):  # the group makes the timers; the throughput timer synchronizes
        monkeypatch.setattr(module, "get_accelerator", lambda: accelerator)
    return accelerator


def test_events_are_recorded_at_start_stop_and_resolved_only_when_read(device):
    t = SynchronizedWallClockTimer()("fwd")
    for _ in range(3):
        t.start()
        t.stop()
    assert device.calls == ["record"] * 6  # no query, no synchronize, no elapsed_time on the hot path
    assert t.elapsed(reset=False) == pytest.approx(3 * 2.0)
    # One wait, on the newest end event: the older ones, on the same stream, completed before it.
    assert device.calls[6:] == ["synchronize"] + ["elapsed_time"] * 3
    assert t.mean() == pytest.approx(2.0)
    with pytest.raises(InvalidArgumentError, match="is not started"):
        t.stop()


def test_a_read_pairs_events_are_recorded_again_instead_of_new_ones(device):
    """As the engine uses its timers: start/stop, then a read with reset, step after step."""
    t = SynchronizedWallClockTimer()("fwd")
    for _ in range(5):
        for _ in range(3):
            t.start()
            t.stop()
        device.finished = len(device.recorded)
        assert t.elapsed(reset=True) == pytest.approx(3 * 2.0)
    assert device.made == 6 and len(device.recorded) == 30


def test_events_recorded_on_another_stream_are_waited_for_when_read(device):
    t = SynchronizedWallClockTimer()("fwd")
    for stream in ("main", "side", "main"):
        device.stream = stream
        t.start()
        t.stop()
    assert t.elapsed() == pytest.approx(3 * 2.0)
    assert device.calls.count("synchronize") == 3  # the newest end, then the side pair's two events


def test_events_fold_finished_pairs_without_waiting_for_newer_work(device):
    t = SynchronizedWallClockTimer()("fwd")
    device.finished = 2 * 10  # the device has finished the first 10 intervals only
    for _ in range(stats.FOLD_EVERY):
        t.start()
        t.stop()
    assert len(t._pairs) == stats.FOLD_EVERY - 10
    assert "synchronize" not in device.calls
    assert t._durations.count == 10


def test_events_wait_for_the_oldest_pair_only_when_the_device_lags_the_whole_buffer(device):
    t = SynchronizedWallClockTimer()("fwd")
    for _ in range(stats.FOLD_EVERY):
        t.start()
        t.stop()
    assert device.calls.count("synchronize") == 1
    assert len(t._pairs) == stats.FOLD_EVERY - 1
    assert t.elapsed() == pytest.approx(stats.FOLD_EVERY * 2.0)
    assert t._pairs == [] and t._durations.count == 0


def test_device_timer_attributes_read_as_deepspeeds(device):
    t = SynchronizedWallClockTimer()("fwd")
    assert t.use_host_timer is False and t.start_event is None
    with pytest.raises(AttributeError):
        t.use_host_timer = True  # a timer keeps the clock it was made with
    t.start()
    assert t.start_event is device.recorded[-1] and t.started_
    t.stop()
    assert t.start_event is None and (t.start_time, t.end_time) == (0.0, 0.0)  # no host times, as DeepSpeed's
    assert device.calls == ["record"] * 2  # reading attributes waits for nothing
    assert t.event_timers == pytest.approx([0.002])  # resolved when read; DeepSpeed's holds the event pair
    t.elapsed(reset=False)
    assert t.elapsed_records == pytest.approx([2.0])


def test_device_timers_read_with_reset_step_after_step_and_while_running(device):
    group = SynchronizedWallClockTimer()
    for _ in range(3):
        # Each event recorded 2 ms after the one before: a pair spans the events recorded inside it.
        assert engine_timer_step(group) == pytest.approx([4.0, 20.0, 4.0, 4.0, 4.0] * 2)
        assert all(group(name)._pairs == [] for name in ENGINE_MICRO + ENGINE_GLOBAL)
    t = group("fwd")
    t.start()
    assert t.elapsed(reset=True) == pytest.approx(2.0)  # the running interval cut, counted, then reset
    assert t.started_ and t.start_event is device.recorded[-1]  # timing goes on from a new start event
    t.stop()
    assert t.elapsed(reset=False) == pytest.approx(2.0) and t.elapsed_records == pytest.approx([2.0])


def test_a_timer_keeps_the_clock_it_was_made_with(device):
    """As DeepSpeed's: the accelerator's use_host_timers() is read when the timer is made."""
    device.host_timers = True
    t = SynchronizedWallClockTimer()("host")
    t.start()
    t.stop()
    assert device.calls == [] and t._durations.count == 1


# --- ThroughputTimer ----------------------------------------------------------------------------


def throughput_pair(monkeypatch, steps, **kwargs):
    """Our ThroughputTimer and DeepSpeed's, fed the same clock (half seconds: exact in binary, in both)."""
    ScriptedClock([500_000_000] * steps, gap_ns=500_000_000).install(monkeypatch)
    config = types.SimpleNamespace(enabled=True, synchronized=False)
    ours_log, theirs_log = [], []
    ours = ThroughputTimer(config, batch_size=8, logging_fn=ours_log.append, **kwargs)
    theirs = ds_timer.ThroughputTimer(config, batch_size=8, logging_fn=theirs_log.append, **kwargs)
    return (ours, ours_log), (theirs, theirs_log)


def test_throughput_timer_logs_what_deepspeed_logs(monkeypatch):
    (ours, ours_log), (theirs, theirs_log) = throughput_pair(monkeypatch, 6, steps_per_output=2)
    for step in range(8):
        for tput in (ours, theirs):
            if step == 4:
                tput.update_epoch_count()
            tput.start()
            tput.stop(global_step=True)
    assert ours_log == theirs_log and len(ours_log) == 3
    assert "RunningAvgSamplesPerSec=16.0" in ours_log[-1]
    assert ours.avg_samples_per_sec() == theirs.avg_samples_per_sec() == 16.0
    assert (ours.epoch_count, ours.micro_step_count, ours.global_step_count) == (1, 4, 8)


def test_throughput_timer_before_any_timed_step_and_when_disabled(monkeypatch):
    (ours, _), _ = throughput_pair(monkeypatch, 0, start_step=2)
    assert ours.avg_samples_per_sec() == float("-inf")
    ours.start()
    ours.stop(global_step=True)
    assert ours.avg_samples_per_sec() == float("-inf")  # DeepSpeed divides by zero here
    ours.config.enabled = False
    ours.start()
    ours.stop(global_step=True)
    assert ours.global_step_count == 1


def test_throughput_timer_times_and_flags_read_as_deepspeeds(monkeypatch):
    monkeypatch.setattr(host_timer, "_EPOCH_OFFSET_NS", 0)
    (ours, _), (theirs, _) = throughput_pair(monkeypatch, 3, steps_per_output=2, start_step=1)
    fields = ("start_time", "end_time", "initialized", "started", "total_elapsed_time")
    assert [getattr(ours, f) for f in fields] == [getattr(theirs, f) for f in fields] == [0, 0, False, False, 0]
    for _ in range(4):
        for tput in (ours, theirs):
            tput.start()
        assert [getattr(ours, f) for f in fields] == pytest.approx([getattr(theirs, f) for f in fields])
        for tput in (ours, theirs):
            tput.stop(global_step=True)
        assert [getattr(ours, f) for f in fields] == pytest.approx([getattr(theirs, f) for f in fields])
    assert ours.initialized and ours.start_time > 0 and ours.end_time - ours.start_time == pytest.approx(0.5)


@pytest.mark.parametrize("steps, message", [(0, "must be greater than 0"), (-1, "must be greater than 0"),
                                            (1.5, "must be a positive integer or None"),
                                            (True, "must be a positive integer or None")])
def test_throughput_timer_refuses_steps_per_output_it_cannot_report_on(steps, message):
    # DeepSpeed 0.19.8 accepts 0 and divides by it at the first global step.
    config = types.SimpleNamespace(enabled=True, synchronized=False)
    with pytest.raises(InvalidArgumentError, match=f"steps_per_output {message}"):
        ThroughputTimer(config, batch_size=1, steps_per_output=steps)
    tput = ThroughputTimer(config, batch_size=1, steps_per_output=2)
    tput.steps_per_output = steps
    with pytest.raises(ValueError, match="positive"):
        tput._is_report_boundary()


def test_throughput_timer_synchronizes_the_device_when_asked(monkeypatch, device):
    ScriptedClock([250_000_000]).install(monkeypatch)
    tput = ThroughputTimer(types.SimpleNamespace(enabled=True, synchronized=True), batch_size=None, start_step=0)
    tput.start()
    tput.stop(global_step=True)
    assert device.calls == ["device_synchronize"] * 2
    assert tput.total_elapsed_time == 0.25 and tput.avg_samples_per_sec() == 4.0
