"""Every collective of a recorded step, timed on the stream it runs on, without synchronizing the device.

Which rank the others wait for is seen in the collectives they share: a rank that arrives late spends
the least time inside them, its peers spend that much longer waiting there.  So every call through
``deepspeed.comm``'s backend object (``cdb``, which every ``deepspeed.comm`` collective calls once) is
timed while an engine records, and handed to the :class:`~.step.StepRecord` of the engine whose forward,
backward or step is running (:data:`.hooks.running`; outside every engine's calls, to every engine
recording then):

* a blocking call, from its start to its end on the stream it is issued on: device events recorded on
  that stream around the call where the accelerator times on the device (with NCCL a blocking call
  returns once the stream is made to wait; the events see the wait), else the host clock;
* an ``async_op`` call (ZeRO-3's parameter all-gathers), on the device clock from its launch to its
  own end, however late the program waits: a start event at the launch, and right after it a timing
  stream of ours is made to wait on the work's future and records the end event (the timing stream
  runs nothing else, so the event completes when the collective does).  Only a future already
  complete at launch is waited on there: NCCL's is (its events sit on the NCCL stream, and waiting
  only makes the current stream wait), gloo's is not (waiting would block the host until the
  collective ends); for those, and on the host clock, the time blocked in ``wait()`` (the host cannot
  see when the collective itself ended, and launch-to-wait would count the compute in between).
  ``Work.wait()`` itself is not used on the timing stream: it may give the work's tensors back to the
  allocator (NCCL without record streams) before the program's own stream has waited.

Device intervals are anchored to their step's start, so the record's ``collective_ms`` counts
overlapping collectives (a prefetch beside a reduce-scatter) once on the step's time axis.

The record tells the compute stream (the one its step's forward started on) from side streams
(ZeRO-3's gradient reduce-scatter with ``overlap_comm``): only blocking calls on the compute stream
stall it.  DeepSpeed's comms logger is not built upon: it synchronizes the device after every
collective.  The wrappers are installed while at least one engine is recorded and removed with the
last one.
"""
from __future__ import annotations

from time import perf_counter_ns
from typing import Any, Callable, Dict, List, Optional

from deepspeed.comm import comm  # its backend (``cdb``) and comms logger, read when used: init_distributed sets them

from .._device_clock import DeviceEvents, Pair
from .hangs.sequence import Collective, call_started, collective_ended, collective_resumed, collective_started, \
    tensor_bytes
from .hooks import running
from .step import EngineCollectives
from .torch_collectives import TorchCollectives, handing_on, passes_on

__all__ = ["ALWAYS_BLOCKING", "ASYNC_OP_POSITION", "GROUP_POSITION", "P2P_OPS", "attach_engine", "comms_logger_on"]

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
P2P_OPS = ("send", "recv", "isend", "irecv")
"""DeepSpeed's point-to-point calls (a pipeline's activations and gradients): not timed here (the pipeline's
instruction times have them), only given the pair's next sequence number, so the hang watchdog sees a rank stuck
in a send or receive and lines the pair's two ranks up (``(tensor, peer, group, tag)``: the peer after self)."""
GROUP_POSITION: Dict[str, int] = {**{op: position - 1 for op, position in ASYNC_OP_POSITION.items()},
                                  "inference_all_reduce": 2, "broadcast_object_list": 2, "all_gather_object": 2,
                                  "monitored_barrier": 0}
"""Where each collective takes its ``group`` (after self): just before ``async_op`` in every one that has it."""
_ABSENT = object()


class _TimedWork:
    """The handle of an async collective: its first ``wait()`` hands the collective to the steps recording
    then (its device interval, ``pair``, was made at launch; without one, ``start`` and the waiting
    stream make it).

    Everything else is the handle's own (DeepSpeed wraps handles the same way, e.g. its StagedWork).
    """

    def __init__(self, work: Any, op: str, stream: Any, start: Any, engines: List[EngineCollectives],
                 events: Optional[DeviceEvents], pair: Optional[Pair], collective: Collective) -> None:
        self._work, self._op, self._stream, self._start = work, op, stream, start
        self._engines, self._events, self._pair = engines, events, pair
        self._collective = collective  # its sequence marker: the rank is inside it again while it waits
        self._timed = False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        if self._timed:
            return self._work.wait(*args, **kwargs)
        self._timed = True
        collective_resumed(self._collective)
        began = perf_counter_ns()
        try:
            result = self._work.wait(*args, **kwargs)
        finally:
            ended = collective_ended(self._collective)
        host_ns = ended - began
        events, start = self._events, self._start
        self._start = None
        recording = [engine.step for engine in self._engines if engine.step is not None]
        pair = self._pair
        if pair is not None:  # timed on the device since its launch; never waited, it resolves in the pool
            pair.host_ns = host_ns
        elif events is not None:
            if recording:
                pair = events.pair(start, events.mark(), host_ns)
            else:
                events.release(start)
        for step in recording:
            step.add_collective(self._op, self._stream, True, host_ns, pair)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)

    def __del__(self) -> None:
        if self._start is not None and self._events is not None:  # never waited: its start event goes back
            self._events.release(self._start)


class _Monitor:
    """The wrappers installed on one backend object, and the engines recorded through them."""

    def __init__(self, backend: Any, device_events: Optional[DeviceEvents], accelerator: Any) -> None:
        self.backend = backend
        self.device_events = device_events
        self.accelerator = accelerator  # DeepSpeed's, where the device clock is used
        self.current_stream = accelerator.current_stream if device_events is not None else None
        self._timing_stream: Any = None
        # Each engine's place only (its id and open record, never the engine): a recorder dropped with its engine
        # takes its place out (attach_engine's detach, at close or when the recorder is collected).
        self.engines: List[EngineCollectives] = []
        self._before: Dict[str, Any] = {}  # what the backend instance held under each name wrapped
        self._wrappers: Dict[str, Callable[..., Any]] = {}
        for op in [*ASYNC_OP_POSITION, *ALWAYS_BLOCKING]:
            method = getattr(backend, op, None)
            if method is not None:
                self._before[op] = vars(backend).get(op, _ABSENT)
                self._wrappers[op] = self._timed(op, method, ASYNC_OP_POSITION.get(op))
                setattr(backend, op, self._wrappers[op])
        for op in P2P_OPS:
            method = getattr(backend, op, None)
            if method is not None:
                self._before[op] = vars(backend).get(op, _ABSENT)
                self._wrappers[op] = _p2p_counted(op, method)
                setattr(backend, op, self._wrappers[op])
        self._torch = TorchCollectives(self.torch_call)  # the frameworks' own calls (Trainer, Accelerate)

    def _timed(self, op: str, method: Callable[..., Any], async_position: Optional[int]) -> Callable[..., Any]:
        group_position = GROUP_POSITION[op]

        def counted(*args: Any, **kwargs: Any) -> Any:
            """Every call, recorded or not, takes its group's next sequence number (the hang watchdog's).  One the
            program issues between steps (a loss all-reduce in its loop) is a wait of every engine's gap.  Inline, as
            the rest of this path: each call here costs microseconds inside a step."""
            collective = call_started(op, args, kwargs, group_position)
            between_steps = False
            try:
                handing_on.depth += 1  # first in the try, and lowered first in the finally (torch_collectives)
                # the engines it belongs to: the running one if it records, else (outside every engine's calls)
                # every engine recording; and their records, taken now (a signal handler may close one meanwhile)
                now = running.engine_id
                recording, steps = [], []
                for engine in self.engines:
                    step = engine.step
                    if step is not None and (now is None or engine.engine_id == now):
                        recording.append(engine)
                        steps.append(step)
                if not steps:
                    between_steps = now is None
                    return method(*args, **kwargs)
                is_async = (bool(kwargs["async_op"]) if "async_op" in kwargs else
                            async_position is not None and len(args) > async_position and bool(args[async_position]))
                events = self.device_events
                stream = self.current_stream() if events is not None else None
                start = events.mark() if events is not None else None
                began = perf_counter_ns()
                try:
                    result = method(*args, **kwargs)
                except BaseException:
                    if start is not None:
                        events.release(start)
                    raise
                host_ns = collective_ended(collective) - began  # the marker's end is the call's end
                for step in steps:
                    step.note_sequence(collective.ranks, collective.seq)
                if is_async:
                    return self._handle(result, op, stream, start, recording, steps[0].start_mark, collective)
                pair = events.pair(start, events.mark(), host_ns, steps[0].start_mark) if events is not None else None
                for step in steps:
                    step.add_collective(op, stream, False, host_ns, pair)
                return result
            finally:
                handing_on.depth -= 1
                if collective.ended_ns is None:  # not ended with the timed call's end (raised, or untimed)
                    ended = collective_ended(collective)
                    if between_steps:
                        self.gap_wait(ended - collective.started_ns)

        passes_on(counted, "method")
        return counted

    def _handle(self, work: Any, op: str, stream: Any, start: Any, recording: List[EngineCollectives], anchor: Any,
                collective: Collective) -> Any:
        """An async collective launched in a recorded step: its handle, timed (:class:`_TimedWork`); its device
        interval from ``start`` (the launch) to its end, where the device can tell it without blocking the host."""
        events = self.device_events
        if work is None:  # nothing to wait for: no interval to time
            if start is not None:
                events.release(start)
            return work
        end = self._device_end(work) if events is not None else None
        if end is None:
            return _TimedWork(work, op, stream, start, recording, events, None, collective)
        return _TimedWork(work, op, stream, None, recording, events, events.pair(start, end, 0, anchor), collective)

    def _device_end(self, work: Any) -> Any:
        """An end event for an async collective, recorded on our timing stream made to wait on ``work``'s
        future; None where that would block the host (a future not complete at launch) or the work has
        no future."""
        try:
            future = work.get_future()
        except (AttributeError, RuntimeError, NotImplementedError):
            return None
        if not future.done():
            return None
        accelerator = self.accelerator
        if self._timing_stream is None:
            make_stream = accelerator.Stream  # a property in DeepSpeed: the stream class, None without streams
            if make_stream is None:
                return None
            self._timing_stream = make_stream()
        with accelerator.stream(self._timing_stream):
            future.wait()
            return self.device_events.mark()

    def gap_wait(self, host_ns: int) -> None:
        """A collective between steps (outside every engine's calls, no record open) took ``host_ns``."""
        for engine in self.engines:
            engine.gap_collective_ns += host_ns

    def torch_call(self, op: str, host_ns: int) -> None:
        """A ``torch.distributed`` call of the program's (or a framework's) took ``host_ns``: inside an engine's
        forward, backward or step it is that step's collective; between steps, a wait of every engine's gap."""
        now = running.engine_id
        if now is None:
            self.gap_wait(host_ns)
            return
        stream = self.current_stream() if self.current_stream is not None else None
        for engine in self.engines:
            if engine.engine_id == now and engine.step is not None:
                engine.step.add_collective(op, stream, False, host_ns, None)

    def remove(self) -> None:
        """Give the backend back as it was: a wrapper put there before ours stays; ours, if wrapped since by
        someone else, stays in the chain (it times nothing once no engine is recorded)."""
        self._torch.remove()
        attributes = vars(self.backend)
        for op, wrapper in self._wrappers.items():
            if attributes.get(op) is not wrapper:
                continue
            if self._before[op] is _ABSENT:
                del attributes[op]
            else:
                attributes[op] = self._before[op]


def _p2p_counted(op: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (a send or receive) marked on the pair's sequence (:data:`P2P_OPS`); a receive from any peer
    (``src`` None) has no pair and is passed through."""
    import torch.distributed as dist

    peer_key = "dst" if op in ("send", "isend") else "src"
    rank = dist.get_rank()  # wrapped once the process group is up

    def counted(*args: Any, **kwargs: Any) -> Any:
        peer = args[1] if len(args) > 1 else kwargs.get(peer_key)
        if peer is None:
            return method(*args, **kwargs)
        peer = int(peer)
        collective = collective_started(op, (rank, peer) if rank < peer else (peer, rank), tensor_bytes(args, kwargs))
        try:
            handing_on.depth += 1
            return method(*args, **kwargs)
        finally:
            handing_on.depth -= 1
            collective_ended(collective)

    passes_on(counted, "method")
    return counted


_monitor: Optional[_Monitor] = None


def attach_engine(engine: EngineCollectives, device_events: Optional[DeviceEvents]) -> Callable[[], None]:
    """Time the collectives of ``engine``'s recorded steps from now on; return the call that stops it.

    The first engine attached installs the wrappers on ``deepspeed.comm``'s backend; the call returned
    by the last one removes them.  Without a backend (``init_distributed`` not called) nothing is timed.
    """
    global _monitor
    backend = comm.cdb
    if backend is None:
        return lambda: None
    if _monitor is None or _monitor.backend is not backend:
        from deepspeed.accelerator import get_accelerator

        _monitor = _Monitor(backend, device_events, get_accelerator())
    monitor = _monitor
    monitor.engines.append(engine)

    def detach() -> None:
        global _monitor
        if engine not in monitor.engines:
            return
        monitor.engines.remove(engine)
        if not monitor.engines:
            monitor.remove()
            if _monitor is monitor:
                _monitor = None

    return detach


def comms_logger_on() -> bool:
    """Whether DeepSpeed's own comms logger records now (each step's record says so: it synchronizes the
    device after every collective, which lengthens the step)."""
    return bool(getattr(comm.comms_logger, "enabled", False))
