"""The per-step ZeRO-3 fetch records of one engine on one rank (record schema 3, docs/zero_fetch.md).

The recorder puts its :class:`~.fetch_profiler.PartitionedParameterProfiler` in the engine's ZeRO-3
parameter coordinator once, and switches its ``recording`` flag per step: the profiler holds the
step's events, device intervals and collectives; the recorder decides the step boundaries and writes
the records.  Step boundaries are ours, not DeepSpeed's: DeepSpeed resets its counters at the *next*
forward, so a record is opened when a forward starts (that is when the step numbers are read) and
finished when ``engine.step()`` returns -- or, for an eval forward, when its forward ends.  Steps
that ``log_interval`` skips run with ``recording`` off: one attribute test per fetch event, what
DeepSpeed's own disabled profiler costs.

A record is written once its device times are known (at once on the host clock).  Each is one line
written by one ``write`` call on an unbuffered file: every finished step is on disk, and a kill never
leaves half a line.  A train step interrupted before ``engine.step()`` returned is not written at all.
"""
from __future__ import annotations

import time
import weakref
from collections import deque
from time import perf_counter_ns
from typing import Any, Deque, Dict, List, Optional

import orjson
import torch

from ..config import PartitionedParamProfilerConfig
from ..logging import logger, warning_once
from ..nvtx import ranges_active
from .._signal_exit import close_at_exit
from ..outputs import ProcessIdentity, fetch_records_file
from . import collectives
from .device_clock import DeviceEvents, Pair
from .fetch_profiler import (DEVICE_TIMED, SIDE_STREAM_SUFFIX, PartitionedParameterProfiler, device_entry, pair_ns,
                             pairs_clock)
from .hooks import Listener
from .memory import StepMemory

__all__ = ["PROFILER_ATTR", "RECORDER_ATTR", "RECORD_SCHEMA", "ZeroFetchRecorder"]

PROFILER_ATTR = "_PartitionedParameterCoordinator__profiler"
"""Where DeepSpeed 0.19's coordinator keeps its profiler (a name-mangled private attribute)."""
AVAILABLE_ATTR = "_PartitionedParameterCoordinator__n_available_params"
"""DeepSpeed 0.19's count of parameter elements gathered (AVAILABLE or INFLIGHT), which
``stage3_max_live_parameters`` bounds."""
RECORDER_ATTR = "_ds_profutils_fetch_recorder"
"""The engine attribute that holds its recorder while attached."""
RECORD_SCHEMA = 3
SETTLE_SECONDS = 2.0
"""How long ``close`` waits for device times before writing host times (never blocking on the device)."""
_NS_PER_MS = 1e6


class _Step:
    """One record being filled: what was read at the forward start, and what its step measured."""

    def __init__(self, fields: Dict[str, Any], start_mark: Any) -> None:
        self.fields = fields
        self.start_ns = self.end_ns = perf_counter_ns()
        self.start_mark, self.end_mark = start_mark, None
        self.forward_done = self.backward_done = self.step_done = False
        self.events: Dict[str, Dict[str, Any]] = {}
        self.device_pairs: Dict[str, List[Pair]] = {}
        self.collectives: Dict[tuple, Any] = {}
        self.step_pair: Optional[Pair] = None

    def complete(self, closing: bool) -> bool:
        """Whether this record holds a whole step: its ``step()`` returned, or its forward ended and no
        ``step()`` was to come -- an eval forward, or a second forward started before one ``step()``
        (a micro step before the accumulation boundary, which ended when its backward returned).  At
        close, a train forward whose backward never returned was cut short (SIGTERM in its backward,
        an exception): not a whole step."""
        if self.step_done or self.backward_done:
            return True
        return self.forward_done and (not closing or self.fields["mode"] == "eval")

    def pairs(self) -> List[Pair]:
        found = [pair for pairs in self.device_pairs.values() for pair in pairs]
        for totals in self.collectives.values():
            found += totals.blocking_pairs + totals.async_pairs
        return found + ([self.step_pair] if self.step_pair is not None else [])


class ZeroFetchRecorder(Listener):
    """Owns the fetch profiler in an engine's coordinator and the per-rank JSONL file of its records.

    ``close()`` (also at exit) writes what is finished, gives the coordinator DeepSpeed's profiler back
    and closes the file.  ``append``: add to the file (the engine was recorded earlier in this process)
    rather than start it afresh.
    """

    def __init__(self, engine: Any, coordinator: Any, settings: PartitionedParamProfilerConfig, *, name: str,
                 identity: ProcessIdentity, dtype: torch.dtype, device_events: Optional[DeviceEvents],
                 memory: Optional[StepMemory], append: bool = False) -> None:
        self.name = name
        self.settings = settings
        self.path = fetch_records_file(settings.output_dir, identity.rank, name)
        self.device_events = device_events
        self.memory = memory
        element_size = torch.empty((), dtype=dtype).element_size()
        # The engine's timers, driven as DeepSpeed's profiler drives them when switched on in source.
        self.profiler = PartitionedParameterProfiler(engine.timers, element_size=element_size,
                                                     device_events=device_events)
        self.profiler.recording = False
        state = vars(coordinator)
        self.profiler.available_params = lambda: state[AVAILABLE_ATTR]
        self._header = {
            "schema": RECORD_SCHEMA, "engine": name, "rank": identity.rank, "world_size": identity.world_size,
            "local_rank": identity.local_rank, "host": identity.host, "pid": identity.pid,
            "recording_ranks": settings.ranks, "dtype": str(dtype)[len("torch."):], "clock": "host",
            "max_live_parameters": engine.zero_max_live_parameters()
        }  # on the device clock, each record says its own clock
        self._engine = engine
        self._coordinator = coordinator
        self._original_profiler = state[PROFILER_ATTR]
        self._open: Optional[_Step] = None
        self._waits_at_open = 0
        self._unwritten: Deque[_Step] = deque()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab" if append else "wb", buffering=0)  # one write() per record
        setattr(coordinator, PROFILER_ATTR, self.profiler)
        self._counts_invalidations = "_invalidate_trace" not in state
        if self._counts_invalidations:
            invalidate = coordinator._invalidate_trace

            def counting_invalidate() -> None:
                self.profiler.trace_cache_invalidations += 1
                invalidate()

            coordinator._invalidate_trace = counting_invalidate
        # once: at close, or when the recorder is collected with its engine
        self._detach_collectives = weakref.finalize(self, collectives.attach_profiler(self.profiler))
        self._forget_at_exit = close_at_exit(self.close)  # a SIGTERM the profiler re-raises skips atexit
        setattr(engine, RECORDER_ATTR, self)

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran: the file is complete and the coordinator has DeepSpeed's profiler back."""
        return self._file.closed

    # ---- step boundaries (EngineHooks) ----------------------------------------------------------------

    def forward_started(self, module: torch.nn.Module) -> None:
        profiler, engine = self.profiler, self._engine
        self._finish_open(closing=False)  # an eval forward, or a forward whose step() never came
        self._write_ready()
        recorded = engine.global_steps % self.settings.log_interval == 0
        profiler.recording = recorded
        profiler.logging_enabled = recorded and _print_step(engine)  # DeepSpeed's reset_step logs next
        if not recorded:
            return
        profiler.trace_ranges = self.settings.trace_ranges and ranges_active()
        fields = {
            "mode": "train" if module.training else "eval",
            "global_step": engine.global_steps,
            "micro_step": engine.micro_steps,
            "time": time.time(),
            "comms_logger": _comms_logger_on(),
        }
        events = self.device_events
        if events is not None:
            from deepspeed.accelerator import get_accelerator

            profiler.compute_stream = get_accelerator().current_stream()
        self._waits_at_open = events.waits if events is not None else 0
        self._open = _Step(fields, events.mark() if events is not None else None)
        if self.memory is not None:
            self.memory.begin("forward")

    def forward_ended(self, module: torch.nn.Module) -> None:
        step = self._open
        if step is None:
            return
        self._mark_end(step)
        step.forward_done = True
        evaluating = step.fields["mode"] == "eval"
        if evaluating:  # no step() follows: what comes next is another engine's or the loop's
            self.profiler.recording = False
        if self.memory is not None:
            if evaluating:
                self.memory.end()
            else:
                self.memory.begin("backward")  # which ends the forward's phase

    def backward_ended(self) -> None:
        """Without a ``step()`` to come (Accelerate's micro steps before the boundary) the step ends here."""
        step = self._open
        if step is not None and step.forward_done and step.fields["mode"] == "train":
            step.backward_done = True
            self._mark_end(step)
            if self.memory is not None:
                self.memory.end()

    def step_started(self) -> None:
        if self._open is not None:
            self._open.backward_done = False  # a step() follows after all: the record ends with it
        if self._open is not None and self.memory is not None:
            self.memory.begin("step")

    def step_ended(self) -> None:
        step = self._open
        if step is not None and step.forward_done:
            self._mark_end(step)
            step.step_done = True
            self._finish_open(closing=False)
        self._write_ready()

    def _mark_end(self, step: _Step) -> None:
        """The step ends here for now (its forward's end; then its step()'s end, which replaces it)."""
        step.end_ns = perf_counter_ns()
        if self.device_events is not None:
            self.device_events.release(step.end_mark)
            step.end_mark = self.device_events.mark()

    # ---- records -------------------------------------------------------------------------------

    def _finish_open(self, closing: bool) -> None:
        """Close the open record: take the profiler's figures and queue it for writing if it is complete."""
        step, self._open = self._open, None
        if step is None:
            return
        profiler = self.profiler
        profiler.recording = False
        memory = self.memory.record() if self.memory is not None else None
        if not step.complete(closing):
            if self.device_events is not None:
                self.device_events.release(step.start_mark, step.end_mark)
            return
        step.events = profiler.host_statistics()
        step.device_pairs = {name: counter.device_pairs for name, counter in profiler.event_counters.items()
                             if counter.count and counter.device_pairs is not None}
        step.collectives = profiler.collectives
        fields = step.fields
        if memory is not None:
            fields["memory"] = memory
        fields["live_params_max"] = profiler.live_params_max
        fields["trace_cache_invalidations"] = profiler.trace_cache_invalidations
        fields["prefetch"] = {"hits": profiler.gathered["prefetch"], "waited": profiler.gathered["on_demand"]}
        if self.device_events is not None:
            step.step_pair = self.device_events.pair(step.start_mark, step.end_mark, step.end_ns - step.start_ns)
            # the times this step's events found the pool exhausted and waited on the device
            fields["device_waits"] = self.device_events.waits - self._waits_at_open
        self._unwritten.append(step)

    def _write_ready(self, settled: bool = False) -> None:
        """Write the queued records whose device times are known (all of them when ``settled``)."""
        if self.device_events is not None:
            self.device_events.poll()
        while self._unwritten and (settled or all(pair.resolved for pair in self._unwritten[0].pairs())):
            line = self._line(self._unwritten[0])  # an interruption while it is built leaves the step queued
            self._unwritten.popleft()
            self._write(line)

    def _line(self, step: _Step) -> bytes:
        record = {**self._header, **step.fields}
        events = dict(step.events)
        for name, pairs in step.device_pairs.items():  # the waits the compute stream saw, on the device clock
            events[name] = device_entry(name, events[name], pairs, self.profiler.element_size)
        record["step_time_ms"] = (pair_ns(step.step_pair) if step.step_pair else step.end_ns - step.start_ns) / _NS_PER_MS
        record["fetch_wait_ms"] = sum(events[name]["time_ms"] for name in DEVICE_TIMED if name in events)
        record["collectives"] = entries = {}
        for (op, side), totals in step.collectives.items():
            blocking_ms = _total_ms(totals.blocking_pairs, totals.blocking_ns)
            inside_ms = blocking_ms + _total_ms(totals.async_pairs, totals.async_ns)
            pairs = totals.blocking_pairs + totals.async_pairs
            entries[op + SIDE_STREAM_SUFFIX if side else op] = {
                "count": totals.count, "async": totals.async_count, "time_ms": inside_ms,
                "exposed_ms": 0.0 if side else blocking_ms, "stream": "side" if side else "compute",
                "clock": pairs_clock(pairs) if pairs else "host"
            }
        record["collective_ms"] = sum(entry["time_ms"] for entry in entries.values())
        record["collective_wait_ms"] = sum(entry["exposed_ms"] for entry in entries.values())
        record["exposed_wait_ms"] = record["fetch_wait_ms"] + record["collective_wait_ms"]
        if self.device_events is not None:
            record["clock"] = pairs_clock(step.pairs())
        record["events"] = events
        # orjson: a record is built on the step's own time, and the stdlib's encoder was a quarter of it.
        return orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE | orjson.OPT_SERIALIZE_NUMPY)

    def _write(self, line: bytes) -> None:
        try:
            self._file.write(line)
        except OSError as exc:
            warning_once(f"ds_profutils: cannot write ZeRO-3 fetch records to {self.path} ({exc.strerror}); "
                         "training goes on, those steps are not recorded")

    def close(self) -> None:
        """Write what is finished, give the coordinator DeepSpeed's profiler back, close the file.

        An eval forward that ended is written; a train step whose ``step()`` did not return is not.
        Device times are awaited for at most ``SETTLE_SECONDS``; later ones are written as host times.
        """
        if self.closed:
            return
        try:
            self._finish_open(closing=True)
            if self.device_events is not None:
                self.device_events.settle(SETTLE_SECONDS)
            self._write_ready(settled=True)
        finally:
            self._detach()

    def _detach(self) -> None:
        """Close the file and give the coordinator back as DeepSpeed made it."""
        self._forget_at_exit()
        self._file.close()
        self.profiler.recording = False
        self._detach_collectives()
        coordinator = self._coordinator
        if vars(coordinator).get(PROFILER_ATTR) is self.profiler:
            setattr(coordinator, PROFILER_ATTR, self._original_profiler)
        if self._counts_invalidations:
            vars(coordinator).pop("_invalidate_trace", None)
        if getattr(self._engine, RECORDER_ATTR, None) is self:
            delattr(self._engine, RECORDER_ATTR)

    def stop_after_error(self, exc: Exception) -> None:
        logger.error("ds_profutils: the ZeRO-3 fetch recorder of engine %r failed (%s: %s); it stops recording and "
                     "training goes on; the steps recorded so far are in %s", self.name, type(exc).__name__, exc,
                     self.path)
        if self.closed:
            return
        try:
            self._write_ready(settled=True)  # what finished, on host times where device times are not known
        except Exception:  # the same failure again: the records before it are on disk
            pass
        self._detach()


def _total_ms(pairs: List[Pair], host_ns: int) -> float:
    """Intervals on the device clock where there are any, else the host's total."""
    return (sum(map(pair_ns, pairs)) if pairs else host_ns) / _NS_PER_MS


def _print_step(engine: Any) -> bool:
    """The first forward of a global step at which DeepSpeed's engine prints (``steps_per_print``)."""
    every = engine.steps_per_print()
    first_micro_step = engine.micro_steps % engine.gradient_accumulation_steps() == 0
    return bool(every) and engine.global_steps % every == 0 and first_micro_step


def _comms_logger_on() -> bool:
    from deepspeed.comm import comm

    return bool(getattr(comm.comms_logger, "enabled", False))
