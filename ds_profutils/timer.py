"""Wall-clock timers with the API of ``deepspeed.utils.timer``, in constant memory.

What differs from DeepSpeed's timers, and why:

* Host time comes from ``time.perf_counter_ns()``: monotonic, integer nanoseconds, so an NTP step
  cannot produce a negative duration and sums do not lose precision.
* A timer keeps :class:`DurationStats` (exact count, total, min and max, and a bounded random sample
  of durations), not one record per start/stop, so memory stays bounded however long a run goes
  between ``log()`` calls.  ``elapsed()`` is exact; ``mean()`` equals DeepSpeed's trimmed mean while
  at most ``SAMPLE_SIZE`` durations were recorded since the last reset (more than an autotuning run
  records), and beyond is estimated from the exact total and the sample's tails.
* Where DeepSpeed's timers use device events (``use_host_timers()`` is False), so do ours; the events
  are resolved only when a time is read (or, to bound memory, once ``FOLD_EVERY`` pairs are pending),
  so timing never synchronizes the device on every stop.
* Misuse (stop without start, start twice, a normalizer <= 0) raises ``InvalidArgumentError`` instead
  of an ``assert`` that vanishes under ``python -O``.
"""
from __future__ import annotations

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
_BYTES_PER_GB = 1024**3

# Module-level so tests can substitute a scripted clock.
_clock_ns = time.perf_counter_ns


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
        self._start: Any = None  # the start stamp (or event) while running, else None
        self._durations = DurationStats(name)
        self._pending = self._durations.pending  # the same list for the timer's life

    @property
    def started_(self) -> bool:
        """Whether the timer is running (DeepSpeed's attribute name)."""
        return self._start is not None

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
        pending = self._pending
        pending.append(now - start)
        if len(pending) >= FOLD_EVERY:
            self._durations.fold()

    def _fold(self) -> None:
        """Bring the statistics up to date before a time is read."""
        self._durations.fold()

    def add_durations(self, durations_ns: Sequence[float]) -> None:
        """Count intervals measured elsewhere on this timer's clock (the ZeRO-3 fetch profiler's, in batches)."""
        self._pending.extend(durations_ns)
        if len(self._pending) >= FOLD_EVERY:
            self._durations.fold()

    def reset(self) -> None:
        """Forget all measurements and any interval in progress."""
        self._start = None
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
        if running:
            self.start()
        return total_ms

    def mean(self) -> float:
        """Trimmed mean (10% off each end) of the durations since the last reset, in ms; 0 if none."""
        self.elapsed(reset=False)
        return self._durations.trimmed_mean() / _NS_PER_MS


class _EventTimer(_Timer):
    """A timer on device events recorded on the current stream, resolved when a time is read."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._event_class = get_accelerator().Event
        self._pairs: List[Any] = []  # (start, end) events not resolved yet

    def start(self) -> None:
        """Record a start event."""
        if self._start is not None:
            raise self._already_started()
        self._start = self._event_class(enable_timing=True)
        self._start.record()

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


class SynchronizedWallClockTimer(dict):
    """A group of named timers, created on first use: ``timers("fwd").start()``.

    The group is the dict of its timers: calling it is ``dict.__getitem__``, with ``__missing__``
    creating the timer, so the lookup that engines make twice per timed region runs no Python code.
    ``timers`` and ``get_timers()`` return the group itself, where DeepSpeed keeps a separate dict.
    Otherwise it behaves as DeepSpeed's plain object: truthy even when empty (DeepSpeed's optimizers
    test ``if self.timers:`` before creating the first timer), hashable, equal only to itself.
    """

    Timer = _Timer
    __call__ = dict.__getitem__
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    def __init__(self) -> None:
        super().__init__()

    def __bool__(self) -> bool:
        return True

    def __missing__(self, name: str) -> _Timer:
        timer = self[name] = _new_timer(name)
        return timer

    @property
    def timers(self) -> Dict[str, _Timer]:
        """The timers by name (DeepSpeed's attribute)."""
        return self

    def get_timers(self) -> Dict[str, _Timer]:
        """The timers by name."""
        return self

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
        fields = ["time (ms)"]
        fields += [f"{name}: {self[name].elapsed(reset=reset) / normalizer:.2f}" for name in names if name in self]
        print_dist(" | ".join(fields), ranks=ranks or [0])

    def get_mean(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True) -> Dict[str, float]:
        """``{name: mean() * 1000 / normalizer}`` for the named timers that exist.

        The factor 1000 and ignoring ``reset`` (means never reset the timers) are DeepSpeed's; the
        engine's autotuning output depends on both.
        """
        _check_normalizer("SynchronizedWallClockTimer.get_mean", normalizer)
        return {name: self[name].mean() * 1000.0 / normalizer for name in names if name in self}


class ThroughputTimer:
    """Samples per second over training steps, logged every ``steps_per_output`` global steps.

    ``config`` is DeepSpeed's throughput timer config (``enabled``, ``synchronized``).  The first
    ``start_step`` global steps are counted but not timed (warm-up).  Times are in seconds, from
    ``time.perf_counter_ns()``.  DeepSpeed's ``start_time``/``end_time`` (epoch seconds) are not kept.
    """

    def __init__(self,
                 config: Any,
                 batch_size: Optional[int],
                 start_step: int = 2,
                 steps_per_output: Optional[int] = None,
                 monitor_memory: bool = False,
                 logging_fn: Any = None) -> None:
        self.config = config
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
        self._start_ns: Optional[int] = None

    def update_epoch_count(self) -> None:
        """Start a new epoch: micro steps count from 0 again."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        """Begin a micro step; timed once ``start_step`` global steps have passed."""
        if not self.config.enabled:
            return
        self.started = True
        if self.global_step_count >= self.start_step:
            if self.config.synchronized:
                get_accelerator().synchronize()
            self._start_ns = _clock_ns()

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
        duration = (_clock_ns() - self._start_ns) / 1e9
        self._start_ns = None
        self.total_elapsed_time += duration
        self.step_elapsed_time += duration
        if global_step:
            if report_speed and self._is_report_boundary():
                self._report()
            self.step_elapsed_time = 0.0

    def _is_report_boundary(self) -> bool:
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
