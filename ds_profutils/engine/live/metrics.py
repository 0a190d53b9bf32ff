"""LiveMetrics: the step figures of every rank, as events on rank 0 every ``monitor_interval`` steps.

The recorder calls :meth:`LiveMetrics.step_finished` once per optimizer step on every rank, and the
engine's hooks tell :meth:`LiveMetrics.optimizer_step_ended` after it (:mod:`.clock`), so a step whose
figures never came (the recorder failed on this rank) still counts, with empty figures: every rank keeps
the same sequence of exchanges whatever fails on it.  The step path only appends the figures; every
``monitor_interval`` calls the interval is packed, exchanged by one small all-gather (:mod:`.gather`),
every rank takes the same decisions from the same rows (:mod:`.decisions`), and rank 0 turns them into
events (:mod:`.interval`) and writes them to the sinks; where no rank has anything reading the rows (no
sink, no console line, no rider: the step records alone), every rank stops exchanging after the first
interval.  Intervals are counted in calls, not by the global step's value, so all ranks end them at the
same call whatever the step numbering (a resumed run included)."""
from __future__ import annotations

from typing import Any, List, Optional, Protocol, Sequence, Tuple, Union

from ...logging import logger, warning_once
from .decisions import STOP, UNREAD, decide, empty_row, known_rows, split_flags, with_flags
from .gather import IntervalGather, Rows
from .interval import Event, StepFigures, interval_events, pack_interval, packed_length
from .sinks import ConsoleSink, LiveSink

__all__ = ["LiveMetrics", "LiveSettings", "Rider"]


class Rider(Protocol):
    """What rides on the exchange beside the figures (the trace captures, :mod:`..capture`): ``width``
    columns of its own in every row, before the flags column."""

    width: int

    def columns(self) -> List[float]:
        """This rank's ``width`` columns for this interval's row."""

    def received(self, index: int, rows: Rows, columns: Rows, steps: int, global_step: int, lag: int) -> None:
        """Exchange ``index``'s rows (figures) and every row's columns, read on every rank in order."""


class LiveSettings(Protocol):
    """What LiveMetrics reads of the ``"step_metrics"`` section."""

    monitor_interval: int  # optimizer steps per interval (one set of events)
    console: bool  # one line on rank 0's stdout per interval


class LiveMetrics:
    """Events ``ds_profutils/<name>`` from every rank's figures, sent by rank 0 to ``sinks`` (plus the
    console line when ``settings.console``) every ``settings.monitor_interval`` optimizer steps.

    ``peak_tflops`` is the accelerator's dense peak per rank (None: no ``mfu`` event).  Build it on every
    rank of ``group`` (the engine's data-parallel group; None: the default group), since every rank takes
    part in the exchange; ``sinks`` matter on the group's rank 0 only.  ``device`` and ``defer`` go to
    :class:`.gather.IntervalGather` (default: the process group's device, deferred reading there).  On an
    accelerator the events of an interval are sent at a later interval's end (never waiting for the
    device), labelled with their own interval's last global step.
    """

    def __init__(self, settings: LiveSettings, peak_tflops: Optional[float], sinks: Sequence[LiveSink], *,
                 device: Any = None, defer: Optional[bool] = None, group: Any = None) -> None:
        interval = settings.monitor_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"step_metrics.monitor_interval: expected an integer >= 1, got {interval!r}")
        self.interval = interval
        self.peak_tflops = peak_tflops
        self.sinks: List[LiveSink] = [sink for sink in sinks if sink is not None]
        if settings.console:
            self.sinks.append(ConsoleSink())
        self._gather = IntervalGather(device, defer, group)
        # set by what rides on the exchange (trace_capture): its columns travel in every row (a rank's, whether or
        # not its figures came)
        self.rider: Optional[Rider] = None
        self._steps: List[Union[StepFigures, int]] = []  # an int: a step whose figures never came
        self._fed = False  # figures came for the optimizer step in progress
        self._flags = 0  # this rank's flags, sent with every row from now on
        self._stop_at: Optional[int] = None  # the first exchange no rank launches (every rank decides it alike)
        self._failed: set = set()  # sinks whose error was shown (once each)

    @property
    def group_rank(self) -> int:
        """This rank's place in the exchange (row ``group_rank``)."""
        return self._gather.rank

    @property
    def group_ranks(self) -> List[int]:
        """The global ranks of the exchange's rows."""
        return self._gather.ranks

    @property
    def stopped(self) -> bool:
        """Whether the live exchange has stopped (on every rank at the same interval)."""
        return self._stop_at is not None and self._gather.launched >= self._stop_at

    def add_sink(self, sink: LiveSink) -> None:
        """Send the events to ``sink`` as well; one sink of a kind (attaching the same framework object again adds
        none).  Give it before the first interval ends: with nothing reading them, the exchange stops there."""
        if any(type(known) is type(sink) for known in self.sinks):
            return
        self.sinks.append(sink)
        if self._stop_at is not None and self._reads:  # decided, if not yet in effect (deferred: two intervals on)
            self._said_too_late()

    @property
    def _reads(self) -> bool:
        """Whether this rank reads the exchanged rows: what rides on them, on every rank; sinks, on the group's rank
        0 only (the events are its own: another rank's sinks get none, and keep no exchange going)."""
        return self.rider is not None or (self._gather.rank == 0 and bool(self.sinks))

    def _said_too_late(self) -> None:
        warning_once(f"ds_profutils: {', '.join(type(sink).__name__ for sink in self.sinks)} get no live events "
                     "once the live exchange stops (nothing read it when the first interval ended, or a rank's live "
                     "figures failed); give sinks right after attach")

    def step_finished(self, figures: StepFigures) -> None:
        """One optimizer step ended on this rank (every rank, every step, at the same boundary)."""
        self._fed = True
        self._count(figures)

    def optimizer_step_ended(self, global_step: int) -> None:
        """The engine finished optimizer step ``global_step`` (told after the recorder on every rank): where
        its figures never came, it counts with empty figures, so this rank's exchanges stay in step."""
        if self._fed:
            self._fed = False
        else:
            self._count(global_step)

    def close(self) -> None:
        """Send what is still in flight (an accelerator's last intervals); the unfinished interval's steps
        are dropped, since an exchange now could meet ranks that close elsewhere."""
        self._send(self._gather.finish())
        self._steps = []

    def _count(self, step: Union[StepFigures, int]) -> None:
        self._steps.append(step)
        if len(self._steps) < self.interval:
            return
        steps, self._steps = self._steps, []
        last = steps[-1]
        label = (len(steps), last.global_step if isinstance(last, StepFigures) else last)
        try:
            self._send(self._gather.due())
            if self.stopped:
                return
            row = self._row(steps)
        except Exception as exc:  # noqa: BLE001 - this rank still takes part in the interval's exchange, saying stop
            self._fail(exc)
            if self.stopped:
                return
            row = self._empty_row(len(steps))
        try:
            self._send(self._gather.exchange(row, label))
        except Exception as exc:  # noqa: BLE001 - the next row says stop (every rank stops at the same interval)
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        """Something of ours failed on this rank: its rows say stop from now on, and every rank stops exchanging at
        the same interval (none waits for this one), said once."""
        if not self._flags & STOP:
            logger.error(f"ds_profutils: live metrics failed on this rank ({type(exc).__name__}: {exc}); every rank "
                         "stops sending live figures at the same interval, training goes on")
        self._flags |= STOP

    def _empty_row(self, steps: int) -> List[float]:
        """A row of ``steps`` steps without figures or rider columns, saying stop."""
        width = self.rider.width if self.rider is not None else 0
        return with_flags(empty_row(packed_length(steps) + width), self._flags | STOP)

    def _row(self, steps: List[Union[StepFigures, int]]) -> List[float]:
        """This rank's row: its packed interval (empty where a step has no figures) and its flags."""
        figures = [step for step in steps if isinstance(step, StepFigures)]
        values = empty_row(packed_length(len(steps)))
        if len(figures) == len(steps):
            try:
                values = pack_interval(figures)
            except Exception as exc:  # noqa: BLE001 - every rank stops together rather than wait for this one
                self._fail(exc)
        if self.rider is not None:
            values = [*values, *self.rider.columns()]
        return with_flags(values, self._flags | (0 if self._reads else UNREAD))

    def _send(self, done: List[Tuple[int, Tuple[int, int], Rows]]) -> None:
        for index, (steps, global_step), rows in done:
            rows, flags = split_flags(rows)
            if self.rider is not None:
                width = self.rider.width
                columns = [row[-width:] for row in rows]
                rows = [row[:-width] for row in rows]
                self.rider.received(index, rows, columns, steps, global_step, self._gather.lag)
            decisions = decide(flags)
            if decisions.stop or decisions.unread:  # deferred: the boundary every rank has read these rows by
                effect = index + max(1, self._gather.lag)
                self._stop_at = effect if self._stop_at is None else min(self._stop_at, effect)
            if decisions.stop:
                warning_once("ds_profutils: live metrics stop on every rank (a rank's live figures failed); "
                             "training and the step records go on")
            elif decisions.unread and self._reads:  # given after this rank's row said it had none
                self._said_too_late()
            if self._gather.rank != 0 or not self.sinks:  # the events are rank 0's, made for its sinks alone
                continue
            try:  # an error here must not skip rank 0's next exchange
                events = self._events(rows, steps, global_step)
            except Exception as exc:  # noqa: BLE001 - profiling must never break the training run
                warning_once(f"ds_profutils: live events of an interval could not be made ({type(exc).__name__}: "
                             f"{exc}); the exchange and training go on")
                continue
            self._write(events)

    def _events(self, rows: Rows, steps: int, global_step: int) -> List[Event]:
        """The events from the rows that have figures; the straggler named by its global rank, and no
        all-ranks sum (tokens/s) where a rank's row is empty."""
        known = known_rows(rows)
        if not known:
            return []
        events = interval_events([rows[index] for index in known], steps, global_step, self.peak_tflops)
        ranks = self._gather.ranks
        named = []
        for name, value, step in events:
            if name == "ds_profutils/straggler_rank" and value >= 0:
                value = ranks[known[int(value)]]
            if name != "ds_profutils/tokens_per_s" or len(known) == len(rows):
                named.append((name, value, step))
        return named

    def _write(self, events: List[Event]) -> None:
        """To every sink; a failing sink is shown once, loudly, and the job and the other sinks go on."""
        if not events:
            return
        for sink in self.sinks:
            try:
                sink.write(events)
            except Exception as exc:  # noqa: BLE001 - profiling must never break the training run
                if id(sink) not in self._failed:
                    self._failed.add(id(sink))
                    logger.error(f"ds_profutils: live metrics could not be written to {type(sink).__name__}: "
                                 f"{type(exc).__name__}: {exc} (further errors of this sink are not shown)")
