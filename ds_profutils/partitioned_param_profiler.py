"""``PartitionedParameterProfiler``: DeepSpeed's ZeRO-3 fetch profiler, cheap enough to leave on.

DeepSpeed's ZeRO-3 parameter coordinator calls ``start_event(name)`` / ``stop_event(name, numel)``
around every parameter fetch, wait, prefetch and all-gather.  Its own profiler does this through a
``SynchronizedWallClockTimer`` (one stored record per event until logged, ``time.time()``) and is
switched off in source.  This class keeps DeepSpeed's interface and meaning -- counts and numel are
the ones DeepSpeed would count -- and adds, per event name and in constant memory:

* total, min and max time on ``time.perf_counter_ns()``;
* p50/p95 from a bounded sample of latencies: every latency while a record has at most
  ``SAMPLES_PER_EVENT`` of that event (so exact in usual steps), then every 2nd, 4th, ... one, evenly
  spread over the record.  Memory stays constant; binning each latency into a histogram instead
  would cost about as much per fetch as all the rest together;
* bytes, from the element size of the parameters' dtype.

``timers=None`` means disabled, as in DeepSpeed.  The ``timers`` object itself only switches the
profiler on; time is measured here, so it never synchronizes a device.

Every ZeRO-3 fetch goes through ``start_event``/``stop_event``, so they carry no per-call switch: a
disabled profiler is a ``_DisabledProfiler`` with empty methods, and an enabled one becomes a
``_RangedProfiler`` while trace ranges are on (switched at step boundaries).  A flag test or a
per-instance override would cost 10-50 ns on every fetch.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any, Dict, Iterable, Iterator, List, Optional

from .exceptions import InvalidArgumentError
from .logging import log_dist
from .nvtx import nvtx_range

__all__ = ["NUMEL_UNITS", "SAMPLES_PER_EVENT", "PartitionedParameterProfiler"]

NUMEL_UNITS: Dict[str, str] = {
    "forward_fetch_submit": "shard",
    "forward_fetch_wait": "shard",
    "backward_fetch_submit": "shard",
    "backward_fetch_wait": "shard",
    "forward_prefetch_submit": "full",
    "backward_prefetch_submit": "full",
    "forward_all_gather": "full",
    "backward_all_gather": "full",
}
"""What DeepSpeed 0.19's coordinator counts as an event's numel.

Fetch and wait events count this rank's shard (``partition_numel``); prefetch and all-gather events
count the whole parameters (``ds_numel``).  Records name the unit so nobody adds the two.
"""

SAMPLES_PER_EVENT = 1024  # latencies kept per event and record; a power of two, halved when full
_NO_DURATION_YET = sys.maxsize  # min_ns before the first event, so stop_event needs no first-event test
_NS_PER_MS = 1e6
_PERCENTILES = {"p50_ms": 50, "p95_ms": 95}


def _not_started(name: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"stop_event({name!r}) without a matching start_event({name!r})")


class PartitionedParameterProfiler:
    """Drop-in for ``deepspeed.runtime.zero.partitioned_param_profiler.PartitionedParameterProfiler``.

    ``timers`` is DeepSpeed's switch: None disables the profiler; anything else enables it.
    ``element_size`` (bytes per parameter element) lets statistics report bytes; None leaves them out.
    """

    @dataclass(eq=False)
    class EventCounter:
        """Running statistics of one event name; DeepSpeed's fields and methods come first."""

        name: str
        count: int = 0
        num_elem: int = 0
        total_ns: int = 0
        min_ns: int = _NO_DURATION_YET
        max_ns: int = 0
        samples: List[int] = field(default_factory=list, repr=False)
        sample_mask: int = 0  # the i-th duration (from 0) is sampled when i & sample_mask == 0
        started_ns: int = -1  # perf_counter_ns() at start_event; -1 while not running

        def reset(self) -> None:
            """Forget what was counted; an event that is running keeps running."""
            self.count = self.num_elem = self.total_ns = self.max_ns = self.sample_mask = 0
            self.min_ns = _NO_DURATION_YET
            self.samples.clear()

        def increment(self, numel: int) -> None:
            """Count one event of ``numel`` elements (DeepSpeed's method; timing is ``stop_event``'s)."""
            self.count += 1
            self.num_elem += numel

        def halve_samples(self) -> None:
            """Keep every other sample and sample half as often from now on: memory stays bounded."""
            del self.samples[1::2]
            self.sample_mask = self.sample_mask * 2 + 1

        def percentiles_ms(self, percents: Iterable[int]) -> List[Optional[float]]:
            """Those percentiles (nearest rank) of the sampled durations; None where none was timed."""
            ordered = sorted(self.samples)
            return [
                ordered[max(0, -(-len(ordered) * percent // 100) - 1)] / _NS_PER_MS if ordered else None
                for percent in percents
            ]

    def __new__(cls, timers: Any = None, **kwargs: Any) -> "PartitionedParameterProfiler":
        # Built as _DisabledProfiler from the start: CPython specialises a method call for the class
        # an instance's attributes were laid out under, so assigning __class__ later would not do.
        return super().__new__(_DisabledProfiler if timers is None and cls is PartitionedParameterProfiler else cls)

    def __getnewargs__(self) -> tuple:
        """copy and pickle build the same class again (``__new__`` chooses it from ``timers``)."""
        return (self.timers, )

    def __init__(self, timers: Any, *, element_size: Optional[int] = None) -> None:
        self.timers = timers
        self.element_size = element_size
        self.event_counters: Dict[str, PartitionedParameterProfiler.EventCounter] = {}
        self._open_ranges: Dict[str, nvtx_range] = {}

    @property
    def enabled(self) -> bool:
        """Whether events are measured (``timers`` was not None)."""
        return self.timers is not None

    def start_event(self, name: str) -> None:
        """Mark the start of one ``name`` event."""
        try:
            counter = self.event_counters[name]
        except KeyError:
            counter = self.event_counters[name] = self.EventCounter(name)
        counter.started_ns = perf_counter_ns()

    def stop_event(self, name: str, num_elem: int) -> None:
        """Mark the end of the running ``name`` event, which moved ``num_elem`` elements."""
        end_ns = perf_counter_ns()
        try:
            counter = self.event_counters[name]
        except KeyError:
            raise _not_started(name) from None
        started_ns = counter.started_ns
        if started_ns < 0:
            raise _not_started(name)
        counter.started_ns = -1
        elapsed = end_ns - started_ns
        index = counter.count
        counter.count = index + 1
        counter.num_elem += num_elem
        counter.total_ns += elapsed
        if elapsed < counter.min_ns:
            counter.min_ns = elapsed
        if elapsed > counter.max_ns:
            counter.max_ns = elapsed
        if not index & counter.sample_mask:
            samples = counter.samples
            samples.append(elapsed)
            if len(samples) == SAMPLES_PER_EVENT:
                counter.halve_samples()

    @contextmanager
    def event(self, name: str, num_elem: int) -> Iterator[None]:
        """The block is one ``name`` event of ``num_elem`` elements; it is stopped also on error."""
        self.start_event(name)
        try:
            yield
        finally:
            self.stop_event(name, num_elem)

    def set_trace_ranges(self, on: bool) -> None:
        """While on, each event is also a named range in the torch trace and in Nsight.

        The caller switches at a step boundary (when a torch profiler can start), not per event.
        """
        wanted = _RangedProfiler if on else PartitionedParameterProfiler
        if type(self) is not wanted:
            self.__class__ = wanted

    def reset_events(self) -> None:
        """Zero every counter (DeepSpeed calls this at the start of each forward)."""
        for counter in self.event_counters.values():
            counter.reset()

    def statistics(self) -> Dict[str, Dict[str, Any]]:
        """Per event seen since the last reset: count, numel (and its unit), bytes and times in ms."""
        stats: Dict[str, Dict[str, Any]] = {}
        for name, counter in self.event_counters.items():
            if not counter.count:
                continue
            timed = bool(counter.samples)  # False only if counted through increment() alone
            entry: Dict[str, Any] = {
                "count": counter.count,
                "numel": counter.num_elem,
                "numel_unit": NUMEL_UNITS.get(name),
                "bytes": None if self.element_size is None else counter.num_elem * self.element_size,
                "time_ms": counter.total_ns / _NS_PER_MS,
                "min_ms": counter.min_ns / _NS_PER_MS if timed else None,
                "max_ms": counter.max_ns / _NS_PER_MS if timed else None,
            }
            entry.update(zip(_PERCENTILES, counter.percentiles_ms(_PERCENTILES.values())))
            stats[name] = entry
        return stats

    def log_events(self) -> None:
        """Log each event's counters and times on rank 0, as DeepSpeed's profiler does."""
        for name, entry in self.statistics().items():
            unit = entry["numel_unit"] or "as counted"
            times = "" if entry["min_ms"] is None else (
                f", time = {entry['time_ms']:.3f} ms (min {entry['min_ms']:.3f}, p50 {entry['p50_ms']:.3f}, "
                f"p95 {entry['p95_ms']:.3f}, max {entry['max_ms']:.3f})")
            log_dist(f"{name}: count = {entry['count']}, numel = {entry['numel']} ({unit}){times}", ranks=[0])


class _DisabledProfiler(PartitionedParameterProfiler):
    """What ``PartitionedParameterProfiler(None)`` is: every fetch pays one empty call."""

    def start_event(self, name: str) -> None:
        pass

    def stop_event(self, name: str, num_elem: int) -> None:
        pass

    def set_trace_ranges(self, on: bool) -> None:
        pass


class _RangedProfiler(PartitionedParameterProfiler):
    """An enabled profiler while ``set_trace_ranges(True)``: each event is also a named range.

    The range opens before the clock starts and closes after it stops, so times exclude it.  The
    numel is known only at the stop; a short child range carries it into the trace.
    """

    def start_event(self, name: str) -> None:
        scope = nvtx_range(f"zero3.{name}")
        scope.__enter__()
        self._open_ranges[name] = scope
        super().start_event(name)

    def stop_event(self, name: str, num_elem: int) -> None:
        super().stop_event(name, num_elem)
        scope = self._open_ranges.pop(name, None)
        if scope is not None:
            with nvtx_range(f"zero3.{name} numel={num_elem} ({NUMEL_UNITS.get(name, 'as counted')})"):
                pass
            scope.__exit__(None, None, None)
