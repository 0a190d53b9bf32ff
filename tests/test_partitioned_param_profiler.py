"""PartitionedParameterProfiler: DeepSpeed's counts for the same events, timing stats, constant memory,
and nothing raised into DeepSpeed."""
import copy
import dataclasses
import random
import tracemalloc

import pytest
import torch
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coordinator
from deepspeed.runtime.zero.partitioned_param_profiler import PartitionedParameterProfiler as DeepSpeedProfiler
from deepspeed.utils.timer import NoopTimer, SynchronizedWallClockTimer

import ds_profutils
import ds_profutils.zero3.fetch_profiler as module
from ds_profutils import nvtx
from ds_profutils._stats import FOLD_EVERY, SAMPLE_SIZE
from ds_profutils.zero3 import NUMEL_UNITS, PartitionedParameterProfiler


def coordinator_sequence(seed: int, fetches: int):
    """Events in the order DeepSpeed's coordinator emits them: submit{all_gather}, wait, prefetch{all_gather}."""
    rng = random.Random(seed)
    events = []
    for _ in range(fetches):
        direction = rng.choice(("FORWARD", "BACKWARD"))
        gather = getattr(Coordinator, f"{direction}_ALL_GATHER")
        shard = rng.randint(0, 5000)
        if shard:
            submit = getattr(Coordinator, f"{direction}_FETCH_SUBMIT")
            events += [("start", submit), ("start", gather), ("stop", gather, shard * 2), ("stop", submit, shard)]
        wait = getattr(Coordinator, f"{direction}_FETCH_WAIT")
        events += [("start", wait), ("stop", wait, rng.choice((0, shard)))]
        if rng.random() < 0.5:
            prefetch = getattr(Coordinator, f"{direction}_PREFETCH_SUBMIT")
            full = rng.randint(1, 9000)
            events += [("start", prefetch), ("start", gather), ("stop", gather, full), ("stop", prefetch, full)]
    return events


def replay(profiler, events):
    for event in events:
        if event[0] == "start":
            profiler.start_event(event[1])
        else:
            profiler.stop_event(event[1], event[2])


def counts(profiler):
    return {name: (c.count, c.num_elem) for name, c in profiler.event_counters.items()}


def test_same_counts_and_numel_as_deepspeed_for_the_same_events():
    ours, theirs = PartitionedParameterProfiler(SynchronizedWallClockTimer()), DeepSpeedProfiler(
        SynchronizedWallClockTimer())
    for seed in range(3):
        events = coordinator_sequence(seed, 300)
        replay(ours, events)
        replay(theirs, events)
        assert counts(ours) == counts(theirs)
        assert len(counts(ours)) == 8
        ours.reset_events()
        theirs.reset_events()
        assert counts(ours) == counts(theirs)


def test_numel_units_name_every_event_of_the_coordinator():
    names = {value for key, value in vars(Coordinator).items() if key.isupper() and isinstance(value, str)}
    assert set(NUMEL_UNITS) == names
    assert {name for name, unit in NUMEL_UNITS.items() if unit == "shard"} == {
        Coordinator.FORWARD_FETCH_SUBMIT, Coordinator.FORWARD_FETCH_WAIT, Coordinator.BACKWARD_FETCH_SUBMIT,
        Coordinator.BACKWARD_FETCH_WAIT
    }


def test_event_counter_keeps_deepspeeds_dataclass_interface():
    counter_class = PartitionedParameterProfiler.EventCounter
    assert dataclasses.is_dataclass(counter_class)
    counter = counter_class(name="forward_fetch_wait", count=0, num_elem=0)
    counter.increment(10)
    counter.increment(5)
    assert (counter.name, counter.count, counter.num_elem) == ("forward_fetch_wait", 2, 15)
    counter.reset()
    assert (counter.count, counter.num_elem) == (0, 0)
    assert ds_profutils.PartitionedParameterProfiler is PartitionedParameterProfiler


def test_counts_from_increment_alone_have_no_times(monkeypatch):
    logged = []
    monkeypatch.setattr(module, "log_dist", lambda message, ranks: logged.append(message))
    profiler = PartitionedParameterProfiler(NoopTimer())
    profiler.event_counters["custom"] = profiler.EventCounter(name="custom", count=0, num_elem=0)
    profiler.event_counters["custom"].increment(3)
    stats = profiler.statistics()["custom"]
    assert (stats["count"], stats["numel"], stats["min_ms"], stats["p95_ms"]) == (1, 3, None, None)
    profiler.log_events()
    assert logged == ["custom: count = 1, numel = 3 (as counted)"]


def test_copies_are_profilers_in_the_same_state():
    for timers in (None, NoopTimer()):
        profiler = PartitionedParameterProfiler(timers)
        copied = copy.deepcopy(profiler)
        assert type(copied) is PartitionedParameterProfiler and copied.enabled is profiler.enabled


def scripted_clock(monkeypatch, durations_ns):
    stamps, now = [], 10**12
    for duration in durations_ns:
        stamps += [now, now + duration]
        now += duration + 1000
    ticks = iter(stamps)
    monkeypatch.setattr(module, "perf_counter_ns", lambda: next(ticks))


def test_times_bytes_and_percentiles(monkeypatch):
    durations = [us * 1000 for us in range(1, 101)]  # 1 .. 100 us
    random.Random(0).shuffle(durations)
    scripted_clock(monkeypatch, durations)
    profiler = PartitionedParameterProfiler(NoopTimer(), element_size=2)
    for _ in durations:
        profiler.start_event("forward_all_gather")
        profiler.stop_event("forward_all_gather", 100)
    stats = profiler.statistics()["forward_all_gather"]
    assert stats["count"] == 100
    assert stats["numel"] == 10_000 and stats["numel_unit"] == "full"
    assert stats["bytes"] == 20_000
    assert stats["time_ms"] == pytest.approx(sum(durations) / 1e6)
    assert (stats["min_ms"], stats["max_ms"]) == (0.001, 0.1)
    assert (stats["p50_ms"], stats["p95_ms"]) == (0.050, 0.095)  # every duration sampled: exact


def test_latency_samples_stay_bounded_and_percentiles_hold_beyond_the_sample(monkeypatch):
    durations = [us * 1000 for us in range(1, 20_001)]  # 1 .. 20000 us, in time order
    scripted_clock(monkeypatch, durations)
    profiler = PartitionedParameterProfiler(NoopTimer())
    for _ in durations:
        with profiler.event("backward_fetch_wait", 1):
            pass
    samples = profiler.event_counters["backward_fetch_wait"].durations.sample
    assert len(samples) == SAMPLE_SIZE
    stats = profiler.statistics()["backward_fetch_wait"]
    assert (stats["min_ms"], stats["max_ms"], stats["count"]) == (0.001, 20.0, 20_000)  # exact
    assert stats["p50_ms"] == pytest.approx(10.0, rel=0.03)
    assert stats["p95_ms"] == pytest.approx(19.0, rel=0.03)
    profiler.reset_events()
    assert profiler.event_counters["backward_fetch_wait"].durations.sample == [] and profiler.statistics() == {}


def test_percentiles_of_a_periodic_pattern_are_not_aliased(monkeypatch):
    """8 layers repeating: 7 fast fetches and one slow one.  A sample of every 2nd, 4th, 8th ... fetch
    would see only one phase of the period; the random sample sees the true mix."""
    period = [100_000] * 7 + [5_000_000]  # 0.1 ms x 7, then 5 ms
    durations = period * 4000  # 32000 fetches, far beyond the sample
    scripted_clock(monkeypatch, durations)
    profiler = PartitionedParameterProfiler(NoopTimer())
    for _ in durations:
        with profiler.event("forward_fetch_wait", 1):
            pass
    stats = profiler.statistics()["forward_fetch_wait"]
    assert stats["p50_ms"] == 0.1 and stats["p95_ms"] == 5.0  # the exact percentiles of the stream
    slow_share = sum(d == 5_000_000 for d in profiler.event_counters["forward_fetch_wait"].durations.sample) / SAMPLE_SIZE
    assert slow_share == pytest.approx(1 / 8, abs=0.02)


def test_bytes_unknown_without_element_size_and_reset_clears_statistics():
    profiler = PartitionedParameterProfiler(NoopTimer())
    profiler.start_event("custom")
    profiler.stop_event("custom", 3)
    assert profiler.statistics()["custom"]["bytes"] is None
    assert profiler.statistics()["custom"]["numel_unit"] is None
    profiler.reset_events()
    assert profiler.statistics() == {}


def test_memory_is_bounded_however_many_events():
    events = coordinator_sequence(1, 50)
    # Eight event names, each with at most SAMPLE_SIZE latencies (ints of ~36 bytes with the slot, held by
    # the sample and by the copy of the first SAMPLE_SIZE kept until their figures are read) and a batch.
    bound = len(NUMEL_UNITS) * (SAMPLE_SIZE * 2 + FOLD_EVERY) * 44
    tracemalloc.start()
    try:
        profiler = PartitionedParameterProfiler(NoopTimer(), element_size=4)
        traced = []
        for _ in range(2):
            for _ in range(100_000 // (len(events) // 2) + 1):  # start+stop pairs
                replay(profiler, events)
            traced.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    assert sum(c.count for c in profiler.event_counters.values()) > 200_000
    assert all(len(c.durations.sample) <= SAMPLE_SIZE for c in profiler.event_counters.values())
    assert max(traced) < bound


def test_disabled_profiler_does_nothing():
    profiler = PartitionedParameterProfiler(None)
    assert not profiler.enabled
    profiler.stop_event("never_started", 1)  # nothing is checked when disabled
    profiler.trace_ranges = True
    profiler.start_event("forward_fetch_wait")
    profiler.stop_event("forward_fetch_wait", 5)
    assert profiler.event_counters == {} and profiler.statistics() == {}


def test_unpaired_calls_of_a_known_event_are_counted_as_dropped_not_raised():
    """DeepSpeed's backward runs leaf-module hooks from several threads: an unmatched stop or a start of a
    running event must not raise into it.  The stop still counts the event and its numel, as DeepSpeed would."""
    profiler = PartitionedParameterProfiler(NoopTimer())
    profiler.start_event("forward_fetch_wait")
    profiler.start_event("forward_fetch_wait")  # already running: the first start is kept
    profiler.stop_event("forward_fetch_wait", 2)
    profiler.stop_event("forward_fetch_wait", 1)  # no start
    stats = profiler.statistics()["forward_fetch_wait"]
    assert (stats["count"], stats["numel"], stats["dropped"]) == (2, 3, 2)
    assert profiler.event_counters["forward_fetch_wait"].durations.count == 1  # the one paired call is timed
    profiler.reset_events()
    profiler.start_event("forward_fetch_wait")
    profiler.stop_event("forward_fetch_wait", 1)
    assert profiler.statistics()["forward_fetch_wait"]["dropped"] == 0


def test_stop_of_an_event_never_started_raises_as_deepspeeds():
    """DeepSpeed's ``stop_event`` asserts ``unknown event <name>`` when given timers; so does ours, as an
    error that is both an AssertionError (code written against DeepSpeed) and a ValueError."""
    from deepspeed.runtime.zero.partitioned_param_profiler import \
        PartitionedParameterProfiler as DeepSpeedProfiler

    for cls in (DeepSpeedProfiler, PartitionedParameterProfiler):
        with pytest.raises(AssertionError, match="unknown event forward_fetch_wait"):
            cls(NoopTimer()).stop_event("forward_fetch_wait", 1)
    with pytest.raises(ValueError):
        PartitionedParameterProfiler(NoopTimer()).stop_event("forward_fetch_wait", 1)


def test_under_attach_a_stop_of_an_event_started_before_recording_is_dropped():
    """attach switches ``recording`` per step (``strict`` off): an event may begin before the switch, and its
    stop must not raise into DeepSpeed's forward."""
    profiler = PartitionedParameterProfiler(NoopTimer())
    profiler.strict = False
    profiler.stop_event("forward_fetch_wait", 4)
    stats = profiler.statistics()["forward_fetch_wait"]
    assert (stats["count"], stats["numel"], stats["dropped"]) == (1, 4, 1)


def test_context_manager_form_stops_on_error():
    profiler = PartitionedParameterProfiler(NoopTimer())
    with pytest.raises(RuntimeError):
        with profiler.event("forward_fetch_wait", 7):
            raise RuntimeError("fetch failed")
    assert counts(profiler) == {"forward_fetch_wait": (1, 7)}


def test_log_events_reports_counts_and_times_on_rank_zero(monkeypatch):
    logged = []
    monkeypatch.setattr(module, "log_dist", lambda message, ranks: logged.append((message, ranks)))
    profiler = PartitionedParameterProfiler(NoopTimer())
    with profiler.event("forward_fetch_wait", 12):
        pass
    profiler.log_events()
    assert len(logged) == 1
    message, ranks = logged[0]
    assert ranks == [0]
    assert message.startswith("forward_fetch_wait: count = 1, numel = 12 (shard), host time = ")


def test_trace_ranges_while_torch_profiler_records():
    profiler = PartitionedParameterProfiler(NoopTimer())
    profiler.trace_ranges = True
    nvtx.set_torch_profiler_recording(True)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            profiler.start_event("forward_fetch_wait")
            torch.ones(4).sum()
            profiler.stop_event("forward_fetch_wait", 42)
        profiler.trace_ranges = False
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as off:
            profiler.start_event("forward_fetch_wait")
            profiler.stop_event("forward_fetch_wait", 7)
    finally:
        nvtx.set_torch_profiler_recording(False)
    names = {event.name for event in prof.events()}
    assert "zero3.forward_fetch_wait" in names
    assert "zero3.forward_fetch_wait numel=42 (shard)" in names
    assert not any(event.name.startswith("zero3.") for event in off.events())
    assert counts(profiler) == {"forward_fetch_wait": (2, 49)}


def test_calls_from_another_thread_interleaved_are_counted_not_raised():
    """DeepSpeed fires leaf-module backward hooks from several autograd threads: one thread's start may land
    while another's event of the same name runs."""
    import threading

    profiler = PartitionedParameterProfiler(NoopTimer())
    a_started, b_started, a_stopped = threading.Event(), threading.Event(), threading.Event()
    errors = []

    def guarded(steps):
        try:
            steps()
        except BaseException as exc:  # anything raised here would have been raised into DeepSpeed
            errors.append(exc)

    def thread_a():  # starts first and stops while B's start is pending
        profiler.start_event("backward_fetch_wait")
        a_started.set()
        b_started.wait(5)
        profiler.stop_event("backward_fetch_wait", 1)
        a_stopped.set()

    def thread_b():  # starts while A's event runs (dropped), stops with nothing running (dropped)
        a_started.wait(5)
        profiler.start_event("backward_fetch_wait")
        b_started.set()
        a_stopped.wait(5)
        profiler.stop_event("backward_fetch_wait", 1)

    threads = [threading.Thread(target=guarded, args=(steps, )) for steps in (thread_a, thread_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert errors == []
    stats = profiler.statistics()["backward_fetch_wait"]
    assert (stats["count"], stats["numel"], stats["dropped"]) == (2, 2, 2)
    assert profiler.event_counters["backward_fetch_wait"].durations.count == 1


@pytest.mark.parametrize("timers_class", [SynchronizedWallClockTimer, ds_profutils.timer.SynchronizedWallClockTimer],
                         ids=["deepspeeds-timers", "our-timers"])
def test_drives_the_timers_it_is_given_as_deepspeeds_does(timers_class, capsys):
    """DeepSpeed's profiler starts and stops ``timers(name)`` around each event and logs the group's line in
    log_events(): the engine's wall-clock log shows the fetch timers.  Ours does the same with the same
    group, and keeps its own figures besides."""
    ours_timers, theirs_timers = timers_class(), timers_class()
    ours, theirs = PartitionedParameterProfiler(ours_timers), DeepSpeedProfiler(theirs_timers)
    events = coordinator_sequence(7, 50)
    replay(ours, events)
    replay(theirs, events)
    names = sorted(theirs.event_counters)
    assert sorted(ours_timers.get_timers()) == sorted(theirs_timers.get_timers()) == names
    assert set(ours_timers.get_mean(names)) == set(names)  # every timer holds its durations
    assert all(not timer.started_ for timer in ours_timers.get_timers().values())
    if timers_class is SynchronizedWallClockTimer:  # given our durations: one per stop(), the same total
        totals = {name: entry["time_ms"] for name, entry in ours.host_statistics().items()}
        for name in names:
            assert len(ours_timers(name).event_timers) == len(theirs_timers(name).event_timers)
            assert sum(ours_timers(name).event_timers) * 1e3 == pytest.approx(totals[name])
    capsys.readouterr()
    ours.log_events()
    printed = capsys.readouterr().out
    assert "time (ms) | " in printed and all(f"{name}: " in printed for name in names)
    assert ours.statistics().keys() == set(names)  # its own figures, after the timers were logged and reset


def test_a_noop_timer_group_is_not_driven_and_nothing_else_is_needed():
    profiler = PartitionedParameterProfiler(NoopTimer())
    with profiler.event("forward_fetch_wait", 3):
        pass
    counter = profiler.event_counters["forward_fetch_wait"]
    assert counter.timer_start is counter.timer_stop is counter.feeds is None
    assert counts(profiler) == {"forward_fetch_wait": (1, 3)}


def test_what_was_gathered_on_demand_against_by_prefetch_and_the_most_gathered_at_once():
    """All-gathers inside a fetch submit are on demand (the module waits for them); inside a prefetch submit
    they were gathered ahead of need.  The most elements gathered at once is the coordinator's own count,
    read as each all-gather starts (it only grows there)."""
    available = [0]
    profiler = PartitionedParameterProfiler(NoopTimer())
    profiler.available_params = lambda: available[0]
    for name, numel, live in (("forward_fetch_submit", 40, 100), ("forward_prefetch_submit", 60, 250),
                              ("backward_prefetch_submit", 30, 180)):
        profiler.start_event(name)
        available[0] = live  # DeepSpeed counts the elements before it brackets the all-gather
        with profiler.event(name.split("_")[0] + "_all_gather", numel):
            pass
        profiler.stop_event(name, numel)
        available[0] -= numel  # released later
    with profiler.event("backward_all_gather", 5):  # outside a submit: neither
        pass
    assert profiler.gathered == {"on_demand": 40, "prefetch": 90}
    assert profiler.live_params_max == 250
    profiler.reset_events()  # DeepSpeed's reset at the next forward
    assert (profiler.gathered, profiler.live_params_max) == ({"on_demand": 0, "prefetch": 0}, 0)


def test_built_directly_on_a_device_clock_accelerator_it_times_fetch_waits_on_the_device():
    """DeepSpeed's profiler times through its timers' device events where the accelerator has them; ours,
    built directly, reads the fetch waits' device times too (waiting for the device when asked, as
    DeepSpeed's timers do when logged)."""
    import deepspeed.accelerator.real_accelerator as installed
    from deepspeed.accelerator import set_accelerator

    from stream_clock import StreamClockAccelerator

    previous = installed.ds_accelerator
    stand_in = StreamClockAccelerator()
    set_accelerator(stand_in)
    try:
        profiler = PartitionedParameterProfiler(NoopTimer())
        for stall in (2.0, 6.0):
            profiler.start_event("forward_fetch_wait")
            stand_in.advance(stall)
            profiler.stop_event("forward_fetch_wait", 1)
    finally:
        installed.ds_accelerator = previous
    entry = profiler.statistics()["forward_fetch_wait"]
    assert (entry["clock"], entry["time_ms"], entry["min_ms"], entry["max_ms"]) == ("device", 8.0, 2.0, 6.0)
    assert entry["host_time_ms"] < 1.0
    assert profiler.host_statistics()["forward_fetch_wait"]["clock"] == "host"
