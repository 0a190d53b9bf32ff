"""``ThroughputTimer`` of ``ds_profutils.timer``: samples per second over training steps, as DeepSpeed's."""
from __future__ import annotations

import numbers
from typing import Any, Optional

from deepspeed.accelerator import get_accelerator
from deepspeed.utils.timer import PSUTILS_INSTALLED

from ..exceptions import InvalidArgumentError
from ..logging import logger
from . import host

__all__ = ["TIME_EPSILON", "ThroughputTimer"]

TIME_EPSILON = 1e-6
_BYTES_PER_GB = 1024**3


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
            self._start_ns = host._clock_ns()
            self.start_time = host.epoch_seconds(self._start_ns)

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
        now = host._clock_ns()
        self.end_time = host.epoch_seconds(now)
        duration = (now - self._start_ns) / host.NS_PER_S
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
