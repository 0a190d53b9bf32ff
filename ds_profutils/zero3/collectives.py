"""Time a rank spends blocked in the engine's collectives, without synchronizing the device per op.

The rank the others wait for is found by what the others do while waiting: a rank that arrives late
at a gradient reduce-scatter or all-reduce costs its peers that time inside the call.  So every call
through ``deepspeed.comm`` made without ``async_op`` (and the collectives that are always blocking)
is timed while a record is open, on the record's clock: the host clock, or a pair of device events
on the current stream where the accelerator has device timers (on NCCL a blocking call returns once
the stream is made to wait; the events see the stall) -- unless the call comes from a side stream
(:data:`SIDE_STREAM_SUFFIX`).  Calls with ``async_op=True`` overlap compute
(ZeRO-3's parameter all-gathers) and are not waiting; their waits are the fetch waits.

DeepSpeed's comms logger is not built upon: it synchronizes the device after every collective.

The timing wraps the methods of ``deepspeed.comm``'s backend object (``cdb``), which every
``deepspeed.comm`` collective calls once.  It is installed while at least one recorder listens and
removed with the last one.
"""
from __future__ import annotations

from time import perf_counter_ns
from typing import Any, Callable, Dict, List, Optional, Protocol

from .device_clock import DeviceEvents, Pair

__all__ = [
    "ALWAYS_BLOCKING", "ASYNC_OP_POSITION", "CollectiveListener", "SIDE_STREAM_SUFFIX", "listen",
    "note_compute_stream", "stop_listening", "subscribe", "unsubscribe"
]

ASYNC_OP_POSITION: Dict[str, int] = {
    "all_reduce": 3,
    "all_reduce_coalesced": 3,
    "reduce": 4,
    "reduce_scatter": 4,
    "reduce_scatter_tensor": 4,
    "broadcast": 3,
    "all_gather": 3,
    "all_gather_into_tensor": 3,
    "all_gather_base": 3,
    "all_gather_coalesced": 3,
    "all_to_all_single": 5,
    "all_to_all": 3,
    "gather": 4,
    "scatter": 4,
    "barrier": 1,
}
"""Collectives of DeepSpeed 0.19's ``TorchBackend`` that take ``async_op``, and its position (after self)."""
ALWAYS_BLOCKING = ("inference_all_reduce", "broadcast_object_list", "all_gather_object", "monitored_barrier")
"""Collectives without ``async_op``: every call blocks."""


class CollectiveListener(Protocol):
    """A record that is open: it is told about every blocking collective."""

    def collective(self, op: str, host_ns: int, pair: Optional[Pair]) -> None:
        ...


class _Monitor:
    """The wrappers installed on one backend object, and who listens to them."""

    def __init__(self, backend: Any, device_events: Optional[DeviceEvents]) -> None:
        self.backend = backend
        self.device_events = device_events
        self.listeners: List[CollectiveListener] = []
        self.subscribers = 0
        for op in [*ASYNC_OP_POSITION, *ALWAYS_BLOCKING]:
            method = getattr(backend, op, None)
            if method is not None:
                setattr(backend, op, self._timed(op, method, ASYNC_OP_POSITION.get(op)))

    def _timed(self, op: str, method: Callable[..., Any], async_position: Optional[int]) -> Callable[..., Any]:

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.listeners or _is_async(args, kwargs, async_position):
                return method(*args, **kwargs)
            events, name = self.device_events, op
            if events is not None and _on_side_stream():
                events, name = None, op + SIDE_STREAM_SUFFIX
            start = events.mark() if events is not None else None
            began = perf_counter_ns()
            try:
                return method(*args, **kwargs)
            finally:
                host_ns = perf_counter_ns() - began
                pair = events.pair(start, events.mark(), host_ns) if events is not None else None
                for listener in self.listeners:
                    listener.collective(name, host_ns, pair)

        return timed

    def remove(self) -> None:
        for op in [*ASYNC_OP_POSITION, *ALWAYS_BLOCKING]:
            vars(self.backend).pop(op, None)


SIDE_STREAM_SUFFIX = "@side-stream"
"""Appended to a collective called on the device clock's accelerator from a stream other than the
one the step's forward started on: ZeRO-3's gradient reduce-scatter with ``overlap_comm`` runs in
``with get_accelerator().stream(reduce_and_partition_stream)``.  Events there would time the collective
on that stream, not a stall of the compute stream, so such calls are timed on the host (on NCCL,
about the launch) and kept apart in the record."""


_compute_stream: Any = None


def note_compute_stream() -> None:
    """A forward starts on the device clock: the stream it runs on is the compute stream (usually the
    default one; a job may run its steps in a stream of its own)."""
    global _compute_stream
    from deepspeed.accelerator import get_accelerator

    _compute_stream = get_accelerator().current_stream()


def _on_side_stream() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().current_stream() != _compute_stream


def _is_async(args: tuple, kwargs: Dict[str, Any], position: Optional[int]) -> bool:
    if "async_op" in kwargs:
        return bool(kwargs["async_op"])
    return position is not None and len(args) > position and bool(args[position])


_monitor: Optional[_Monitor] = None


def _backend() -> Any:
    from deepspeed.comm import comm

    return comm.cdb


def subscribe(device_events: Optional[DeviceEvents]) -> bool:
    """A recorder will listen from now on; install the wrappers if none are.  False without a backend."""
    global _monitor
    backend = _backend()
    if backend is None:
        return False
    if _monitor is None or _monitor.backend is not backend:
        _monitor = _Monitor(backend, device_events)
    _monitor.subscribers += 1
    return True


def unsubscribe() -> None:
    """A recorder closed; the last one out removes the wrappers."""
    global _monitor
    if _monitor is None:
        return
    _monitor.subscribers -= 1
    if _monitor.subscribers <= 0:
        _monitor.remove()
        _monitor = None


def listen(listener: CollectiveListener) -> None:
    """``listener``'s record is open: add the blocking collectives to it."""
    if _monitor is not None and listener not in _monitor.listeners:
        _monitor.listeners.append(listener)


def stop_listening(listener: CollectiveListener) -> None:
    """``listener``'s record is closed."""
    if _monitor is not None and listener in _monitor.listeners:
        _monitor.listeners.remove(listener)
