"""LiveMetrics: the step figures of every rank, as events on rank 0 every ``monitor_interval`` steps.

The recorder calls :meth:`LiveMetrics.step_finished` once per optimizer step on every rank.  The step
path only appends the figures; every ``monitor_interval`` calls the interval is packed, exchanged by
one small gather (:mod:`.gather`) and, on rank 0, turned into events (:mod:`.interval`) and written to
the sinks.  Intervals are counted in calls, not by the global step's value, so all ranks end them at
the same call whatever the step numbering (a resumed run included).
"""
from __future__ import annotations

from typing import Any, List, Optional, Protocol, Sequence, Tuple

from ...logging import logger
from .gather import IntervalGather, Rows
from .interval import Event, StepFigures, interval_events, pack_interval
from .sinks import ConsoleSink, LiveSink

__all__ = ["LiveMetrics", "LiveSettings"]


class LiveSettings(Protocol):
    """What LiveMetrics reads of the ``"step_metrics"`` section."""

    monitor_interval: int  # optimizer steps per interval (one set of events)
    console: bool  # one line on rank 0's stdout per interval


class LiveMetrics:
    """Events ``ds_profutils/<name>`` from every rank's figures, sent by rank 0 to ``sinks`` (plus the
    console line when ``settings.console``) every ``settings.monitor_interval`` optimizer steps.

    ``peak_tflops`` is the accelerator's dense peak per rank (None: no ``mfu`` event).  Build it on every
    rank, since every rank takes part in the gather; ``sinks`` matter on rank 0 only.  ``device`` and
    ``defer`` go to :class:`.gather.IntervalGather` (default: the process group's device, deferred
    reading there).  On an accelerator the events of an interval are sent at a later interval's end
    (never waiting for the device), labelled with their own interval's last global step.
    """

    def __init__(self, settings: LiveSettings, peak_tflops: Optional[float], sinks: Sequence[LiveSink], *,
                 device: Any = None, defer: Optional[bool] = None) -> None:
        interval = settings.monitor_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"step_metrics.monitor_interval: expected an integer >= 1, got {interval!r}")
        self.interval = interval
        self.peak_tflops = peak_tflops
        self.sinks: List[LiveSink] = [sink for sink in sinks if sink is not None]
        if settings.console:
            self.sinks.append(ConsoleSink())
        self._gather = IntervalGather(device, defer)
        self._steps: List[StepFigures] = []
        self._failed: set = set()  # sinks whose error was shown (once each)

    def step_finished(self, figures: StepFigures) -> None:
        """One optimizer step ended on this rank (every rank, every step, at the same boundary)."""
        self._steps.append(figures)
        if len(self._steps) >= self.interval:
            steps, self._steps = self._steps, []
            self._send(self._gather.exchange(pack_interval(steps), (len(steps), steps[-1].global_step)))

    def close(self) -> None:
        """Send what is still in flight (an accelerator's last interval); the unfinished interval's steps
        are dropped, since a gather now could meet ranks that close elsewhere."""
        self._send(self._gather.finish())
        self._steps = []

    def _send(self, done: List[Tuple[Tuple[int, int], Optional[Rows]]]) -> None:
        for (steps, global_step), rows in done:
            if rows is None:  # not rank 0
                continue
            self._write(interval_events(rows, steps, global_step, self.peak_tflops))

    def _write(self, events: List[Event]) -> None:
        """To every sink; a failing sink is shown once, loudly, and the job and the other sinks go on."""
        for sink in self.sinks:
            try:
                sink.write(events)
            except Exception as exc:  # noqa: BLE001 - profiling must never break the training run
                if id(sink) not in self._failed:
                    self._failed.add(id(sink))
                    logger.error(f"ds_profutils: live metrics could not be written to {type(sink).__name__}: "
                                 f"{type(exc).__name__}: {exc} (further errors of this sink are not shown)")
