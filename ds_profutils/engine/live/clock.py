"""The engine's optimizer-step boundaries as LiveMetrics counts them, independent of the recorder.

The recorder feeds LiveMetrics each step's figures; when it fails on one rank (its file cannot be
opened, a memory read raises) the hooks stop it, and a LiveMetrics fed only by it would stop taking
part in the interval exchange while the other ranks wait in it.  :class:`LiveStepClock` is told of
every optimizer step after the recorder and tells LiveMetrics, which counts a step whose figures did
not come with empty figures: the failed rank's row is empty, every rank's exchanges stay in step.
"""
from __future__ import annotations

from ...logging import logger
from ..hooks import Listener
from .metrics import LiveMetrics

__all__ = ["LiveStepClock"]


class LiveStepClock(Listener):
    """Tells ``live`` each optimizer step of its engine that ends; add it after the recorder."""

    def __init__(self, live: LiveMetrics) -> None:
        self.live = live

    def optimizer_step_ended(self, global_step: int) -> None:
        self.live.optimizer_step_ended(global_step)

    def stop_after_error(self, exc: Exception) -> None:
        logger.error("ds_profutils: live metrics stopped after an error (%s: %s); training goes on",
                     type(exc).__name__, exc)
