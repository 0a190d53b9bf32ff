"""Intervals on the device clock, read without ever synchronizing the device on the hot path.

One pool per process serves the ZeRO-3 fetch profiler (:mod:`ds_profutils.zero3`) and the engine's
step records and collectives (:mod:`ds_profutils.engine`), so it lives below both.

With NCCL, ``Work.wait()`` returns once the compute stream has been told to wait for the all-gather,
so a fetch wait timed on the host holds only the launch.  The stall the compute stream really sees is
between two events recorded on it.  Where ``get_accelerator().use_host_timers()`` is False (how
DeepSpeed's own timers decide), the recorder times its waits and steps here.

An interval is a :class:`Pair` of events from a bounded pool.  Its device time is read once
``query()`` says the end event completed; events on one stream complete in order, so pairs are
resolved oldest first.  When every event of the pool is in use, the oldest pair is waited for (as
DeepSpeed's coordinator waits for its oldest fetch event) and that is counted in ``waits``.  A device
that may be hung is never waited on at close: :meth:`DeviceEvents.settle` polls until a deadline and
leaves the rest to the host time each pair also carries.
"""
from __future__ import annotations

import functools
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional

__all__ = ["DeviceEvents", "Pair", "current_stream_recorder", "pair_ns", "pairs_clock", "process_device_events"]

_NS_PER_MS = 1e6


class Pair:
    """One interval: its start and end events, the host time measured beside them, and (once known)
    the device time.

    With an ``anchor`` (an event recorded earlier, e.g. its step's start) the pair also learns where it
    starts after the anchor (``offset_ns``): intervals of one anchor share a time axis, so overlapping
    ones can be counted once.  The anchor must stay recorded until the pair resolves (a step's start is
    given back only with its step's pair, which is registered after every pair of its step)."""

    __slots__ = ("start", "end", "host_ns", "device_ns", "anchor", "offset_ns")

    def __init__(self, start: Any, end: Any, host_ns: int, anchor: Any = None) -> None:
        self.start, self.end, self.host_ns, self.anchor = start, end, host_ns, anchor
        self.device_ns: Optional[float] = None
        self.offset_ns: Optional[float] = None

    @property
    def resolved(self) -> bool:
        return self.device_ns is not None


def pair_ns(pair: Pair) -> float:
    """A pair's device time once known, else the host time measured beside it."""
    return pair.device_ns if pair.resolved else pair.host_ns


def pairs_clock(pairs: List[Pair]) -> str:
    """``"device"`` when every pair's device time is known, else ``"host-fallback"``."""
    return "device" if all(pair.resolved for pair in pairs) else "host-fallback"


class DeviceEvents:
    """A bounded pool of timing events and the pairs recorded with them, resolved oldest first.

    DeepSpeed runs leaf-module backward hooks on several threads, so the pool is guarded by a lock
    (taken for a few list operations around an event record, which costs microseconds itself).  The
    lock is reentrant: a signal handler runs on the main thread between two bytecodes, possibly while
    that thread is inside the pool, and may close a recorder (which polls the pool); a plain lock
    would deadlock there.  Every step under the lock leaves the pool consistent, so a reentrant call
    sees a whole pool.
    """

    def __init__(self, event_class: Callable[..., Any], capacity: int = 4096) -> None:
        self._event_class = event_class
        self._record = current_stream_recorder(event_class)
        self._capacity = capacity
        self._free: List[Any] = []
        self._made = 0
        self._in_flight: Deque[Pair] = deque()
        self._lock = threading.RLock()
        self.waits = 0  # times the pool was exhausted and the oldest pair was waited for

    def mark(self) -> Any:
        """Record an event on the current stream (the start or end of an interval)."""
        with self._lock:
            if not self._free and self._made >= self._capacity and self._in_flight:
                self._resolve_completed()  # the oldest pairs may have completed: no wait then
                if not self._free:
                    self.waits += 1
                    self._in_flight[0].end.synchronize()
                    self._resolve_completed()
            if self._free:
                event = self._free.pop()
            else:
                event = self._event_class(enable_timing=True)
                self._made += 1
        self._record(event)
        return event

    def release(self, *events: Any) -> None:
        """Give back marked events that will not be paired (a step that did not finish, a replaced mark)."""
        with self._lock:
            self._free += [event for event in events if event is not None]

    def pair(self, start: Any, end: Any, host_ns: int, anchor: Any = None) -> Pair:
        """Register the interval between two marked events; its device time comes later."""
        pair = Pair(start, end, host_ns, anchor)
        with self._lock:
            self._in_flight.append(pair)
        return pair

    def poll(self) -> bool:
        """Resolve every pair whose end has completed, oldest first; True when none is left."""
        with self._lock:
            return self._resolve_completed()

    def _resolve_completed(self) -> bool:
        in_flight = self._in_flight
        while in_flight and in_flight[0].end.query():
            pair = in_flight.popleft()
            pair.device_ns = pair.start.elapsed_time(pair.end) * _NS_PER_MS
            anchor = pair.anchor
            if anchor is not None and anchor.query():  # given back and recorded again: no longer an anchor
                pair.offset_ns = anchor.elapsed_time(pair.start) * _NS_PER_MS
            self._free += (pair.start, pair.end)
        return not in_flight

    def settle(self, seconds: float) -> bool:
        """Poll until every pair is resolved or ``seconds`` pass; never block on the device."""
        deadline = time.monotonic() + seconds
        while not self.poll():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
        return True


def _record(event: Any) -> None:
    event.record()


@functools.lru_cache(maxsize=None)  # one per event class: its streams' objects kept once for the process
def current_stream_recorder(event_class: Callable[..., Any]) -> Callable[[Any], None]:
    """How an event of ``event_class`` is recorded on the current stream: ``event.record()``, except for
    ``torch.cuda.Event``.

    ``torch.cuda.Event.record()`` asks ``torch.cuda.current_stream()``, which finds the device in Python
    (``is_available()``, the environment) and makes a new ``Stream`` object: several times the cost of the
    record itself, and a ZeRO-3 step marks about five events per layer.  There the current stream is asked
    of torch's binding for the current device, and one ``Stream`` object is kept per stream.
    """
    import torch

    cuda = torch._C
    names = ("_cuda_getCurrentStream", "_cuda_getDevice", "_CudaEventBase")
    if event_class is not getattr(torch.cuda, "Event", None) or not all(hasattr(cuda, name) for name in names):
        return _record
    current, device, record_on = cuda._cuda_getCurrentStream, cuda._cuda_getDevice, cuda._CudaEventBase.record
    streams: Dict[tuple, Any] = {}

    def record(event: Any) -> None:
        key = current(device())
        stream = streams.get(key)
        if stream is None:
            stream = streams[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        record_on(event, stream)

    return record


_process_pool: Optional[DeviceEvents] = None
_pool_accelerator: Any = None


def process_device_events(accelerator: Any) -> Optional[DeviceEvents]:
    """The process's event pool where ``accelerator`` times on the device, as DeepSpeed's timers decide
    (``use_host_timers()`` False); None where the host clock is the clock."""
    global _process_pool, _pool_accelerator
    if accelerator.use_host_timers():
        return None
    if _process_pool is None or _pool_accelerator is not accelerator:
        _process_pool, _pool_accelerator = DeviceEvents(accelerator.Event), accelerator
    return _process_pool
