"""The live events into the frameworks' own reporting: the transformers Trainer's ``report_to``
integrations, Accelerate's trackers and Lightning's loggers.

Each sink holds the framework object and looks, at every write, for where that job reports now (a
tracker initialized after ``attach`` counts); where it reports nowhere, the sink sends nothing.  The
framework is imported only inside its sink's write.  LiveMetrics calls the sinks on rank 0 only, with
one interval's events (``(name, value, global_step)``, one global step).
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Tuple

from ..engine.live import Event

__all__ = ["AccelerateSink", "LightningSink", "TrainerSink"]


def _values(events: List[Event]) -> Tuple[Dict[str, float], int]:
    """The events as one ``{name: value}`` and their global step."""
    return {name: value for name, value, _ in events}, events[-1][2]


class TrainerSink:
    """The transformers ``Trainer``'s ``report_to`` integrations (TensorBoard, W&B, MLflow, ...).

    Their callbacks' ``on_log`` is called directly with the events, at the events' own global step: a
    copy of the Trainer's state carries it, and a fresh ``TrainerControl`` takes whatever the callback
    sets.  ``trainer.log`` is not used: it would print the figures through the progress bar, append them
    to ``state.log_history`` and run every callback, which is the Trainer's own logging disturbed.  The
    integrations name the points as they name the Trainer's (TensorBoard: ``train/ds_profutils/step_ms``).
    DVCLive's callback is the exception: its ``on_log`` advances DVCLive's step (:func:`_to_dvclive`).
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def write(self, events: List[Event]) -> None:
        from transformers import TrainerControl
        from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

        if not events:
            return
        reporting = tuple(INTEGRATION_TO_CALLBACK.values())
        callbacks = [cb for cb in self.trainer.callback_handler.callbacks if isinstance(cb, reporting)]
        if not callbacks:
            return
        logs, global_step = _values(events)
        state = copy.copy(self.trainer.state)  # not dataclasses.replace: __post_init__ re-reads callbacks
        state.global_step = global_step
        for callback in callbacks:
            if type(callback).__name__ == "DVCLiveCallback":
                _to_dvclive(callback, logs)
            else:
                callback.on_log(self.trainer.args, state, TrainerControl(), logs=dict(logs))


def _to_dvclive(callback: Any, logs: Dict[str, float]) -> None:
    """DVCLive's Trainer callback advances DVCLive's step at every ``on_log``, so ours would move the Trainer's
    own points along: the events go to its ``Live`` at its present step instead (named as the Trainer's
    metrics are there, ``train/...``), once its own first ``on_log`` has started it."""
    live = getattr(callback, "live", None)
    if live is None:
        return
    for name, value in logs.items():
        live.log_metric(f"train/{name}", value)


class AccelerateSink:
    """Accelerate's trackers (``accelerator.log``), where ``init_trackers`` ran."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def write(self, events: List[Event]) -> None:
        if events and self.accelerator.trackers:
            logs, global_step = _values(events)
            self.accelerator.log(logs, step=global_step)


class LightningSink:
    """Every logger of a Lightning ``Trainer`` (``trainer.loggers``: TensorBoard, CSV, W&B, ...)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def write(self, events: List[Event]) -> None:
        if not events:
            return
        logs, global_step = _values(events)
        for logger in self.trainer.loggers:
            logger.log_metrics(dict(logs), step=global_step)
