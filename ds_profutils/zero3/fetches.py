"""ZeRO-3's part of an engine's step records: the fetch profiler in the engine's coordinator, per step.

DeepSpeed 0.19's parameter coordinator keeps its profiler in a name-mangled attribute and calls it on
every fetch.  :class:`CoordinatorFetches` puts one :class:`~.fetch_profiler.PartitionedParameterProfiler`
there for as long as the engine is recorded, switches its ``recording`` flag at the step boundaries
the engine's recorder decides, and hands over what each step learned about fetches as a
:class:`StepFetches`, which fills the record's fetch fields.  Everything else in a record (step time,
collectives, memory) is the engine's, measured the same way for every ZeRO stage.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from deepspeed.utils.timer import NoopTimer

from .._device_clock import DeviceEvents, Pair
from .entries import DEVICE_TIMED, device_entry
from .fetch_profiler import PartitionedParameterProfiler

__all__ = ["AVAILABLE_ATTR", "PROFILER_ATTR", "CoordinatorFetches", "StepFetches", "fetch_wait_ms", "in_flight_waited"]

PROFILER_ATTR = "_PartitionedParameterCoordinator__profiler"
"""Where DeepSpeed 0.19's coordinator keeps its profiler (a name-mangled private attribute)."""
AVAILABLE_ATTR = "_PartitionedParameterCoordinator__n_available_params"
"""DeepSpeed 0.19's count of parameter elements gathered (AVAILABLE or INFLIGHT), which
``stage3_max_live_parameters`` bounds."""


class StepFetches:
    """What one finished step learned about fetches: host-clock event entries, the fetch waits' device
    intervals (read lazily), and the step's gather figures."""

    __slots__ = ("events", "device_pairs", "fields", "element_size")

    def __init__(self, profiler: PartitionedParameterProfiler) -> None:
        self.events = profiler.host_statistics()
        self.device_pairs: Dict[str, List[Pair]] = {
            name: counter.device_pairs for name, counter in profiler.event_counters.items()
            if counter.count and counter.device_pairs is not None}
        self.fields = {
            "live_params_max": profiler.live_params_max,
            "trace_cache_invalidations": profiler.trace_cache_invalidations,
            "prefetch": {"hits": profiler.gathered["prefetch"], "waited": profiler.gathered["on_demand"],
                         "in_flight_waited": in_flight_waited(self.events)},
        }
        self.element_size = profiler.element_size

    def pairs(self) -> List[Pair]:
        return [pair for pairs in self.device_pairs.values() for pair in pairs]

    def entries(self) -> Dict[str, Dict[str, Any]]:
        """The record's ``events``: the waits the compute stream saw on the device clock where it has one."""
        events = dict(self.events)
        for name, pairs in self.device_pairs.items():
            events[name] = device_entry(name, events[name], pairs, self.element_size)
        return events


_SUBMITTED = ("forward_fetch_submit", "backward_fetch_submit")  # on-demand gathers, numel in shards as the waits'


def in_flight_waited(events: Dict[str, Dict[str, Any]]) -> int:
    """Elements (shards) whose prefetch was launched but not complete when needed.

    DeepSpeed 0.19's coordinator counts into a fetch wait event's numel every element still in its in-flight
    registry when the module needs it: those its fetch submit has just gathered on demand, and those a
    prefetch launched earlier that had not been waited for yet.  The waits' elements less the submits' are
    the latter (both count shards, ``partition_numel``).
    """
    waited = sum(events[name]["numel"] for name in DEVICE_TIMED if name in events)
    return max(0, waited - sum(events[name]["numel"] for name in _SUBMITTED if name in events))


def fetch_wait_ms(events: Dict[str, Dict[str, Any]]) -> float:
    """The time the compute stream waited for fetches: the wait events' total."""
    return sum(events[name]["time_ms"] for name in DEVICE_TIMED if name in events)


class CoordinatorFetches:
    """The fetch profiler in one engine's coordinator while the engine is recorded; ``remove()`` gives the
    coordinator DeepSpeed's profiler back.  The coordinator's trace invalidations are counted too."""

    def __init__(self, engine: Any, coordinator: Any, *, element_size: int,
                 device_events: Optional[DeviceEvents]) -> None:
        # The timer group DeepSpeed's engine hands its ZeRO-3 optimizer and coordinator: its own with
        # wall_clock_breakdown, else a NoopTimer.  Driving the engine's group regardless would time every
        # fetch into timers nothing logs or resets (a list growing per event, and its cost every event).
        timers = engine.timers if engine.wall_clock_breakdown() else NoopTimer()
        self.profiler = profiler = PartitionedParameterProfiler(timers, element_size=element_size,
                                                                device_events=device_events)
        profiler.recording = False
        profiler.strict = False  # recording is switched per step: an event may straddle the switch
        state = vars(coordinator)
        profiler.available_params = lambda: state[AVAILABLE_ATTR]
        self.header = {"max_live_parameters": engine.zero_max_live_parameters()}
        self._engine = engine
        self._coordinator = coordinator
        self._original = state[PROFILER_ATTR]
        setattr(coordinator, PROFILER_ATTR, profiler)
        self._counts_invalidations = "_invalidate_trace" not in state
        if self._counts_invalidations:
            invalidate = coordinator._invalidate_trace

            def counting_invalidate() -> None:
                profiler.trace_cache_invalidations += 1
                invalidate()

            coordinator._invalidate_trace = counting_invalidate

    def begin(self, recorded: bool, trace_ranges: bool) -> None:
        """A forward starts (before DeepSpeed's ``reset_step``, which zeroes the counters)."""
        profiler = self.profiler
        profiler.recording = recorded
        profiler.logging_enabled = recorded and _print_step(self._engine)  # DeepSpeed's reset_step logs next
        if recorded:
            profiler.trace_ranges = trace_ranges

    def pause(self) -> None:
        """Nothing more of this step is the record's (an eval forward ended, or the step did)."""
        self.profiler.recording = False

    def take(self) -> StepFetches:
        return StepFetches(self.profiler)

    def remove(self) -> None:
        self.profiler.recording = False
        coordinator = self._coordinator
        if vars(coordinator).get(PROFILER_ATTR) is self.profiler:
            setattr(coordinator, PROFILER_ATTR, self._original)
        if self._counts_invalidations:
            vars(coordinator).pop("_invalidate_trace", None)


def _print_step(engine: Any) -> bool:
    """The first forward of a global step at which DeepSpeed's engine prints (``steps_per_print``)."""
    every = engine.steps_per_print()
    first_micro_step = engine.micro_steps % engine.gradient_accumulation_steps() == 0
    return bool(every) and engine.global_steps % every == 0 and first_micro_step
