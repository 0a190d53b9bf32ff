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

This module is the public one (DeepSpeed's names and signatures) and holds the group; the timers are
in the private package :mod:`ds_profutils._timers`: the host timer (``_Timer``, which the ZeRO-3
fetch profiler imports from here), the device-event timer and ``ThroughputTimer``.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional

from deepspeed.accelerator import get_accelerator
# DeepSpeed's own objects, for code that imports them from here; none holds any state to share.
# (Free: importing any deepspeed submodule runs deepspeed/__init__.py, which loads deepspeed.utils.timer.)
from deepspeed.utils.timer import PSUTILS_INSTALLED, CudaEventTimer, NoopTimer

from ._stats import trim_mean
from ._timers.events import _EventTimer
from ._timers.host import _Timer
from ._timers.throughput import TIME_EPSILON, ThroughputTimer
from .exceptions import InvalidArgumentError
from .logging import print_dist

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

_BYTES_PER_GB = 1024**3


def _check_normalizer(function: str, normalizer: float) -> None:
    if not normalizer > 0.0:
        raise InvalidArgumentError(f"{function}: normalizer must be > 0, got {normalizer!r}")


def _new_timer(name: str) -> _Timer:
    """A timer on the clock DeepSpeed's timers would use on the current accelerator."""
    accelerator = get_accelerator()
    return _Timer(name) if accelerator.use_host_timers() else _EventTimer(name, accelerator.Event)


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
