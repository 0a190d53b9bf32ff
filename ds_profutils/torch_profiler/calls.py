"""Profiled calls: one active run per process, ``step_profiler()``'s routing to it, and the block that
begins a run and ends it however the call ends.

A profiled call started while another run is active (nested, or in another thread) runs unprofiled
beside it, with one warning; the active run's step count is untouched.
"""
from __future__ import annotations

import contextlib
import threading
from threading import get_ident
from types import TracebackType
from typing import Any, Iterator, Optional, Tuple, Type

from ..config import ProfilerConfig
from ..logging import logger
from .run import ProfilerRun
from .signals import ends_a_run

__all__ = ["RunBlock", "step_profiler"]

_claim_lock = threading.Lock()
_current: Optional[ProfilerRun] = None


def step_profiler(engine: Any = None) -> None:
    """End the current training step for the running profiler; call it once per step.

    With ``engine`` (a DeepSpeed engine; call this after ``engine.step()``), only calls after which the
    engine has taken an optimizer step count, so the micro-steps of gradient accumulation make one
    profiler step, and steps are named by the engine's ``global_steps``.  Without a running profiler
    this costs a None test.  Outside the windows it is the whole cost of a step, so it is written out
    here rather than calling a method: a counter and one compare.
    """
    run = _current
    if run is None or (run.unprofiled_calls and run.owner != get_ident()):
        return
    if engine is not None and not run.engine_stepped(engine):
        return
    run.step += 1
    if run.step == run.next_boundary:
        run.catch_up()


def _claim(settings: ProfilerConfig) -> Tuple[ProfilerRun, bool]:
    """The process's active run, and whether it is a new one for ``settings`` (made only when none is
    active: a profiled call nested in a profiled loop costs no run of its own)."""
    global _current
    with _claim_lock:
        if _current is None:
            _current = ProfilerRun(settings, on_done=_release)
            return _current, True
        return _current, False


def _release(run: ProfilerRun) -> None:
    """``run`` is no longer the active run (its schedule is done, or its call ended)."""
    global _current
    with _claim_lock:
        if _current is run:
            _current = None


@contextlib.contextmanager
def _beside(run: ProfilerRun) -> Iterator[None]:
    """A profiled call that runs unprofiled while ``run`` is active.

    While it runs, only ``run``'s thread's ``step_profiler()`` calls count, and none at all when it is
    nested on ``run``'s own thread.
    """
    if not run.warned_nested:
        run.warned_nested = True
        logger.warning("profiler: a profiled call started while another one is running (nested, or in "
                       "another thread); it runs unprofiled and the running profiler is unaffected")
    nested = run.owner == get_ident()
    with _claim_lock:
        run.unprofiled_calls += 1
        if nested:
            run.owner = None
    try:
        yield
    finally:
        with _claim_lock:
            if nested:
                run.owner = get_ident()
            run.unprofiled_calls -= 1


class RunBlock:
    """One profiled call or block: the process's run while it lasts, or unprofiled beside another.

    ``__enter__`` raises ConfigError before the block when ``output_dir`` cannot be written.  However the
    block ends (return, exception, SIGTERM/SIGINT turned into SystemExit/KeyboardInterrupt), the unsaved
    steps are written before the exception goes on.
    """

    def __init__(self, settings: ProfilerConfig) -> None:
        self.settings = settings
        self.run: Optional[ProfilerRun] = None
        self._beside: Optional[contextlib.AbstractContextManager] = None

    def __enter__(self) -> Optional[ProfilerRun]:
        run, new = _claim(self.settings)
        if not new:
            self._beside = _beside(run)
            self._beside.__enter__()
            return None
        self.run = run
        try:
            run.begin()
        except BaseException:
            _release(run)
            raise
        try:
            run.catch_up()  # a window may begin at step 0, and a signal held meanwhile be delivered
        except BaseException as exc:
            self.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return run

    @ends_a_run
    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 traceback: Optional[TracebackType]) -> None:
        run = self.run
        if run is None:
            self._beside.__exit__(exc_type, exc, traceback)
            return
        run.signals.holding = True  # before any call: from here on a signal is held until the files are written
        try:
            run.end(returned=exc_type is None)
        finally:
            _release(run)
