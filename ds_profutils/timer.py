"""Wall-clock timers with the API of ``deepspeed.utils.timer``, in constant memory.

The timer group and its timers have DeepSpeed's attributes, with DeepSpeed's types and meaning where
a user can observe them (``timers``, ``name_``, ``started_``, ``start_time``, ...).  What differs, and
why (``docs/deepspeed_differences.md`` lists each difference):

* Host time comes from ``time.perf_counter_ns()``: monotonic, integer nanoseconds, so an NTP step
  cannot produce a negative duration and sums do not lose precision.  ``start_time``/``end_time``
  still read as epoch seconds, as DeepSpeed's.
* A timer keeps :class:`DurationStats` (exact count, total, min and max, and a bounded random sample
  of durations), not one record per start/stop, so memory stays bounded however long a run goes
  between ``log()`` calls.  ``elapsed()`` is exact; ``mean()``, ``event_timers`` and
  ``elapsed_records`` equal DeepSpeed's while at most ``SAMPLE_SIZE`` durations were recorded since
  the last reset (more than an autotuning run records), and beyond come from the sample.
* Where DeepSpeed's timers use device events (``use_host_timers()`` is False), so do ours; the events
  are resolved only when a time is read (or, to bound memory, once ``FOLD_EVERY`` pairs are pending),
  so timing never synchronizes the device on every stop.
* Misuse (stop without start, start twice, a normalizer <= 0) raises ``InvalidArgumentError`` instead
  of an ``assert`` that vanishes under ``python -O``.
"""
from __future__ import annotations

import numbers
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence

from deepspeed.accelerator import get_accelerator
# DeepSpeed's own objects, for code that imports them from here; none holds any state to share.
# (Free: importing any deepspeed submodule runs deepspeed/__init__.py, which loads deepspeed.utils.timer.)
from deepspeed.utils.timer import PSUTILS_INSTALLED, CudaEventTimer, NoopTimer

from ._stats import FOLD_EVERY, DurationStats, trim_mean
from .exceptions import InvalidArgumentError
from .logging import logger, print_dist

__all__ = [
    "BACKWARD_GLOBAL_TIMER", "BACKWARD_INNER_GLOBAL_TIMER", "BACKWARD_INNER_MICRO_TIMER", "BACKWARD_MICRO_TIMER",
    "BACKWARD_REDUCE_GLOBAL_TIMER", "BACKWARD_REDUCE_MICRO_TIMER", "FORWARD_GLOBAL_TIMER", "FORWARD_MICRO_TIMER",
    "STEP_GLOBAL_TIMER", "STEP_MICRO_TIMER", "TIME_EPSILON", "PSUTILS_INSTALLED", "CudaEventTimer", "NoopTimer",
    "SynchronizedWallClockTimer", "ThroughputTimer", "trim_mean"
]

# Timer names the DeepSpeed engine uses; the flops profiler and pipeline engine import them from here.
FORWARD_MICRO_TIMER = "fwd_microstep"
FORWARD_GLOBAL_TIMER = "fwd"
BACKWARD_MICRO_TIMER = "bwd_microstep"
BACKWARD_GLOBAL_TIMER = "bwd"
BACKWARD_INNER_MICRO_TIMER = "bwd_inner_microstep"
BACKWARD_INNER_GLOBAL_TIMER = "bwd_inner"
BACKWARD_REDUCE_MICRO_TIMER = "bwd_allreduce_microstep"
BACKWARD_REDUCE_GLOBAL_TIMER = "bwd_allreduce"
STEP_MICRO_TIMER = "step_microstep"
STEP_GLOBAL_TIMER = "step"
TIME_EPSILON = 1e-6

_NS_PER_MS = 1_000_000
_NS_PER_S = 1_000_000_000
_BYTES_PER_GB = 1024**3

# Module-level so tests can substitute a scripted clock.
_clock_ns = time.perf_counter_ns
# Turns a _clock_ns() stamp into epoch seconds, DeepSpeed's time.time() unit for start_time/end_time.
_EPOCH_OFFSET_NS = time.time_ns() - time.perf_counter_ns()


def _epoch_seconds(stamp_ns: int) -> float:
    return (stamp_ns + _EPOCH_OFFSET_NS) / _NS_PER_S


def _check_normalizer(function: str, normalizer: float) -> None:
    if not normalizer > 0.0:
        raise InvalidArgumentError(f"{function}: normalizer must be > 0, got {normalizer!r}")


class _Timer:
    """One named timer on the host's monotonic clock: ``start()``/``stop()``, read in ms with
    ``elapsed()`` and ``mean()``.  ``stop()`` is one list append (:class:`DurationStats`).

    A group makes its timers with :func:`_new_timer`: this class where DeepSpeed's timers use the host
    clock (``use_host_timers()``), else an :class:`_EventTimer` on device events.
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
        return 0.0 if start is None else _epoch_seconds(start)

    @property
    def end_time(self) -> float:
        """Epoch seconds of the last ``stop()`` (0.0 before any), as DeepSpeed's host timers keep it."""
        return 0.0 if self._end is None else _epoch_seconds(self._end)

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
        return [duration / _NS_PER_S for duration in self._durations.sample]

    @property
    def elapsed_records(self) -> Optional[List[float]]:
        """The durations in ms that the last ``elapsed()``/``mean()`` read; None until one has since a reset."""
        if self._read_count is None:
            return None
        return [duration / _NS_PER_MS for duration in self._durations.sample[:self._read_count]]

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
        """
        running = self._start is not None
        if running:
            self.stop()
        self._fold()
        total_ms = self._durations.total / _NS_PER_MS
        if reset:
            self.reset()
        else:
            self._read_count = self._durations.count
        if running:
            self.start()
        return total_ms

    def mean(self) -> float:
        """Trimmed mean (10% off each end) of the durations since the last reset, in ms; 0 if none."""
        self.elapsed(reset=False)
        return self._durations.trimmed_mean() / _NS_PER_MS


class _EventTimer(_Timer):
    """A timer on device events recorded on the current stream, resolved when a time is read.

    As DeepSpeed's device timers, ``start_time`` and ``end_time`` stay 0.0.
    """

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._event_class = get_accelerator().Event
        self._pairs: List[Any] = []  # (start, end) events not resolved yet

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
        event = self._event_class(enable_timing=True)
        event.record()
        self._start = event

    def stop(self, reset: bool = False, record: bool = False) -> None:
        """Record an end event.  ``reset`` and ``record`` are accepted and ignored, as in DeepSpeed."""
        start = self._start
        if start is None:
            raise self._not_started()
        end = self._event_class(enable_timing=True)
        end.record()
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
            for start, end in pairs[:done]:
                self._durations.add(_elapsed_ns(start, end))
            del pairs[:done]
        self._durations.fold()

    def reset(self) -> None:
        """Forget all measurements and any interval in progress."""
        super().reset()
        self._pairs.clear()


def _new_timer(name: str) -> _Timer:
    """A timer on the clock DeepSpeed's timers would use on the current accelerator."""
    return (_Timer if get_accelerator().use_host_timers() else _EventTimer)(name)


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
    return elapsed_ms * _NS_PER_MS


class SynchronizedWallClockTimer:
    """A group of named timers, created on first use: ``timers("fwd").start()``.

    A plain object, as DeepSpeed's: ``timers`` is the dict of its timers by name; the group itself is
    no mapping (no ``len()``, no iteration), truthy, hashable and equal only to itself.
    """

    Timer = _Timer

    def __init__(self) -> None:
        self.timers: Dict[str, _Timer] = {}

    def __call__(self, name: str) -> _Timer:
        # EAFP: the engine calls this twice per timed region, and the timer almost always exists.
        try:
            return self.timers[name]
        except KeyError:
            timer = self.timers[name] = _new_timer(name)
            return timer

    def get_timers(self) -> Dict[str, _Timer]:
        """The timers by name (``timers`` itself)."""
        return self.timers

    @staticmethod
    def memory_usage() -> str:
        """Accelerator memory now and at peak, formatted for appending to a log line."""
        accelerator = get_accelerator()
        readings = (
            ("mem_allocated", accelerator.memory_allocated()),
            ("max_mem_allocated", accelerator.max_memory_allocated()),
            ("cache_allocated", accelerator.memory_cached()),
            ("max_cache_allocated", accelerator.max_memory_cached()),
        )
        return "".join(f" | {label}: {value / _BYTES_PER_GB:.4f} GB" for label, value in readings)

    def log(self,
            names: Iterable[str],
            normalizer: float = 1.0,
            reset: bool = True,
            memory_breakdown: bool = False,
            ranks: Optional[List[int]] = None) -> None:
        """Print ``[Rank N] time (ms) | name: ms | ...`` for the named timers that exist.

        On ``ranks`` (default [0]), with ``ds_profutils.logging.print_dist`` as DeepSpeed does: to stdout
        whatever the log level (timers are only logged when wall-clock breakdown is asked for), not as a
        log record, so there is no record or caller file/line to go with it.
        """
        # memory_breakdown is accepted and ignored: DeepSpeed 0.19.8 ignores it, and its engine passes
        # it with every timer log, so honouring it would change the engine's log lines.
        _check_normalizer("SynchronizedWallClockTimer.log", normalizer)
        timers = self.timers
        fields = ["time (ms)"]
        fields += [f"{name}: {timers[name].elapsed(reset=reset) / normalizer:.2f}" for name in names if name in timers]
        print_dist(" | ".join(fields), ranks=ranks or [0])

    def get_mean(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True) -> Dict[str, float]:
        """``{name: mean() * 1000 / normalizer}`` for the named timers that exist.

        The factor 1000 and ignoring ``reset`` (means never reset the timers) are DeepSpeed's; the
        engine's autotuning output depends on both.
        """
        _check_normalizer("SynchronizedWallClockTimer.get_mean", normalizer)
        timers = self.timers
        return {name: timers[name].mean() * 1000.0 / normalizer for name in names if name in timers}


def _check_steps_per_output(steps_per_output: Any) -> None:
    """None (never report) or a positive integer; DeepSpeed 0.19.8 divides by zero at the first step instead."""
    if steps_per_output is None:
        return
    if isinstance(steps_per_output, bool) or not isinstance(steps_per_output, numbers.Integral):
        raise InvalidArgumentError(f"ThroughputTimer: steps_per_output must be a positive integer or None, "
                                   f"got {steps_per_output!r}")
    if steps_per_output <= 0:
        raise InvalidArgumentError(f"ThroughputTimer: steps_per_output must be greater than 0 (a positive "
                                   f"integer, or None), got {steps_per_output!r}")


class ThroughputTimer:
    """Samples per second over training steps, logged every ``steps_per_output`` global steps.

    ``config`` is DeepSpeed's throughput timer config (``enabled``, ``synchronized``).  The first
    ``start_step`` global steps are counted but not timed (warm-up).  Durations come from
    ``time.perf_counter_ns()``; ``start_time``/``end_time`` are the last timed start and stop in epoch
    seconds (0 before any), and ``initialized`` is set by the first ``start()`` when enabled, as in
    DeepSpeed.
    """

    def __init__(self,
                 config: Any,
                 batch_size: Optional[int],
                 start_step: int = 2,
                 steps_per_output: Optional[int] = None,
                 monitor_memory: bool = False,
                 logging_fn: Any = None) -> None:
        _check_steps_per_output(steps_per_output)
        if monitor_memory and not PSUTILS_INSTALLED:
            raise ImportError("ThroughputTimer(monitor_memory=True) needs psutil: pip install psutil")
        self.config = config
        self.start_time: float = 0
        self.end_time: float = 0
        self.initialized = False
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.monitor_memory = monitor_memory
        self.logging = logger.info if logging_fn is None else logging_fn
        self.started = False
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self._start_ns: Optional[int] = None  # the last timed start; None until warm-up is over

    def update_epoch_count(self) -> None:
        """Start a new epoch: micro steps count from 0 again."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        """Begin a micro step; timed once ``start_step`` global steps have passed."""
        if not self.config.enabled:
            return
        self.initialized = True
        self.started = True
        if self.global_step_count >= self.start_step:
            if self.config.synchronized:
                get_accelerator().synchronize()
            self._start_ns = _clock_ns()
            self.start_time = _epoch_seconds(self._start_ns)

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """End a micro step; at a global step on a report boundary, log the throughput."""
        if not self.config.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self._start_ns is None:
            return
        if self.config.synchronized:
            get_accelerator().synchronize()
        now = _clock_ns()
        self.end_time = _epoch_seconds(now)
        duration = (now - self._start_ns) / _NS_PER_S
        self.total_elapsed_time += duration
        self.step_elapsed_time += duration
        if global_step:
            if report_speed and self._is_report_boundary():
                self._report()
            self.step_elapsed_time = 0.0

    def _is_report_boundary(self) -> bool:
        _check_steps_per_output(self.steps_per_output)  # it may have been assigned since __init__
        return self.steps_per_output is not None and self.global_step_count % self.steps_per_output == 0

    def _report(self) -> None:
        # DeepSpeed's wording, which log scrapers match.
        position = f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/global_step={self.global_step_count}"
        accelerator = get_accelerator()
        self.logging(f"{position}, RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
                     f"CurrSamplesPerSec={self.batch_size / (self.step_elapsed_time + TIME_EPSILON)}, "
                     f"MemAllocated={round(accelerator.memory_allocated() / _BYTES_PER_GB, 2)}GB, "
                     f"MaxMemAllocated={round(accelerator.max_memory_allocated() / _BYTES_PER_GB, 2)}GB")
        if self.monitor_memory:
            import psutil  # a DeepSpeed dependency; only needed here

            self.logging(f"{position}, vm %: {psutil.virtual_memory().percent}, "
                         f"swap %: {psutil.swap_memory().percent}")

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the timed global steps; -inf before any was timed.

        (DeepSpeed divides by zero when asked during the first ``start_step`` steps.)
        """
        timed_steps = self.global_step_count - self.start_step
        if timed_steps <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size / (self.total_elapsed_time / timed_steps)
