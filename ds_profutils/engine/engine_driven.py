"""The torch profiler driven by an attached engine: no decorator, no ``step_profiler()`` in the loop.

Where the engine is built inside a framework (a transformers ``Trainer``, Accelerate, Lightning) there
is no training function of the user's to decorate and no place to end a step, so ``attach`` adds
:class:`EngineDrivenProfiler` to the engine's hooks when the config's ``"profiler"`` section is on.
It is the decorator's run, driven by other calls:

* the run begins at the engine's first forward after attach (so a decorated call already running
  then keeps the profiler: explicit beats implicit, and this one stays idle, saying so once), and
  its schedule counts the engine's optimizer steps from there;
* a step ends when ``engine.step()`` returns having taken an optimizer step (the boundary of gradient
  accumulation), and is named ``ProfilerStep#N`` by the engine's global step, as the fetch records are;
* the window in flight is written at ``close()``, at process exit (:mod:`ds_profutils.torch_profiler.calls`),
  and on interruption: a SIGTERM or SIGINT waits for the next optimizer step as with the decorator, and
  where none comes in time the exception the signal guard raises is caught leaving the engine's
  forward, backward, step or own work (a checkpoint save), and the window is written there, before
  the program's own cleanup runs (a barrier in a ``finally`` with a dead peer would otherwise hold it
  until SIGKILL).  Where the main thread is outside the
  engine's calls then (the program's loop waiting for a batch), nothing is raised: the window is
  written right there and the signal delivered (SIGTERM's default action; SIGINT's KeyboardInterrupt
  goes up from there, the run ended), also in a blocking collective of the program's that our
  wrappers time, once it returns (a peer late between steps); unless ds_profutils' own code runs
  there (a listener, a live sink, an async handle's timed wait: :func:`.torch_collectives.inside_ours`),
  where the exception is raised as inside the engine and the window written at exit.
"""
from __future__ import annotations

import weakref
from types import FrameType
from typing import Any, Optional

import torch

from ..config import ProfilerConfig
from ..logging import logger
from ..outputs import process_identity
from ..torch_profiler.calls import advance, finish_run, start_run
from ..torch_profiler.run import ProfilerRun
from ..torch_profiler.writer import show_comms_summary
from .hooks import Listener, running
from .torch_collectives import inside_ours

__all__ = ["EngineDrivenProfiler"]


class EngineDrivenProfiler(Listener):
    """One attached engine's torch profiler (see the module doc); ``close()`` writes the window in flight."""

    def __init__(self, engine: Any, settings: ProfilerConfig) -> None:
        self.engine = engine
        self.settings = settings
        self.run: Optional[ProfilerRun] = None
        self._idle = False  # the run ended, or another run had the process's profiler at the first forward
        self._started = False  # a run began here: close() then shows the comms summary, as on every rank
        self._stopped_by_signal = False  # ... unless a SIGTERM/SIGINT stopped it (its barriers would meet ranks gone)

    def forward_started(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if self.run is None and not self._idle:
            self._started = True  # even if start_run raises: close() shows the summary as the other ranks do
            self.run = start_run(self.settings, self.engine, engine_driven=True)
            if self.run is not None:  # held weakly: the run must not keep the engine alive through this listener
                ends_here = weakref.WeakMethod(self._ends_between_steps)
                self.run.signals.ends_here = lambda frame: (ends_here() or _never)(frame)
            else:
                self._started, self._idle = False, True
                logger.warning("profiler: the engine's profiler stays idle: a profiled call (the @profiler decorator, "
                               "or another attached engine's profiler) is running, and only one runs per process")

    def recording(self) -> bool:
        """Whether the step in progress runs in the profiler's active window (its records say so: memory
        rises there may be the profiler's own buffers)."""
        run = self.run
        return run is not None and run.recording

    def _ends_between_steps(self, frame: Optional[FrameType]) -> bool:
        """Asked by the signal guard where no optimizer step came in the grace period (see the module doc): the run
        ends here, before any cleanup of the program's, where the main thread is in the program's own code between
        the engine's calls."""
        if running.engine_id is not None or inside_ours(frame):
            return False
        self._finish()
        return True

    def step_ended(self) -> None:
        run = self.run
        if run is not None:
            advance(run, self.engine)

    def stop_after_error(self, exc: Exception) -> None:
        logger.error("profiler: the engine's profiler stopped after an error (%s: %s); training goes on",
                     type(exc).__name__, exc)
        self._finish()

    def close(self) -> None:
        """Write the window in flight and end the run; then DeepSpeed's comms summary, whose barriers every
        rank reaches: each began a run, whether or not it stopped after an error since (not after a signal)."""
        self._finish()
        if self._started and not self._stopped_by_signal:
            show_comms_summary(self.settings, process_identity())

    def _finish(self) -> None:
        run, self.run = self.run, None
        self._idle = True
        if run is not None:
            try:
                finish_run(run, None, summary=False)  # nothing more where it ended already (an engine's hooks)
            finally:  # a KeyboardInterrupt delivered at the run's end comes out through here
                self._stopped_by_signal = run.signals.stopped_by_signal


def _never(frame: Optional[FrameType]) -> bool:
    """The profiler is gone: the run cannot end where the main thread is."""
    return False
