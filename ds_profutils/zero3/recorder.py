"""The per-step ZeRO-3 fetch records of one engine on one rank (record schema 2, docs/zero_fetch.md).

Step boundaries are ours, not DeepSpeed's: DeepSpeed resets its counters at the *next* forward, so a
record is opened when a forward starts (that is when the step numbers are read) and finished when
``engine.step()`` returns -- or, for an eval forward, when its forward ends.  Steps that
``log_interval`` skips run with DeepSpeed's own (disabled) profiler, so they cost what they cost
without ds_profutils.

A record is written once its device times are known (at once on the host clock).  Each is one line
written by one ``write`` call on an unbuffered file: every finished step is on disk, and a kill never
leaves half a line.  A train step interrupted before ``engine.step()`` returned is not written at all.
"""
from __future__ import annotations

import atexit
import functools
import time
import weakref
from collections import deque
from time import perf_counter_ns
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, TypeVar

import orjson
import torch

from .._stats import DurationStats
from ..config import PartitionedParamProfilerConfig
from ..logging import logger, warning_once
from ..nvtx import ranges_active
from .._signal_exit import call_before_signal_exit, forget_before_signal_exit
from ..outputs import ProcessIdentity, fetch_records_file
from . import collectives
from .device_clock import DeviceEvents, Pair
from .fetch_profiler import DEVICE_TIMED, PartitionedParameterProfiler, event_entry

__all__ = ["PROFILER_ATTR", "RECORDER_ATTR", "RECORD_SCHEMA", "ZeroFetchRecorder"]

PROFILER_ATTR = "_PartitionedParameterCoordinator__profiler"
"""Where DeepSpeed 0.19's coordinator keeps its profiler (a name-mangled private attribute)."""
RECORDER_ATTR = "_ds_profutils_fetch_recorder"
"""The engine attribute that holds its recorder, so ``attach`` twice returns the same one."""
RECORD_SCHEMA = 2
SETTLE_SECONDS = 2.0
"""How long ``close`` waits for device times before writing host times (never blocking on the device)."""
_NS_PER_MS = 1e6

F = TypeVar("F", bound=Callable[..., Any])


def _never_raises(hook: F) -> F:
    """For the recorder's methods DeepSpeed's forward and ``step()`` run: an error of the recorder (an
    accelerator's event that misbehaves, say) stops the recording, never the training."""

    @functools.wraps(hook)
    def guarded(self: "ZeroFetchRecorder", *args: Any) -> None:
        try:
            hook(self, *args)
        except Exception as exc:
            self._stop_after_error(exc)

    return guarded  # type: ignore[return-value]


def _closer(recorder: "ZeroFetchRecorder") -> Callable[[], None]:
    """``recorder.close`` for atexit and the signal path, holding the recorder weakly: an engine
    dropped without ``close()`` (RLHF reloads, sweeps) is not kept alive by them."""
    ref = weakref.ref(recorder)

    def close() -> None:
        alive = ref()
        if alive is not None:
            alive.close()

    return close


class _Step:
    """One record being filled: what was read at the forward start, and what its step measured."""

    def __init__(self, fields: Dict[str, Any], start_mark: Any) -> None:
        self.fields = fields
        self.start_ns = self.end_ns = perf_counter_ns()
        self.start_mark, self.end_mark = start_mark, None
        self.forward_done = self.step_done = False
        self.collectives: Dict[str, List[Any]] = {}  # op -> [count, host ns, device pairs]
        self.events: Dict[str, Dict[str, Any]] = {}
        self.device_pairs: Dict[str, List[Pair]] = {}
        self.step_pair: Optional[Pair] = None

    def collective(self, op: str, host_ns: int, pair: Optional[Pair]) -> None:
        totals = self.collectives.setdefault(op, [0, 0, []])
        totals[0] += 1
        totals[1] += host_ns
        if pair is not None:
            totals[2].append(pair)

    def complete(self, closing: bool) -> bool:
        """Whether this record holds a whole step: its ``step()`` returned, or its forward ended and no
        ``step()`` was to come -- an eval forward, or a second forward started before one ``step()``.
        At close, a train forward whose ``step()`` never returned was cut short (SIGTERM in its
        backward, an exception): not a whole step."""
        return self.step_done or (self.forward_done and (not closing or self.fields["mode"] == "eval"))

    def pairs(self) -> List[Pair]:
        found = [pair for pairs in self.device_pairs.values() for pair in pairs]
        found += [pair for _, _, pairs in self.collectives.values() for pair in pairs]
        return found + ([self.step_pair] if self.step_pair is not None else [])


class ZeroFetchRecorder:
    """Owns the fetch profiler of an engine's coordinators and its per-rank JSONL file.

    Returned by ``attach``; ``close()`` (also at exit, or leaving a ``with`` block) writes what is
    finished, puts DeepSpeed's profilers back and closes the file.
    """

    def __init__(self, engine: Any, coordinators: Sequence[Any], settings: PartitionedParamProfilerConfig, *,
                 name: str, identity: ProcessIdentity, dtype: torch.dtype,
                 device_events: Optional[DeviceEvents]) -> None:
        self.name = name
        self.settings = settings
        self.path = fetch_records_file(settings.output_dir, identity.rank, name)
        self.device_events = device_events
        element_size = torch.empty((), dtype=dtype).element_size()
        # DeepSpeed's ENABLE_PROFILER hands the engine's timers over; ours only take them as the "on" switch.
        self.profiler = PartitionedParameterProfiler(engine.timers, element_size=element_size,
                                                     device_events=device_events)
        self._header = {
            "schema": RECORD_SCHEMA, "engine": name, "rank": identity.rank, "world_size": identity.world_size,
            "local_rank": identity.local_rank, "host": identity.host, "pid": identity.pid,
            "recording_ranks": settings.ranks, "dtype": str(dtype)[len("torch."):], "clock": "host"
        }  # on the device clock, each record says its own clock
        self._engine = engine
        self._originals = [(coordinator, vars(coordinator)[PROFILER_ATTR]) for coordinator in coordinators]
        self._open: Optional[_Step] = None
        self._waits_at_open = 0
        self._unwritten: Deque[_Step] = deque()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "wb", buffering=0)  # a fresh file per run; one write() per record
        # once: at close, or when collected (without deepspeed.comm's backend there is nothing to undo)
        self._unsubscribe = weakref.finalize(self, collectives.unsubscribe if collectives.subscribe(device_events)
                                             else lambda: None)
        # prepend: our boundary must come before DeepSpeed's reset_step(), which resets and logs counters.
        self._hooks = [
            engine.module.register_forward_pre_hook(self._forward_started, prepend=True),
            engine.module.register_forward_hook(self._forward_ended),
        ]
        original_step = engine.step

        @functools.wraps(original_step)
        def step(*args: Any, **kwargs: Any) -> Any:
            result = original_step(*args, **kwargs)
            self._step_ended()  # not on an exception: that step did not finish
            return result

        engine.step = step
        setattr(engine, RECORDER_ATTR, self)
        self._close_at_exit = _closer(self)
        atexit.register(self._close_at_exit)
        call_before_signal_exit(self._close_at_exit)  # a SIGTERM the profiler re-raises skips atexit

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran: the file is complete and the engine is DeepSpeed's again."""
        return self._file.closed

    # ---- step boundaries (forward hooks and the wrapped engine.step) ------------------------------

    @_never_raises
    def _forward_started(self, module: torch.nn.Module, args: Any) -> None:
        self._finish_open(closing=False)  # an eval forward, or a forward whose step() never came
        self._write_ready()
        engine = self._engine
        if engine.global_steps % self.settings.log_interval:
            self._install(None)  # a step not recorded costs what it costs without ds_profutils
            return
        self.profiler.trace_ranges = self.settings.trace_ranges and ranges_active()
        self.profiler.reset_events()
        self._install(self.profiler)
        fields = {
            "mode": "train" if module.training else "eval",
            "global_step": engine.global_steps,
            "micro_step": engine.micro_steps,
            "time": time.time(),
            "comms_logger": _comms_logger_on(),
        }
        events = self.device_events
        if events is not None:
            collectives.note_compute_stream()
        self._waits_at_open = events.waits if events is not None else 0
        self._open = _Step(fields, events.mark() if events is not None else None)
        collectives.listen(self._open)

    @_never_raises
    def _forward_ended(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        step = self._open
        if step is not None:
            self._mark_end(step)
            step.forward_done = True
            if step.fields["mode"] == "eval":  # no step() follows: what comes next is another engine's or the loop's
                collectives.stop_listening(step)

    @_never_raises
    def _step_ended(self) -> None:
        if self._open is not None and self._open.forward_done:
            self._mark_end(self._open)
            self._open.step_done = True
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
        """Close the open record: take its counters and queue it for writing if it is complete."""
        step, self._open = self._open, None
        if step is None:
            return
        collectives.stop_listening(step)
        if not step.complete(closing):
            if self.device_events is not None:
                self.device_events.release(step.start_mark, step.end_mark)
            return
        step.events = self.profiler.statistics()
        step.device_pairs = {name: counter.device_pairs for name, counter in self.profiler.event_counters.items()
                             if counter.count and counter.device_pairs is not None}
        if self.device_events is not None:
            step.step_pair = self.device_events.pair(step.start_mark, step.end_mark, step.end_ns - step.start_ns)
            # the times this step's events found the pool exhausted and waited on the device
            step.fields["device_waits"] = self.device_events.waits - self._waits_at_open
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
            durations = DurationStats(name)
            for pair in pairs:
                durations.add(_ns(pair))
            host = events[name]
            events[name] = {
                **event_entry(name, host["count"], host["numel"], host["dropped"], durations, _clock(pairs),
                              self.profiler.element_size), "host_time_ms": host["time_ms"]
            }
        record["step_time_ms"] = (_ns(step.step_pair) if step.step_pair else step.end_ns - step.start_ns) / _NS_PER_MS
        record["fetch_wait_ms"] = sum(events[name]["time_ms"] for name in DEVICE_TIMED if name in events)
        record["collectives"] = {
            op: {"count": count, "time_ms": (sum(map(_ns, pairs)) if pairs else host_ns) / _NS_PER_MS,
                 "clock": _clock(pairs) if pairs else "host"}
            for op, (count, host_ns, pairs) in step.collectives.items()
        }
        record["collective_wait_ms"] = sum(entry["time_ms"] for entry in record["collectives"].values())
        record["exposed_wait_ms"] = record["fetch_wait_ms"] + record["collective_wait_ms"]
        if self.device_events is not None:
            record["clock"] = _clock(step.pairs())
        record["events"] = events
        # orjson: a record is built on the step's own time, and the stdlib's encoder was a quarter of it.
        return orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE | orjson.OPT_SERIALIZE_NUMPY)

    def _write(self, line: bytes) -> None:
        try:
            self._file.write(line)
        except OSError as exc:
            warning_once(f"ds_profutils: cannot write ZeRO-3 fetch records to {self.path} ({exc.strerror}); "
                         "training goes on, those steps are not recorded")

    def _install(self, profiler: Optional[PartitionedParameterProfiler]) -> None:
        """Give the coordinators ours, or (None) DeepSpeed's own back."""
        for coordinator, original in self._originals:
            setattr(coordinator, PROFILER_ATTR, original if profiler is None else profiler)

    def close(self) -> None:
        """Write what is finished, give the coordinators DeepSpeed's profilers back, close the file.

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
        """Close the file and give the engine back as DeepSpeed made it."""
        atexit.unregister(self._close_at_exit)
        forget_before_signal_exit(self._close_at_exit)
        self._file.close()
        if self._open is not None:
            collectives.stop_listening(self._open)
        self._unsubscribe()
        self._install(None)
        for hook in self._hooks:
            hook.remove()
        vars(self._engine).pop("step", None)
        vars(self._engine).pop(RECORDER_ATTR, None)

    def _stop_after_error(self, exc: Exception) -> None:
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

    def __enter__(self) -> "ZeroFetchRecorder":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def _ns(pair: Pair) -> float:
    """A pair's device time once known, else the host time measured beside it."""
    return pair.device_ns if pair.resolved else pair.host_ns


def _clock(pairs: List[Pair]) -> str:
    return "device" if all(pair.resolved for pair in pairs) else "host-fallback"


def _comms_logger_on() -> bool:
    from deepspeed.comm import comm

    return bool(getattr(comm.comms_logger, "enabled", False))
