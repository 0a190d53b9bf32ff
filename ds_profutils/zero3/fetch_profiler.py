"""``PartitionedParameterProfiler``: DeepSpeed's ZeRO-3 fetch profiler, cheap enough to leave on.

DeepSpeed's ZeRO-3 parameter coordinator calls ``start_event(name)`` / ``stop_event(name, numel)``
around every parameter fetch, wait, prefetch and all-gather.  Its own profiler does this through a
``SynchronizedWallClockTimer`` (one stored record per event until logged, ``time.time()``) and is
switched off in source.  This class keeps DeepSpeed's interface and meaning -- counts and numel are
the ones DeepSpeed would count -- and adds, per event name and in constant memory, exact total,
min and max time on ``time.perf_counter_ns()``, percentiles from a bounded random sample
(:class:`ds_profutils._stats.DurationStats`), and bytes from the parameters' element size.

``timers=None`` means disabled, as in DeepSpeed.  The ``timers`` object itself only switches the
profiler on; time is measured here, so it never synchronizes a device.  With ``device_events`` (where
``use_host_timers()`` is False, e.g. CUDA), the fetch waits -- the stall the compute stream sees --
are also bracketed by device events (:mod:`.device_clock`); submits, prefetches and the all-gather
pair DeepSpeed brackets are launches (the all-gather pair wraps a copy on DeepSpeed's all-gather
stream, not the NCCL kernel), so they stay on the host clock.

Nothing here raises into DeepSpeed's forward or backward: a start of an event that is running, or a
stop without a start (DeepSpeed runs leaf-module backward hooks from several threads), is counted
in ``dropped`` and training goes on.  Such a stop still counts the event and its numel, as
DeepSpeed's counters would; it only has no time.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any, Dict, Iterator, List, Optional

from .._stats import FOLD_EVERY, DurationStats
from ..logging import log_dist
from ..nvtx import nvtx_range
from .device_clock import DeviceEvents, Pair

__all__ = ["DEVICE_TIMED", "NUMEL_UNITS", "PartitionedParameterProfiler", "event_entry"]

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

DEVICE_TIMED = frozenset({"forward_fetch_wait", "backward_fetch_wait"})
"""Events timed on the device clock where there is one: the waits the compute stream sees."""

_NS_PER_MS = 1e6
_PERCENTILES = {"p50_ms": 50, "p95_ms": 95}


class PartitionedParameterProfiler:
    """Drop-in for ``deepspeed.runtime.zero.partitioned_param_profiler.PartitionedParameterProfiler``.

    ``timers`` is DeepSpeed's switch: None disables the profiler; anything else enables it.
    ``element_size`` (bytes per parameter element) lets statistics report bytes; None leaves them out.
    """

    @dataclass(eq=False)
    class EventCounter:
        """Statistics of one event name; DeepSpeed's fields and methods come first."""

        name: str
        count: int = 0
        num_elem: int = 0
        durations: DurationStats = field(default=None, repr=False)  # type: ignore[assignment]
        dropped: int = 0
        started_ns: Optional[int] = None  # perf_counter_ns() at start_event while the event runs
        device_start: Any = None  # the device event marked at start_event, when timed on the device
        device_pairs: Optional[List[Pair]] = None  # this record's device intervals; None: host clock only

        def __post_init__(self) -> None:
            if self.durations is None:
                self.durations = DurationStats(self.name)
            self.pending = self.durations.pending  # the hot path appends here

        def reset(self) -> None:
            """Forget what was counted; an event that is running keeps running."""
            self.count = self.num_elem = self.dropped = 0
            self.durations.reset()
            if self.device_pairs is not None:
                self.device_pairs = []

        def increment(self, numel: int) -> None:
            """Count one event of ``numel`` elements (DeepSpeed's method; timing is ``stop_event``'s)."""
            self.count += 1
            self.num_elem += numel

    def __init__(self,
                 timers: Any,
                 *,
                 element_size: Optional[int] = None,
                 device_events: Optional[DeviceEvents] = None) -> None:
        self.timers = timers
        self.element_size = element_size
        self.device_events = device_events
        self.trace_ranges = False
        self.event_counters: Dict[str, PartitionedParameterProfiler.EventCounter] = {}
        self._open_ranges: Dict[str, nvtx_range] = {}

    @property
    def enabled(self) -> bool:
        """Whether events are measured (``timers`` was not None)."""
        return self.timers is not None

    def start_event(self, name: str) -> None:
        """Mark the start of one ``name`` event."""
        if self.timers is None:
            return
        counter = self.event_counters.get(name)
        if counter is None:
            counter = self._new_counter(name)
        elif counter.started_ns is not None:  # already running: keep the first start
            counter.dropped += 1
            return
        if self.trace_ranges:
            self._open_range(name)
        if counter.device_pairs is not None:
            counter.device_start = self.device_events.mark()
        counter.started_ns = perf_counter_ns()

    def stop_event(self, name: str, num_elem: int) -> None:
        """Mark the end of the running ``name`` event, which moved ``num_elem`` elements."""
        if self.timers is None:
            return
        end_ns = perf_counter_ns()
        counter = self.event_counters.get(name)
        if counter is None:
            counter = self._new_counter(name)
        counter.count += 1
        counter.num_elem += num_elem
        started_ns = counter.started_ns
        if started_ns is None:
            counter.dropped += 1
            return
        counter.started_ns = None
        pending = counter.pending
        pending.append(end_ns - started_ns)
        if len(pending) >= FOLD_EVERY:
            counter.durations.fold()
        if counter.device_pairs is not None:
            end = self.device_events.mark()
            counter.device_pairs.append(self.device_events.pair(counter.device_start, end, end_ns - started_ns))
        if self.trace_ranges:
            self._close_range(name, num_elem)

    def _new_counter(self, name: str) -> "PartitionedParameterProfiler.EventCounter":
        counter = self.event_counters[name] = self.EventCounter(name)
        if self.device_events is not None and name in DEVICE_TIMED:
            counter.device_pairs = []
        return counter

    @contextmanager
    def event(self, name: str, num_elem: int) -> Iterator[None]:
        """The block is one ``name`` event of ``num_elem`` elements; it is stopped also on error."""
        self.start_event(name)
        try:
            yield
        finally:
            self.stop_event(name, num_elem)

    def _open_range(self, name: str) -> None:
        """A named range in the torch trace and in Nsight, opened before the clock starts."""
        scope = nvtx_range(f"zero3.{name}")
        scope.__enter__()
        self._open_ranges[name] = scope

    def _close_range(self, name: str, num_elem: int) -> None:
        """Close the event's range; the numel, known only now, goes into a short child range."""
        scope = self._open_ranges.pop(name, None)
        if scope is not None:
            with nvtx_range(f"zero3.{name} numel={num_elem} ({NUMEL_UNITS.get(name, 'as counted')})"):
                pass
            scope.__exit__(None, None, None)

    def reset_events(self) -> None:
        """Zero every counter (DeepSpeed calls this at the start of each forward)."""
        for counter in self.event_counters.values():
            counter.reset()

    def statistics(self) -> Dict[str, Dict[str, Any]]:
        """Per event seen since the last reset: count, numel (and its unit), bytes and host times in ms."""
        return {
            name: event_entry(counter.name, counter.count, counter.num_elem, counter.dropped, counter.durations,
                              "host", self.element_size) for name, counter in self.event_counters.items() if counter.count
        }

    def log_events(self) -> None:
        """Log each event's counters and times on rank 0, as DeepSpeed's profiler does."""
        for name, entry in self.statistics().items():
            unit = entry["numel_unit"] or "as counted"
            times = "" if entry["min_ms"] is None else (
                f", time = {entry['time_ms']:.3f} ms (min {entry['min_ms']:.3f}, p50 {entry['p50_ms']:.3f}, "
                f"p95 {entry['p95_ms']:.3f}, max {entry['max_ms']:.3f})")
            log_dist(f"{name}: count = {entry['count']}, numel = {entry['numel']} ({unit}){times}", ranks=[0])


def event_entry(name: str, count: int, numel: int, dropped: int, durations: DurationStats, clock: str,
                element_size: Optional[int]) -> Dict[str, Any]:
    """One event's record entry: DeepSpeed's count and numel, bytes, and the durations in ms on ``clock``."""
    total, low, high = durations.figures()
    entry: Dict[str, Any] = {
        "count": count,
        "numel": numel,
        "numel_unit": NUMEL_UNITS.get(name),
        "bytes": None if element_size is None else numel * element_size,
        "time_ms": total / _NS_PER_MS,
        "min_ms": None if low is None else low / _NS_PER_MS,
        "max_ms": None if high is None else high / _NS_PER_MS,
    }
    for key, value in zip(_PERCENTILES, durations.percentiles(*_PERCENTILES.values())):
        entry[key] = None if value is None else value / _NS_PER_MS
    entry["dropped"] = dropped
    entry["clock"] = clock
    return entry
