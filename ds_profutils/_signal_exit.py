"""Writers called before a SIGTERM ends the process with its default action.

The profiler holds a SIGTERM that arrives while a window holds unsaved steps, writes the window, and
then lets SIGTERM end the process with its default action, so the exit status still says "killed by
SIGTERM" (what launchers and schedulers expect).  That action skips ``atexit``, so another writer (the
ZeRO-3 recorder, whose last record may hold late device times) registers here to be called first.

A process the profiler ends at its deadline (``os._exit``, see :mod:`.torch_profiler.watchdog`) calls
none of these: the main thread may be stuck inside one of them.

:func:`close_at_exit` registers a writer for both ways a process ends with files open: ``atexit`` and
the profiler's SIGTERM.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import weakref
from typing import Callable, List

__all__ = ["call_before_signal_exit", "close_at_exit", "ending_on_signal", "forget_before_signal_exit",
           "run_before_signal_exit"]

_callbacks: List[Callable[[], None]] = []
_ending_on_signal = False


def call_before_signal_exit(callback: Callable[[], None]) -> None:
    """Have ``callback`` write what it holds if a SIGTERM ends the process (until ``forget_before_signal_exit``)."""
    _callbacks.append(callback)


def forget_before_signal_exit(callback: Callable[[], None]) -> None:
    """``callback`` has nothing left to write."""
    with contextlib.suppress(ValueError):
        _callbacks.remove(callback)


def run_before_signal_exit() -> None:
    """Call every registered writer, newest last; a failure is logged, never raised (the process is ending)."""
    global _ending_on_signal
    _ending_on_signal = True
    for callback in list(_callbacks):
        try:
            callback()
        except Exception:
            logging.getLogger("DeepSpeed").exception("ds_profutils: writing %r before the process ends failed",
                                                     callback)


def ending_on_signal() -> bool:
    """Whether a SIGTERM is ending the process now (the writers above are being called): a close then is not the
    program's own."""
    return _ending_on_signal


def close_at_exit(close: Callable[[], None]) -> Callable[[], None]:
    """Have the bound method ``close`` called as the process ends, at exit or before a SIGTERM the profiler
    re-raises; returns the call that cancels this (for ``close`` itself to make).

    The object is held weakly: one dropped without ``close()`` (an engine of an RLHF reload or a
    sweep) is freed, not kept alive until the process ends, and its registration goes with it.  A forked
    child (``os.fork``) inherits the registration and does nothing with it: the object is its parent's (its
    files, and locks a thread of the parent's may have held at the fork).
    """
    method = weakref.WeakMethod(close)
    registered_by = os.getpid()

    def at_exit() -> None:
        alive = method()
        if alive is not None and os.getpid() == registered_by:
            alive()

    def cancel() -> None:
        atexit.unregister(at_exit)
        forget_before_signal_exit(at_exit)

    atexit.register(at_exit)
    call_before_signal_exit(at_exit)
    weakref.finalize(close.__self__, cancel).atexit = False  # at exit, the registration is what runs close()
    return cancel
