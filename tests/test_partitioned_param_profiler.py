"""PartitionedParameterProfiler: DeepSpeed's counts for the same events, timing stats, constant memory."""
import copy
import dataclasses
import random
import tracemalloc

import pytest
import torch
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coordinator
from deepspeed.runtime.zero.partitioned_param_profiler import PartitionedParameterProfiler as DeepSpeedProfiler
from deepspeed.utils.timer import SynchronizedWallClockTimer

import ds_profutils
import ds_profutils.partitioned_param_profiler as module
from ds_profutils import nvtx
from ds_profutils.exceptions import InvalidArgumentError
from ds_profutils.partitioned_param_profiler import NUMEL_UNITS, SAMPLES_PER_EVENT, PartitionedParameterProfiler


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
    profiler = PartitionedParameterProfiler(object())
    profiler.event_counters["custom"] = profiler.EventCounter(name="custom", count=0, num_elem=0)
    profiler.event_counters["custom"].increment(3)
    stats = profiler.statistics()["custom"]
    assert (stats["count"], stats["numel"], stats["min_ms"], stats["p95_ms"]) == (1, 3, None, None)
    profiler.log_events()
    assert logged == ["custom: count = 1, numel = 3 (as counted)"]


def test_copies_keep_their_class():
    for timers in (None, object()):
        profiler = PartitionedParameterProfiler(timers)
        assert type(copy.deepcopy(profiler)) is type(profiler)


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
    profiler = PartitionedParameterProfiler(object(), element_size=2)
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


def test_latency_samples_stay_bounded_and_spread_over_the_record(monkeypatch):
    durations = [us * 1000 for us in range(1, 10_001)]  # 1 .. 10000 us, in time order
    scripted_clock(monkeypatch, durations)
    profiler = PartitionedParameterProfiler(object())
    for _ in durations:
        with profiler.event("backward_fetch_wait", 1):
            pass
    counter = profiler.event_counters["backward_fetch_wait"]
    assert SAMPLES_PER_EVENT // 2 <= len(counter.samples) < SAMPLES_PER_EVENT
    assert counter.samples == durations[::counter.sample_mask + 1][:len(counter.samples)]  # evenly spaced
    stats = profiler.statistics()["backward_fetch_wait"]
    assert (stats["min_ms"], stats["max_ms"], stats["count"]) == (0.001, 10.0, 10_000)  # exact
    assert stats["p50_ms"] == pytest.approx(5.0, rel=0.02)
    assert stats["p95_ms"] == pytest.approx(9.5, rel=0.02)
    profiler.reset_events()
    assert (counter.samples, counter.sample_mask) == ([], 0)


def test_bytes_unknown_without_element_size_and_reset_clears_statistics():
    profiler = PartitionedParameterProfiler(object())
    profiler.start_event("custom")
    profiler.stop_event("custom", 3)
    assert profiler.statistics()["custom"]["bytes"] is None
    assert profiler.statistics()["custom"]["numel_unit"] is None
    profiler.reset_events()
    assert profiler.statistics() == {}


def test_memory_is_bounded_however_many_events():
    events = coordinator_sequence(1, 50)
    # Eight event names, each with at most SAMPLES_PER_EVENT latencies (ints of ~36 bytes with the slot).
    bound = len(NUMEL_UNITS) * SAMPLES_PER_EVENT * 64
    tracemalloc.start()
    try:
        profiler = PartitionedParameterProfiler(object(), element_size=4)
        traced = []
        for _ in range(2):
            for _ in range(100_000 // (len(events) // 2) + 1):  # start+stop pairs
                replay(profiler, events)
            traced.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    assert sum(c.count for c in profiler.event_counters.values()) > 200_000
    assert all(len(c.samples) < SAMPLES_PER_EVENT for c in profiler.event_counters.values())
    assert max(traced) < bound


def test_disabled_profiler_does_nothing_and_costs_one_call():
    profiler = PartitionedParameterProfiler(None)
    assert not profiler.enabled
    profiler.stop_event("never_started", 1)  # no error: nothing is checked when disabled
    profiler.start_event("forward_fetch_wait")
    profiler.stop_event("forward_fetch_wait", 5)
    assert profiler.event_counters == {} and profiler.statistics() == {}
    # Empty methods on its class: no test of a flag per call; trace ranges cannot switch it on.
    assert isinstance(profiler, PartitionedParameterProfiler)
    profiler.set_trace_ranges(True)
    assert type(profiler).start_event is module._DisabledProfiler.start_event


def test_stop_without_start_raises_a_real_error():
    profiler = PartitionedParameterProfiler(object())
    with pytest.raises(InvalidArgumentError, match="without a matching start_event"):
        profiler.stop_event("forward_fetch_wait", 1)
    profiler.start_event("forward_fetch_wait")
    profiler.stop_event("forward_fetch_wait", 1)
    with pytest.raises(AssertionError):  # DeepSpeed asserted; existing handlers still catch it
        profiler.stop_event("forward_fetch_wait", 1)


def test_context_manager_form_stops_on_error():
    profiler = PartitionedParameterProfiler(object())
    with pytest.raises(RuntimeError):
        with profiler.event("forward_fetch_wait", 7):
            raise RuntimeError("fetch failed")
    assert counts(profiler) == {"forward_fetch_wait": (1, 7)}


def test_log_events_reports_counts_and_times_on_rank_zero(monkeypatch):
    logged = []
    monkeypatch.setattr(module, "log_dist", lambda message, ranks: logged.append((message, ranks)))
    profiler = PartitionedParameterProfiler(object())
    with profiler.event("forward_fetch_wait", 12):
        pass
    profiler.log_events()
    assert len(logged) == 1
    message, ranks = logged[0]
    assert ranks == [0]
    assert message.startswith("forward_fetch_wait: count = 1, numel = 12 (shard), time = ")


def test_trace_ranges_while_torch_profiler_records():
    profiler = PartitionedParameterProfiler(object())
    profiler.set_trace_ranges(True)
    nvtx.set_torch_profiler_recording(True)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            profiler.start_event("forward_fetch_wait")
            torch.ones(4).sum()
            profiler.stop_event("forward_fetch_wait", 42)
    finally:
        nvtx.set_torch_profiler_recording(False)
        profiler.set_trace_ranges(False)
    names = {event.name for event in prof.events()}
    assert "zero3.forward_fetch_wait" in names
    assert "zero3.forward_fetch_wait numel=42 (shard)" in names
    assert counts(profiler) == {"forward_fetch_wait": (1, 42)}
    assert type(profiler) is PartitionedParameterProfiler  # back to the plain methods
