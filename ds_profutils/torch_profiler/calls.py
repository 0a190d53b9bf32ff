"""Profiled runs: one active run per process, ``step_profiler()``'s routing to it, and the plain calls
that begin, advance and end a run (:func:`start_run`, :func:`advance`, :func:`finish_run`), which the
profiled block makes, or an attached engine (:mod:`ds_profutils.engine.engine_driven`).

A profiled call started while another run is active (nested, or in another thread) runs unprofiled
beside it, with one warning; the active run's step count is untouched.  The exception is a run an
engine drives: a profiled call is explicit and wins, so the engine's run ends (its window written)
and the call's begins.  Nothing here waits on a lock:
a signal handler that starts a profiled call while the main thread is inside one of these functions
must not deadlock, so the process's run slot is a lock only ever taken without waiting, and the calls
beside a run are kept in a list (whose append and remove are atomic).
"""
from __future__ import annotations

import atexit
import contextlib
import signal
import threading
from threading import get_ident
from traceback import walk_tb
from types import TracebackType
from typing import Any, Iterator, Optional, Type

from ..config import ProfilerConfig
from ..logging import logger
from .run import ProfilerRun
from .signals import ends_a_run

__all__ = ["RunBlock", "advance", "end_run_raised_by", "finish_run", "raised_by_signal_handler", "start_run",
           "step_profiler"]

_slot = threading.Lock()  # held by the process's active run; acquired only with blocking=False
_current: Optional[ProfilerRun] = None


def step_profiler(engine: Any = None) -> None:
    """End the current training step for the running profiler; call it once per step.

    With ``engine`` (a DeepSpeed engine; call this after ``engine.step()``), only calls after which the
    engine has taken an optimizer step count, so the micro-steps of gradient accumulation make one
    profiler step, and steps are named by the engine's ``global_steps``.  Without a running profiler
    this costs a None test.  A run an attached engine drives counts the engine's steps itself, so
    there this does nothing.
    """
    run = _current
    if run is None or run.engine_driven or (run.beside and run.owner != get_ident()):
        return
    advance(run, engine)


def advance(run: ProfilerRun, engine: Any = None) -> None:
    """End ``run``'s current step (see :func:`step_profiler`, which routes here).  Outside the windows this
    is the whole cost of a step: a counter and one compare (and with an engine, its step count read)."""
    if engine is not None and not run.engine_stepped(engine):
        return
    run.step += 1
    if run.step == run.next_boundary:
        run.catch_up()


def start_run(settings: ProfilerConfig, engine: Any = None, *, engine_driven: bool = False) -> Optional[ProfilerRun]:
    """Begin the process's run for ``settings`` and enter its step 0; None when a run is active already
    (the caller then runs unprofiled beside it, see :func:`beside`), or for ``engine_driven`` when any is.

    A profiled call (not ``engine_driven``) started on the thread of a run an engine drives ends that
    run first, writing its window: explicit beats implicit.  A run whose engine was dropped without
    ``close()`` is ended by the next run to start.  Raises ConfigError when ``output_dir`` cannot be
    written.  ``engine``: see :class:`ProfilerRun`; ``engine_driven``: its steps end only through
    :func:`advance`, never through ``step_profiler()``.
    """
    global _current
    if not _slot.acquire(blocking=False):
        held = _current
        if held is None or not held.engine_driven:
            return None
        if held.engine_gone:
            logger.warning("profiler: the engine driving the profiler was dropped without close(); its run ends at "
                           "step %d", held.step)
        elif engine_driven or held.owner != get_ident():
            return None
        else:
            logger.warning("profiler: a profiled call begins while an attached engine drives the profiler: the call's "
                           "profiler takes over (explicit beats implicit); the engine's ends at step %d, its window "
                           "written, and stays idle", held.step)
        finish_run(held, None, summary=False)
        if not _slot.acquire(blocking=False):
            return None
    try:
        run = ProfilerRun(settings, on_done=_release, engine=engine, engine_driven=engine_driven)
        run.begin()
    except BaseException:
        _slot.release()
        raise
    _current = run
    try:
        run.catch_up()  # a window may begin at step 0, and a signal held meanwhile be delivered
    except BaseException as exc:
        finish_run(run, exc)
        raise
    return run


def end_run_raised_by(exc: BaseException) -> None:
    """``exc`` leaves an attached engine's call (any engine's: RLHF's critic as well as the actor driving the run):
    where it is what the engine-driven run's signal guard raised when the grace ran out, the run ends here, its
    window written before the program's cleanup, and the signal is delivered."""
    run = _current
    if run is not None and run.engine_driven and exc is run.signals.raised_exception:
        finish_run(run, exc, summary=False)


@ends_a_run
def finish_run(run: ProfilerRun, passing: Optional[BaseException], *, summary: bool = True) -> None:
    """End ``run`` however its call ended (``passing``: the exception, if any): the unsaved steps are
    written before the exception goes on.  ``summary``: see :meth:`ProfilerRun.end`."""
    try:
        run.end(passing, summary=summary)
    finally:
        _release(run)


@atexit.register
def _end_engine_run_at_exit() -> None:
    """The window in flight of a run an engine drives, whose ``close()`` never came (a loop that just ends,
    an engine dropped without it, an exception or a signal's SystemExit unwinding out of the program).
    Nothing with barriers: other ranks may be gone."""
    run = _current
    if run is not None and run.engine_driven and not run.done:
        finish_run(run, run.signals.raised_exception, summary=False)


def _release(run: ProfilerRun) -> None:
    """``run`` is no longer the active run (its schedule is done, or its call ended); called once or more."""
    global _current
    if _current is run:
        _current = None
        _slot.release()


@contextlib.contextmanager
def beside() -> Iterator[None]:
    """A profiled call that runs unprofiled while another run is active.

    While it runs, only the active run's thread's ``step_profiler()`` calls count, and none at all when
    it is nested on that thread.
    """
    run = _current
    if run is None:  # the active run is being set up or has just ended: nothing to keep apart from
        yield
        return
    if not run.warned_nested:
        run.warned_nested = True
        logger.warning("profiler: a profiled call started while another one is running (nested, or in "
                       "another thread); it runs unprofiled and the running profiler is unaffected")
    me = get_ident()
    nested = run.owner == me
    run.beside.append(me)
    if nested:
        run.owner = None
    try:
        yield
    finally:
        if nested:
            run.owner = me
        run.beside.remove(me)


class RunBlock:
    """One profiled call or block: the process's run while it lasts, or unprofiled beside another.

    ``__enter__`` raises ConfigError before the block when ``output_dir`` cannot be written.  However the
    block ends (return, exception, SIGTERM/SIGINT turned into SystemExit/KeyboardInterrupt), the unsaved
    steps are written before the exception goes on.
    """

    def __init__(self, settings: ProfilerConfig, engine: Any = None) -> None:
        self.settings = settings
        self.engine = engine
        self.run: Optional[ProfilerRun] = None
        self._beside: Optional[contextlib.AbstractContextManager] = None

    def __enter__(self) -> Optional[ProfilerRun]:
        self.run = start_run(self.settings, self.engine)
        if self.run is None:
            self._beside = beside()
            self._beside.__enter__()
        return self.run

    @ends_a_run
    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 traceback: Optional[TracebackType]) -> None:
        if self.run is None:
            self._beside.__exit__(exc_type, exc, traceback)
            return
        finish_run(self.run, exc)


def raised_by_signal_handler(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside a Python signal handler installed now (it ran between two
    bytecodes of whatever code it interrupted, so the traceback passes through it)."""
    handlers = set()
    for signum in signal.valid_signals():
        try:
            handler = signal.getsignal(signum)
        except (ValueError, OSError):
            continue
        code = getattr(getattr(handler, "__func__", handler), "__code__", None)
        if code is not None:
            handlers.add(code)
    return any(frame.f_code in handlers for frame, _ in walk_tb(exc.__traceback__))
