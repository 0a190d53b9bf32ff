"""The device-event timer of ``ds_profutils.timer``, used where DeepSpeed's timers use device events.

Events are recorded on the current stream at ``start()``/``stop()`` and resolved only when a time is
read (or, to bound memory, once ``FOLD_EVERY`` pairs are pending), so timing never synchronizes the
device on every stop.  A resolved pair's events are recorded again by later intervals: making and
destroying a CUDA event costs more than recording it, and the engine reads its timers every step.
"""
from __future__ import annotations

from typing import Any, List

from .._device_clock import current_stream_recorder
from .._stats import FOLD_EVERY
from .host import NS_PER_MS, _Timer

__all__: List[str] = []


class _EventTimer(_Timer):
    """A timer on device events recorded on the current stream, resolved when a time is read.

    As DeepSpeed's device timers, ``start_time`` and ``end_time`` stay 0.0.
    """

    def __init__(self, name: str, event_class: Any) -> None:
        super().__init__(name)
        self._event_class = event_class  # the accelerator's Event, found once by the group
        self._record = current_stream_recorder(event_class)
        self._pairs: List[Any] = []  # (start, end) events not resolved yet
        self._free: List[Any] = []  # events of resolved pairs, recorded again before new ones are made

    @property
    def use_host_timer(self) -> bool:
        """False: this timer runs on device events."""
        return False

    @property
    def start_time(self) -> float:
        """0.0: device timers keep no host time (DeepSpeed's neither)."""
        return 0.0

    @property
    def start_event(self) -> Any:
        """The running interval's start event; None while none runs."""
        return self._start

    def start(self) -> None:
        """Record a start event."""
        if self._start is not None:
            raise self._already_started()
        event = self._free.pop() if self._free else self._event_class(enable_timing=True)
        self._record(event)
        self._start = event

    def stop(self, reset: bool = False, record: bool = False) -> None:
        """Record an end event.  ``reset`` and ``record`` are accepted and ignored, as in DeepSpeed."""
        start = self._start
        if start is None:
            raise self._not_started()
        end = self._free.pop() if self._free else self._event_class(enable_timing=True)
        self._record(end)
        self._start = None
        self._pairs.append((start, end))
        if len(self._pairs) >= FOLD_EVERY:
            self._fold(everything=False)

    def _fold(self, everything: bool = True) -> None:
        """Move resolved event pairs into the statistics, oldest first.

        ``everything`` (a time is being read): every pending pair, waiting on the newest end event
        only, since events recorded on one stream complete in order.  Otherwise (the buffer is full):
        the pairs the device has finished; if even the oldest is unfinished, wait for that one only.
        """
        pairs = self._pairs
        if pairs:
            if everything:
                pairs[-1][1].synchronize()
                done = len(pairs)
            else:
                done = 0
                while done < len(pairs) and pairs[done][1].query():
                    done += 1
                if done == 0:
                    pairs[0][1].synchronize()
                    done = 1
            free = self._free
            for start, end in pairs[:done]:
                self._durations.add(_elapsed_ns(start, end))
                free += (start, end)
            del pairs[:done]
        self._durations.fold()

    def elapsed(self, reset: bool = True) -> float:
        """As the host timer's, the event pairs recorded so far resolved first."""
        if self._start is None:  # (a running timer's read stops it first, then comes back here)
            self._fold()
        return super().elapsed(reset)

    def reset(self) -> None:
        """Forget all measurements and any interval in progress."""
        super().reset()
        self._pairs.clear()


def _elapsed_ns(start: Any, end: Any) -> float:
    """Nanoseconds between two recorded events."""
    try:
        elapsed_ms = start.elapsed_time(end)
    except RuntimeError:
        # An event recorded on another stream, not finished yet (the device reports "not ready"):
        # waiting on the newest event of the current stream does not cover it, so wait for this pair.
        start.synchronize()
        end.synchronize()
        elapsed_ms = start.elapsed_time(end)
    return elapsed_ms * NS_PER_MS
