"""``PartitionedParameterProfiler``: DeepSpeed's ZeRO-3 fetch profiler, cheap enough to leave on.

DeepSpeed's ZeRO-3 parameter coordinator calls ``start_event(name)`` / ``stop_event(name, numel)``
around every parameter fetch, wait, prefetch and all-gather.  Its own profiler drives the
``timers`` object it is given (``timers(name).start()``/``.stop()``, ``timers.log(names=...)`` in
``log_events``) and is switched off in source.  This class does what DeepSpeed's does with the same
``timers`` -- the same calls, so the same timer lines in the engine's wall-clock log -- and keeps its
own figures besides: per event name and in constant memory, exact count, numel, total, min and max
time on ``time.perf_counter_ns()``, percentiles from a bounded random sample
(:class:`ds_profutils._stats.DurationStats`), and bytes from the parameters' element size.

It also holds what one recorded step learns about fetches: the fetch events, their device-clock
intervals, the most parameter elements gathered at once, and how much was gathered by prefetch
against on demand (the step's time and collectives are the engine's, :mod:`ds_profutils.engine`).
``recording`` switches all of it: False costs one attribute test per call, what DeepSpeed's disabled
profiler costs (``timers is None``).  ``attach`` installs one per engine once and switches
``recording`` per step; built directly, it records whenever ``timers`` is not None, as DeepSpeed's.

Clocks: where the accelerator times on the device (``use_host_timers()`` False, e.g. CUDA) the fetch
waits -- the stall the compute stream sees -- are also bracketed by device events
(:mod:`ds_profutils._device_clock`); submits, prefetches and the all-gather pair DeepSpeed brackets are launches
(the all-gather pair wraps a copy on DeepSpeed's all-gather stream, not the NCCL kernel), so they
stay on the host clock.

Nothing here raises into DeepSpeed's forward or backward on odd sequences of a known event: a start
of an event that is running, or a stop without a start (DeepSpeed runs leaf-module backward hooks
from several threads), is counted in ``dropped`` and training goes on.  Such a stop still counts the
event and its numel, as DeepSpeed's counters would; it only has no time.  A stop of an event name
never started is a caller's mistake, not a race: it raises ``AssertionError("unknown event ...")``
as DeepSpeed's does (an :class:`~ds_profutils.exceptions.InvalidArgumentError`, which is one) --
except under ``attach``, which switches ``recording`` per step (``strict`` False), so an event may
begin before the switch and end after it.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any, Callable, Dict, Iterator, List, Optional

from deepspeed.utils.timer import NoopTimer, SynchronizedWallClockTimer

from .._device_clock import DeviceEvents, Pair, process_device_events
from .._stats import FOLD_EVERY, DurationStats
from ..exceptions import InvalidArgumentError
from ..logging import log_dist
from ..nvtx import nvtx_range
from ..timer import _Timer as HostTimer
from .entries import DEVICE_TIMED, NUMEL_UNITS, device_entry, event_entry

__all__ = ["PartitionedParameterProfiler"]

# What an event tells about where an all-gather inside it comes from (DeepSpeed's coordinator opens a
# submit event, gathers, and closes it): on demand (a fetch submit) or ahead of need (a prefetch submit).
_ON_DEMAND, _PREFETCH = "on_demand", "prefetch"
# Per all-gather event, the submit events of its pass: (prefetch, on demand).  At the all-gather's stop the
# one running says where it came from (read there, so the submits themselves do no extra work).
_SUBMITS = {
    "forward_all_gather": ("forward_prefetch_submit", "forward_fetch_submit"),
    "backward_all_gather": ("backward_prefetch_submit", "backward_fetch_submit"),
}
_FOLD_MASK = FOLD_EVERY - 1  # stop_event folds when an event's count is a multiple of FOLD_EVERY (a power of 2)
assert FOLD_EVERY & _FOLD_MASK == 0


class _DeepSpeedHostTimerFeed:
    """Gives durations to a DeepSpeed host-clock timer: its ``stop()`` appends each interval in seconds to
    ``event_timers``, which is all its ``elapsed()``, ``mean()`` and the timers' log read.  Appending the
    profiler's own durations there (monotonic, in batches) costs a fraction of a ``start()``/``stop()`` pair,
    each of which reads the wall clock and looks the accelerator up again."""

    __slots__ = ("event_timers", )

    def __init__(self, event_timers: List[float]) -> None:
        self.event_timers = event_timers

    def add_durations(self, durations_ns: List[float]) -> None:
        self.event_timers.extend([duration / 1e9 for duration in durations_ns])


class _NeverRunning:
    """Stands for a submit event not seen yet: an all-gather's stop reads ``started_ns`` off it."""

    started_ns = None


_NEVER_RUNNING = _NeverRunning()
_DEEPSPEED_TIMER = SynchronizedWallClockTimer.Timer
_FROM_ACCELERATOR: Any = object()  # device_events default: as the accelerator's timers decide


class PartitionedParameterProfiler:
    """Drop-in for ``deepspeed.runtime.zero.partitioned_param_profiler.PartitionedParameterProfiler``.

    ``timers`` is DeepSpeed's: None disables the profiler; any timer group is driven as DeepSpeed
    drives it (a ``NoopTimer`` is skipped: driving it shows nothing).  ``element_size`` (bytes per
    parameter element) lets statistics report bytes; None leaves them out.  ``device_events``: the
    pool that times fetch waits on the device; by default the accelerator's where its timers use
    device events (as DeepSpeed's timers would), None for the host clock only.
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
        device_pairs: Optional[List[Pair]] = None  # this step's device intervals; None: host clock only
        timer_start: Any = None  # start() and stop() of a timer of the ``timers`` group, bound: called with
        timer_stop: Any = None  # each event (one lookup on the hot path, not two)
        feeds: Any = None  # a host-clock timer (ours, or DeepSpeed's through a feed) given the durations in batches
        fed: int = 0  # how many of the pending durations ``feeds`` has had
        submits: Any = None  # an all-gather's: the submit events it may run inside (see _SUBMITS)
        within: Any = None  # an all-gather's: those submits' counters, (prefetch, on demand), read at its stop
        extras: bool = False  # anything beyond the host clock to do at start and stop (trace ranges included)

        def __post_init__(self) -> None:
            if self.durations is None:
                self.durations = DurationStats(self.name)
            self.pending = self.durations.pending  # the hot path appends here
            self.submits = _SUBMITS.get(self.name)

        def feed(self) -> None:
            """Give ``feeds`` the durations it has not had yet (before they are folded or forgotten)."""
            pending, fed = self.pending, self.fed
            if self.feeds is not None and len(pending) > fed:
                self.feeds.add_durations(pending[fed:] if fed else pending)  # (every forward: no copy when it can)
                self.fed = len(pending)

        def fold(self) -> None:
            """Fold the pending durations into the statistics, ``feeds`` given them first."""
            self.feed()
            self.durations.fold()
            self.fed = 0

        def reset(self) -> None:
            """Forget what was counted; an event that is running keeps running."""
            if not (self.count or self.dropped):  # nothing since the last reset (every forward resets)
                return
            self.feed()
            self.count = self.num_elem = self.dropped = self.fed = 0
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
                 device_events: Optional[DeviceEvents] = _FROM_ACCELERATOR) -> None:
        self.timers = timers
        self.element_size = element_size
        if device_events is _FROM_ACCELERATOR:
            from deepspeed.accelerator import get_accelerator

            device_events = process_device_events(get_accelerator())
        self.device_events = device_events
        self.recording = timers is not None
        # Built directly, recording never changes, so a stop of a name never started is the caller's mistake.
        # attach switches recording per step: an event may straddle the switch, and is counted in dropped.
        self.strict = True
        self.logging_enabled = True  # attach lets DeepSpeed's per-forward log_events() through at print steps only
        self._trace_ranges = False
        self.event_counters: Dict[str, PartitionedParameterProfiler.EventCounter] = {}
        self._drives_timers = timers is not None and not isinstance(timers, NoopTimer)
        self._open_ranges: Dict[str, nvtx_range] = {}
        # What one step measures besides the events (attach fills in available_params).
        self.available_params: Optional[Callable[[], int]] = None  # the coordinator's count of gathered elements
        self.live_params_max = 0
        self.gathered = {_ON_DEMAND: 0, _PREFETCH: 0}
        self.trace_cache_invalidations = 0
        self.keep_events = False  # a forward inside the micro step in progress: its start resets nothing

    @property
    def trace_ranges(self) -> bool:
        """Whether each event is also a range in the torch trace and in Nsight (``zero3.<event>``)."""
        return self._trace_ranges

    @trace_ranges.setter
    def trace_ranges(self, on: bool) -> None:
        self._trace_ranges = on
        for counter in self.event_counters.values():
            counter.extras = on or _needs_extras(counter)

    @property
    def enabled(self) -> bool:
        """Whether the profiler was given timers (DeepSpeed's switch); ``recording`` says whether it counts now."""
        return self.timers is not None

    def start_event(self, name: str) -> None:
        """Mark the start of one ``name`` event."""
        if not self.recording:
            return
        try:  # a subscript, not .get(): no method call on the hot path
            counter = self.event_counters[name]
        except KeyError:
            counter = self._new_counter(name)
        if counter.started_ns is not None:  # already running: keep the first start
            counter.dropped += 1
            return
        if counter.extras:  # written out here, not in a helper: a call costs what the rest of start_event does
            if self._trace_ranges:
                self._open_range(name)
            # (few locals: each one costs every call, the disabled one included, as it sets up the frame)
            if counter.submits is not None and self.available_params is not None:  # an all-gather starts:
                live = self.available_params()  # the coordinator has just counted it as gathered
                if live > self.live_params_max:
                    self.live_params_max = live
            if counter.timer_start is not None:
                counter.timer_start()
            if counter.device_pairs is not None:
                counter.device_start = self.device_events.mark()
        counter.started_ns = perf_counter_ns()

    def stop_event(self, name: str, num_elem: int) -> None:
        """Mark the end of the running ``name`` event, which moved ``num_elem`` elements."""
        if not self.recording:
            return
        end_ns = perf_counter_ns()
        try:
            counter = self.event_counters[name]
        except KeyError:
            if self.strict:  # never started: a caller's mistake, which DeepSpeed's asserts on
                raise InvalidArgumentError(f"unknown event {name}") from None
            counter = self._new_counter(name)
        count = counter.count = counter.count + 1
        counter.num_elem += num_elem
        started_ns = counter.started_ns
        if started_ns is None:
            counter.dropped += 1
            if not count & _FOLD_MASK:
                counter.fold()
            return
        counter.started_ns = None
        counter.pending.append(end_ns - started_ns)
        if not count & _FOLD_MASK:  # at most FOLD_EVERY pending: a count, not len(), is at hand
            counter.fold()
        if counter.extras:  # start_event's extras in reverse order
            if counter.device_pairs is not None:
                counter.device_pairs.append(self.device_events.pair(counter.device_start, self.device_events.mark(),
                                                                    end_ns - started_ns))
            if counter.timer_stop is not None:
                counter.timer_stop()
            within = counter.within  # an all-gather's (prefetch, on demand) submits: count it for the one running
            if within is not None:
                if within[0].started_ns is not None:
                    self.gathered[_PREFETCH] += num_elem
                elif within[1].started_ns is not None:
                    self.gathered[_ON_DEMAND] += num_elem
            if self._trace_ranges:
                self._close_range(name, num_elem)

    def _new_counter(self, name: str) -> "PartitionedParameterProfiler.EventCounter":
        counters = self.event_counters
        counter = counters[name] = self.EventCounter(name)
        for gather in counters.values():  # all-gathers hold their submits' counters, as they come
            if gather.submits is not None:
                gather.within = tuple(counters.get(submit, _NEVER_RUNNING) for submit in gather.submits)
        if self.device_events is not None and name in DEVICE_TIMED:
            counter.device_pairs = []
        if self._drives_timers:
            timer = self.timers(name)
            if type(timer) is HostTimer:  # ours, on the host clock: the same durations, given in batches
                counter.feeds = timer
            elif type(timer) is _DEEPSPEED_TIMER and timer.use_host_timer:  # DeepSpeed's on the host clock: likewise
                counter.feeds = _DeepSpeedHostTimerFeed(timer.event_timers)
            else:  # on device events: started and stopped as DeepSpeed does
                counter.timer_start, counter.timer_stop = timer.start, timer.stop
        counter.extras = self._trace_ranges or _needs_extras(counter)
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

    # ---- DeepSpeed's step interface ------------------------------------------------------------------

    def reset_events(self) -> None:
        """Zero every counter (DeepSpeed calls this at the start of each forward), but inside a forward that is
        part of the micro step in progress (``keep_events``, set by the step recorder)."""
        if self.keep_events:
            return
        for counter in self.event_counters.values():
            counter.reset()
        self.live_params_max = 0
        self.gathered[_ON_DEMAND] = self.gathered[_PREFETCH] = 0
        self.trace_cache_invalidations = 0

    def host_statistics(self) -> Dict[str, Dict[str, Any]]:
        """Per event seen since the last reset: count, numel (and its unit), bytes and host times in ms."""
        entries = {}
        for name, counter in self.event_counters.items():
            if counter.count:
                counter.feed()  # reading the figures folds the pending durations
                entries[name] = event_entry(name, counter.count, counter.num_elem, counter.dropped, counter.durations,
                                            "host", self.element_size)
                counter.fed = 0
        return entries

    def statistics(self) -> Dict[str, Dict[str, Any]]:
        """``host_statistics()``, with the events timed on the device on the device clock.

        Reading device times waits for the device, as DeepSpeed's CUDA-event timers do when they are
        logged; the recorder never calls this (it reads device times lazily).
        """
        entries = self.host_statistics()
        for name, counter in self.event_counters.items():
            if counter.count and counter.device_pairs:
                counter.device_pairs[-1].end.synchronize()  # one stream: every earlier event completed too
                self.device_events.poll()
                entries[name] = device_entry(name, entries[name], counter.device_pairs, self.element_size)
        return entries

    def _log_event_counters(self) -> None:
        # Host times: logging never waits for the device (the timers' own line has their clock).
        for name, entry in self.host_statistics().items():
            unit = entry["numel_unit"] or "as counted"
            times = "" if entry["min_ms"] is None else (
                f", host time = {entry['time_ms']:.3f} ms (min {entry['min_ms']:.3f}, p50 {entry['p50_ms']:.3f}, "
                f"p95 {entry['p95_ms']:.3f}, max {entry['max_ms']:.3f})")
            log_dist(f"{name}: count = {entry['count']}, numel = {entry['numel']} ({unit}){times}", ranks=[0])

    def _log_timers(self) -> None:
        if self.timers is not None:
            for counter in self.event_counters.values():
                counter.feed()
            self.timers.log(names=list(self.event_counters))

    def log_events(self) -> None:
        """Log each event's counters and times on rank 0, then the timers' line, as DeepSpeed's profiler does."""
        if not self.logging_enabled:
            return
        self._log_event_counters()
        self._log_timers()


def _needs_extras(counter: "PartitionedParameterProfiler.EventCounter") -> bool:
    """Whether an event always has more to do than the host clock: device events, a timer, all-gathers."""
    return counter.device_pairs is not None or counter.timer_start is not None or counter.submits is not None
