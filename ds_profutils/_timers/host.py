"""The host timer of ``ds_profutils.timer``: one named interval timer on the monotonic clock.

Host time comes from ``time.perf_counter_ns()``: monotonic, integer nanoseconds, so an NTP step cannot
produce a negative duration and sums do not lose precision; ``start_time``/``end_time`` still read as
epoch seconds, as DeepSpeed's ``time.time()`` values.  The clock and the epoch offset live here, one
module-level name each, so a test substitutes a scripted clock for every timer at once.
"""
from __future__ import annotations

import time
from typing import Any, List, Optional, Sequence

from .._stats import FOLD_EVERY, DurationStats
from ..exceptions import InvalidArgumentError

__all__ = ["NS_PER_MS", "NS_PER_S", "epoch_seconds"]

NS_PER_MS = 1_000_000
NS_PER_S = 1_000_000_000

_clock_ns = time.perf_counter_ns
# Turns a _clock_ns() stamp into epoch seconds, DeepSpeed's time.time() unit for start_time/end_time.
_EPOCH_OFFSET_NS = time.time_ns() - time.perf_counter_ns()


def epoch_seconds(stamp_ns: int) -> float:
    """A ``_clock_ns()`` stamp as epoch seconds."""
    return (stamp_ns + _EPOCH_OFFSET_NS) / NS_PER_S


class _Timer:
    """One named timer on the host's monotonic clock: ``start()``/``stop()``, read in ms with
    ``elapsed()`` and ``mean()``.  ``stop()`` is one list append (:class:`DurationStats`).

    A group makes its timers with ``ds_profutils.timer._new_timer``: this class where DeepSpeed's timers
    use the host clock (``use_host_timers()``), else an :class:`~.events._EventTimer` on device events.
    """

    def __init__(self, name: str) -> None:
        self.name_ = name
        # One attribute store per start() and per stop() (the hot path): the running interval's start
        # stamp (an event on device timers), None while none runs; the last stop's stamp.  The last
        # interval's start is that stop less its duration, the last duration kept (``_last_ns``).
        self._start: Any = None
        self._end: Optional[int] = None
        self._last_ns = 0
        self._abandoned: Any = None  # the start of the last interval abandoned (reset or started_ = False)
        self._durations = DurationStats(name)
        self._pending = self._durations.pending  # the same list for the timer's life
        self._read_count: Optional[int] = None  # durations there were when a time was last read; None: unread

    @property
    def use_host_timer(self) -> bool:
        """Whether this timer runs on the host clock (fixed when it is made, as DeepSpeed's)."""
        return True

    @property
    def started_(self) -> bool:
        """Whether an interval is running (DeepSpeed's attribute).

        Assigning ``True`` starts an interval now unless one runs; assigning ``False`` abandons the
        running interval without recording it, so the next ``start()`` is accepted.
        """
        return self._start is not None

    @started_.setter
    def started_(self, value: bool) -> None:
        if value and self._start is None:
            self.start()
        elif not value:
            self._abandon()

    def _abandon(self) -> None:
        """Drop the running interval, if any, without recording it."""
        if self._start is not None:
            self._abandoned, self._start = self._start, None

    @property
    def start_time(self) -> float:
        """Epoch seconds of the last ``start()`` (0.0 before any), as DeepSpeed's host timers keep it.

        The running interval's start; else the later of the last abandoned start and the last recorded
        interval's start (its stop less its duration).
        """
        start = self._start
        if start is None:
            start = self._abandoned
            if self._end is not None and (start is None or self._end >= start):
                start = self._end - (self._pending[-1] if self._pending else self._last_ns)
        return 0.0 if start is None else epoch_seconds(start)

    @property
    def end_time(self) -> float:
        """Epoch seconds of the last ``stop()`` (0.0 before any), as DeepSpeed's host timers keep it."""
        return 0.0 if self._end is None else epoch_seconds(self._end)

    @property
    def start_event(self) -> Any:
        """The running interval's start event on device timers; None on host timers, as DeepSpeed's."""
        return None

    @property
    def event_timers(self) -> List[float]:
        """The durations in seconds (DeepSpeed's host-timer entries) kept since the last reset.

        Every one while at most ``SAMPLE_SIZE`` were recorded, a uniform random sample of them beyond.
        A new list on each read (DeepSpeed's is the timer's own): call ``reset()`` to forget them.
        """
        self._fold()
        return [duration / NS_PER_S for duration in self._durations.sample]

    @property
    def elapsed_records(self) -> Optional[List[float]]:
        """The durations in ms that the last ``elapsed()``/``mean()`` read; None until one has since a reset."""
        if self._read_count is None:
            return None
        return [duration / NS_PER_MS for duration in self._durations.sample[:self._read_count]]

    def _already_started(self) -> InvalidArgumentError:
        return InvalidArgumentError(f"timer {self.name_!r} has already been started; stop() it (or reset() it) "
                                    f"before start() again")

    def _not_started(self) -> InvalidArgumentError:
        return InvalidArgumentError(f"timer {self.name_!r} is not started; call start() before stop()")

    def start(self) -> None:
        """Start an interval."""
        if self._start is not None:
            raise self._already_started()
        self._start = _clock_ns()

    def stop(self, reset: bool = False, record: bool = False) -> None:
        """End the interval.  ``reset`` and ``record`` are accepted and ignored, as in DeepSpeed."""
        now = _clock_ns()
        start = self._start
        if start is None:
            raise self._not_started()
        self._start = None
        self._end = now
        pending = self._pending
        pending.append(now - start)
        if len(pending) >= FOLD_EVERY:
            self._fold()

    def _keep_last(self) -> None:
        """Remember the last duration (``start_time`` needs it) before the pending ones are folded away."""
        if self._pending:
            self._last_ns = self._pending[-1]

    def _fold(self) -> None:
        """Bring the statistics up to date before a time is read."""
        self._keep_last()
        self._durations.fold()

    def add_durations(self, durations_ns: Sequence[float]) -> None:
        """Count intervals measured elsewhere on this timer's clock (the ZeRO-3 fetch profiler's, in batches)."""
        self._pending.extend(durations_ns)
        if len(self._pending) >= FOLD_EVERY:
            self._durations.fold()

    def reset(self) -> None:
        """Forget all measurements and any interval in progress (``start_time``/``end_time`` stay)."""
        self._keep_last()
        self._abandon()
        self._read_count = None
        self._durations.reset()

    def elapsed(self, reset: bool = True) -> float:
        """Total milliseconds since the last reset.

        A running interval is cut at this point and counted, and timing continues from here, as in
        DeepSpeed (so reading a running timer adds one more duration to ``mean()``).

        The engine reads each of its timers twice a step (``elapsed(reset=False)``, then ``log()``'s
        ``elapsed(reset=True)``), so a read holding a few durations is a sum of the pending ones, left
        pending: nothing is folded into the statistics (and freed again at the reset) for a read.
        """
        if self._start is not None:
            return self._elapsed_running(reset)
        pending = self._pending
        if pending:
            self._last_ns = pending[-1]  # start_time's (_keep_last), before the total may fold them away
        durations = self._durations
        total_ms = durations.total / NS_PER_MS
        if reset:  # reset() of a timer not running, its last duration kept (written out: ten a step)
            self._read_count = None
            durations.reset()
        else:
            self._read_count = durations.count
        return total_ms

    def _elapsed_running(self, reset: bool) -> float:
        """``elapsed()`` of a running timer: its interval cut here and counted, a new one started."""
        self.stop()
        total_ms = self.elapsed(reset)
        self.start()
        return total_ms

    def mean(self) -> float:
        """Trimmed mean (10% off each end) of the durations since the last reset, in ms; 0 if none."""
        self.elapsed(reset=False)
        return self._durations.trimmed_mean() / NS_PER_MS
