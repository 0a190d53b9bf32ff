"""Interruptions while a window holds unsaved steps, and while the profiler writes them.

DeepSpeed's launcher stops a rank with SIGTERM to its whole process tree (DataLoader workers too)
and sends SIGKILL 30 s later; a user stops a job with Ctrl-C (SIGINT).  Python's default SIGTERM
action kills the process on the spot, skipping every ``finally``, so the steps being recorded would
be lost.  While a window holds unsaved steps, :class:`SignalGuard`'s handler instead

* turns SIGTERM into ``SystemExit(143)``, which unwinds to the profiler's ``finally`` where the files
  are written; once they are, SIGTERM is raised again with the default action, so the process still
  ends "killed by SIGTERM" (the exit status the launcher and schedulers expect);
* turns SIGINT into ``KeyboardInterrupt``, so a program's ``except KeyboardInterrupt:`` still runs;
* calls a handler the program installed itself instead (Python's default SIGINT handler is one);
  leaves an ignored signal ignored (a job started in the background has SIGINT ignored); and leaves
  alone a handler installed outside Python, which could not be put back.

From the moment a run ends (``holding``, set before any call a signal could interrupt) and during
every step of the state machine, the handler raises nothing: SIGTERM and SIGINT are held and
delivered when the files are on disk.  Two things bound the wait: a third SIGINT, or
:data:`DEADLINE_S` after the first signal, make the writer give up (it checks between chunks, and
says which file it could not write).  torch's DataLoader installs a Python SIGCHLD handler that
raises into whatever runs when a worker dies; the launcher kills the workers with the rank, so while
a window is open that handler is called through this one, and not at all while the profiler writes.

Handlers are installed only while a window holds unsaved steps, put back only where this guard's is
still the installed one, and never outside the main thread, where Python allows none.
"""
from __future__ import annotations

import signal
import sys
import threading
import time
from types import CodeType, FrameType
from typing import Any, Callable, Dict, List, Optional, Set, TypeVar

from ..logging import logger
from ..outputs import run_before_signal_exit

__all__ = ["DEADLINE_S", "SignalGuard", "WriteAbandoned", "ends_a_run"]

DEADLINE_S = 25.0
"""Seconds after the first SIGTERM/SIGINT after which writing gives up: the launcher's SIGKILL comes at
30 s, and a rank that gives up in time can still say so and end with its own exit status."""
_GIVE_UP_SIGINTS = 3
_STOPPING = (signal.SIGTERM, signal.SIGINT)
_SIGCHLD: Optional[int] = getattr(signal, "SIGCHLD", None)

F = TypeVar("F", bound=Callable[..., Any])
_RUN_ENDINGS: Set[CodeType] = set()


def ends_a_run(function: F) -> F:
    """Mark a function the interpreter calls as a profiled block ends (a context manager's ``__exit__``).

    A pending signal may be handled at the very first instruction of such a function, before it can
    set ``holding``; one handled anywhere in a marked function is held as if ``holding`` were set.
    """
    _RUN_ENDINGS.add(function.__code__)
    return function


class WriteAbandoned(BaseException):
    """The writer gave up (a third SIGINT, or the deadline): raised by :meth:`SignalGuard.check` only."""


class SignalGuard:
    """The signal handling of one profiled run (see the module doc)."""

    def __init__(self) -> None:
        self.holding = False
        self._previous: Dict[int, Any] = {}
        self._installed: List[int] = []
        self._handler = self._handle  # one bound method, so "is ours still installed" is an equality test
        self._pending: List[int] = []
        self._reraise: Optional[int] = None
        self._signalled_at: Optional[float] = None
        self._sigints = 0
        self._give_up: Optional[str] = None
        self._warned: Set[str] = set()
        self.stopped_by_signal = False  # a SIGTERM/SIGINT raised into the run (never reset)
        self._sigchld_aside: Any = None  # a SIGCHLD handler set aside while one write runs
        self._in_sigchld = False

    @property
    def interrupted(self) -> bool:
        """True once a SIGTERM/SIGINT arrived that has not been delivered yet (or was turned into an exception)."""
        return self._reraise is not None or self._signalled_at is not None

    def install(self) -> None:
        """Install the handler (a window begins holding unsaved steps)."""
        if self._installed:
            return
        if threading.current_thread() is not threading.main_thread():
            self._warn_once("thread", "profiler: running outside the main thread, where Python allows no signal "
                            "handlers: a SIGTERM or SIGINT while a window is recorded loses that window's steps")
            return
        for signum in (*_STOPPING, _SIGCHLD):
            if signum is None:
                continue
            current = signal.getsignal(signum)
            if signum == _SIGCHLD and not callable(current):
                continue  # only a Python handler (torch's DataLoader's) is ever set aside
            if current == signal.SIG_IGN:
                continue  # an ignored signal stays ignored
            if current is None:
                self._warn_once(str(signum), f"profiler: {signal.Signals(signum).name} has a handler installed "
                                "outside Python, which is left in place: that signal loses the window being recorded")
                continue
            self._previous[signum] = current  # before the handler: a signal may come at once
            try:
                signal.signal(signum, self._handler)
            except (ValueError, OSError) as exc:  # e.g. an embedded interpreter without signals
                self._warn_once(str(signum), f"profiler: cannot handle {signal.Signals(signum).name} ({exc})")
                continue
            self._installed.append(signum)

    def set_sigchld_aside(self) -> None:
        """As a hold begins (every transition, writes included): a DataLoader iterator made after the
        window opened has put torch's SIGCHLD handler over this guard's; set it aside until the hold ends
        (:meth:`release` puts it back).  Two ``signal.signal`` calls, only in that case."""
        if _SIGCHLD is None or not self._installed or self._sigchld_aside is not None:
            return
        current = signal.getsignal(_SIGCHLD)
        if not callable(current) or current == self._handler:
            return  # only a Python handler is ever set aside
        self._sigchld_aside = current
        signal.signal(_SIGCHLD, self._handler)

    def restore(self) -> None:
        """Put back the program's handlers, where ours is still the one installed."""
        installed, self._installed = self._installed, []
        for signum in installed:
            if signal.getsignal(signum) == self._handler:
                signal.signal(signum, self._previous[signum])

    def release(self, restore: bool) -> None:
        """End a hold: put the program's handlers back if ``restore`` (no unsaved steps are left), then
        deliver the held signals, SIGTERM turned into an exception first, to whatever handles them now."""
        reraise = None
        aside, self._sigchld_aside = self._sigchld_aside, None
        if aside is not None and signal.getsignal(_SIGCHLD) == self._handler:
            signal.signal(_SIGCHLD, aside)  # torch's, which calls the handler it found: this guard's
        if restore:
            self.restore()
            reraise, self._reraise = self._reraise, None
        self.holding = False
        pending, self._pending = self._pending, []
        self._signalled_at, self._sigints, self._give_up = None, 0, None
        if reraise == signal.SIGTERM or (signal.SIGTERM in pending
                                         and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
            # The default action ends the process and skips atexit: other writers' files first.  A
            # program's own handler (graceful preemption) may keep training: their files stay open.
            run_before_signal_exit()
        if reraise is not None or pending:
            for stream in (sys.stdout, sys.stderr):  # the default action ends the process without flushing
                try:
                    stream.flush()
                except Exception:  # a closed or broken stream
                    pass
        try:
            for signum in ([reraise] if reraise is not None else []) + pending:
                signal.raise_signal(signum)  # runs the Python handler now; what it raises comes out here
        except BaseException:
            self.stopped_by_signal = True
            raise

    def check(self) -> None:
        """Raise WriteAbandoned if the writer should give up (called between chunks of a write)."""
        if self._give_up is None and self._signalled_at is not None \
                and time.monotonic() - self._signalled_at > DEADLINE_S:
            self._give_up = (f"{DEADLINE_S:g} s passed since the first SIGTERM/SIGINT (DeepSpeed's launcher "
                             f"sends SIGKILL at 30 s)")
        if self._give_up is not None:
            raise WriteAbandoned(self._give_up)

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        held = self.holding or (frame is not None and frame.f_code in _RUN_ENDINGS)
        if signum == _SIGCHLD:
            self._sigchld(signum, frame, held)
            return
        previous = self._previous.get(signum)
        program_handles = callable(previous) and previous is not signal.default_int_handler
        if held and program_handles:
            if signum not in self._pending:
                self._pending.append(signum)  # for the program's handler, once written: no deadline
            return
        if not held and callable(previous):
            try:
                previous(signum, frame)
            except BaseException:
                self.stopped_by_signal = True  # the program's handler ends the run (Python's SIGINT handler does)
                raise
            return  # the program handled it (e.g. a graceful-preemption flag): the run goes on
        self._count(signum)
        if held:
            if signum not in self._pending:
                self._pending.append(signum)
            return
        self.stopped_by_signal = True
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        self._reraise = signum
        raise SystemExit(128 + signum)

    def _sigchld(self, signum: int, frame: Optional[FrameType], held: bool) -> None:
        """Not while writing; otherwise the handler set aside when the window opened.  A handler that
        calls the one it found (torch's does) may lead back here: that call ends here."""
        previous = self._previous.get(signum)
        if held or self._in_sigchld or not callable(previous):
            return
        self._in_sigchld = True
        try:
            previous(signum, frame)
        finally:
            self._in_sigchld = False

    def _count(self, signum: int) -> None:
        """A SIGTERM/SIGINT for this guard: the deadline starts at the first, SIGINTs are counted."""
        if self._signalled_at is None:
            self._signalled_at = time.monotonic()
        if signum == signal.SIGINT:
            self._sigints += 1
            if self._sigints >= _GIVE_UP_SIGINTS:
                self._give_up = f"SIGINT received {self._sigints} times"

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)
