"""A stand-in accelerator whose streams each keep their own clock, which the test moves.

DeepSpeed's CPU accelerator with device timing (``use_host_timers()`` False) and streams: an event
takes the time of the stream it is recorded on, so an event recorded on the wrong stream, or an
interval timed on the host, gives a wrong figure.  Device work is modelled as CUDA runs it:

* work issued on a stream moves that stream's clock (:meth:`StreamClockAccelerator.advance`);
* a blocking collective runs on the stream it is issued on, for its duration;
* an async collective runs on a stream of its own from its launch; waiting for it (its handle, or its
  future, which NCCL completes at launch) makes the waiting stream wait until it ends (the waiting
  stream's clock becomes at least its end).

:func:`simulate_collectives` wraps a ``deepspeed.comm`` backend object so that its collectives take
those durations (the real call still runs, so a real engine trains as usual).  Installed with
``deepspeed.accelerator.set_accelerator`` before ``deepspeed.initialize``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional

from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator


class StandInStream:
    """A stream and its clock (ms of device time done on it)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.clock_ms = 0.0

    def __repr__(self) -> str:
        return f"StandInStream({self.name!r}, {self.clock_ms} ms)"


class StandInEvent:
    """An event that takes the time of the stream it is recorded on."""

    def __init__(self, accelerator: "StreamClockAccelerator", enable_timing: bool = False) -> None:
        self._accelerator = accelerator
        self.time_ms: Optional[float] = None
        self.stream: Optional[StandInStream] = None

    def record(self, stream: Optional[StandInStream] = None) -> None:
        self.stream = stream or self._accelerator.current_stream()
        self.time_ms = self.stream.clock_ms
        self._accelerator.recorded.append(self)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "StandInEvent") -> float:
        return end.time_ms - self.time_ms


class StreamClockAccelerator(CPU_Accelerator):
    """DeepSpeed's CPU accelerator, timing on stand-in device events whose streams keep their own clocks."""

    def __init__(self) -> None:
        super().__init__()
        self.compute = StandInStream("compute")
        self._current = self.compute
        self.recorded: List[StandInEvent] = []

    def use_host_timers(self) -> bool:
        return False

    @property
    def Event(self) -> Callable[..., StandInEvent]:
        return lambda enable_timing=False: StandInEvent(self, enable_timing)

    @property
    def Stream(self) -> Callable[..., StandInStream]:
        return lambda *args, **kwargs: StandInStream(f"stream {len(self.recorded)}")

    def current_stream(self, device_index: Any = None) -> StandInStream:
        return self._current

    def default_stream(self, device_index: Any = None) -> StandInStream:
        return self.compute

    @contextlib.contextmanager
    def stream(self, stream: Optional[StandInStream]) -> Iterator[None]:
        previous = self._current
        if stream is not None:
            self._current = stream
        try:
            yield
        finally:
            self._current = previous

    def advance(self, ms: float, stream: Optional[StandInStream] = None) -> None:
        """``ms`` of device work on ``stream`` (the current stream by default)."""
        (stream or self._current).clock_ms += ms


class SimulatedWork:
    """An async collective's handle: waiting makes the waiting stream wait until the collective ends."""

    def __init__(self, work: Any, accelerator: StreamClockAccelerator, end_ms: float,
                 waited: Callable[[float], None]) -> None:
        self._work, self._accelerator, self._end_ms, self._waited = work, accelerator, end_ms, waited

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs) if self._work is not None else True
        stream = self._accelerator.current_stream()
        before = stream.clock_ms
        stream.clock_ms = max(stream.clock_ms, self._end_ms)
        self._waited(stream.clock_ms - before)
        return result

    def get_future(self) -> "SimulatedFuture":
        return SimulatedFuture(self._accelerator, self._end_ms)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class SimulatedFuture:
    """NCCL's future of an async collective: complete at launch (its events are on the collective's
    stream); waiting makes the current stream wait until the collective ends, and never blocks the host."""

    def __init__(self, accelerator: StreamClockAccelerator, end_ms: float) -> None:
        self._accelerator, self._end_ms = accelerator, end_ms

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        stream = self._accelerator.current_stream()
        stream.clock_ms = max(stream.clock_ms, self._end_ms)


def simulate_collectives(accelerator: StreamClockAccelerator, backend: Any, durations_ms: Dict[str, float],
                         async_position: Dict[str, int], on_async_wait: Callable[[str, float, float], None] = None
                         ) -> None:
    """Make ``backend``'s collectives named in ``durations_ms`` take that much device time (see the module
    doc).  ``on_async_wait(op, inside_ms, stall_ms)`` hears each async collective's wait: the time from its
    launch to where its wait let the waiting stream go on, and how long that stream stalled."""

    def simulated(op: str, method: Callable[..., Any]) -> Callable[..., Any]:
        duration = durations_ms[op]
        position = async_position.get(op)

        def call(*args: Any, **kwargs: Any) -> Any:
            is_async = kwargs.get("async_op", position is not None and len(args) > position and args[position])
            stream = accelerator.current_stream()
            launched = stream.clock_ms
            result = method(*args, **kwargs)
            if not is_async:
                accelerator.advance(duration, stream)
                return result
            end = launched + duration

            def waited(stall: float) -> None:
                if on_async_wait is not None:
                    on_async_wait(op, accelerator.current_stream().clock_ms - launched, stall)

            return SimulatedWork(result, accelerator, end, waited)

        return call

    for op in durations_ms:
        setattr(backend, op, simulated(op, getattr(backend, op)))
