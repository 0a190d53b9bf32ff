"""Signals while a window holds unsaved steps, and while the profiler does its own work: the one owner
of the signal state machine (drawn in docs/profiler.md, "How a signal goes through the profiler").

DeepSpeed's launcher stops a rank with SIGTERM to its whole process tree (DataLoader workers too)
and sends SIGKILL 30 s later; a user stops a job with Ctrl-C (SIGINT).  Python's default SIGTERM
action ends the process on the spot and the steps being recorded would be lost.  So while a window
holds unsaved steps (*armed*), :class:`SignalGuard`'s handler is on SIGTERM and SIGINT, and one with
its usual meaning (SIGTERM's default action, Python's KeyboardInterrupt handler) is *noted* (``stop``:
the step goes on) or, while the profiler works, *held* (``_pending`` while ``holding``, then noted at
:meth:`release`); the next ``step_profiler()`` writes the window (the ``INTERRUPTED`` transition of
:mod:`.run`), then :meth:`release` *delivers* it: SIGTERM with its default action (the process ends
"killed by SIGTERM"), SIGINT as KeyboardInterrupt out of ``step_profiler()``.  Where no boundary comes
in :data:`~.watchdog.GRACE_S`, the handler raises SystemExit(143)/KeyboardInterrupt where the main
thread is (*unwinding*, ``_raised``), the window is written where the profiled block ends, then
delivered (or, where the run's ``ends_here`` can end it where the main thread is, an attached engine's
run between the engine's steps, written there and delivered).  From *noted* or *held*, the watchdog
(:mod:`.watchdog`, owned by this module: it knows the guard only as a :class:`~.watchdog.Watched`) ends
the process :data:`~.watchdog.DEADLINE_S` after the first SIGTERM/SIGINT, or at the third SIGINT, even
with the main thread stuck.  A handler the program
installed itself is called at once instead (graceful preemption); an ignored signal stays ignored; a
handler installed outside Python is left alone (one warning).  The program's own cleanup (``finally``
blocks, checkpoint saves, barriers) runs after the window is on disk.

While the profiler does its own work, every signal that has a Python handler -- SIGCHLD of torch's
DataLoader, a program's SIGUSR1 or SIGALRM, SIGTERM and SIGINT -- is *held* and delivered when the work
is done, as Python delivers signals: the handlers run in signal-number order and what they raise
comes out of ``step_profiler()``.  So no program handler runs inside the profiler, where what it
raised would be taken for a profiler failure.  From a noted SIGTERM/SIGINT until the window is
written, the other handlers are held too (a DataLoader worker killed by the launcher with the rank
must not raise into the step before the window is on disk).

The CPython mechanisms, each kept because it is the plainest one that meets a guarantee:

* *an empty Python call* (:func:`_run_tripped_handlers`): CPython runs tripped handlers when a call
  begins, so what they raise comes out at a known point of :meth:`release`, the guard's state settled;
* ``_thread.interrupt_main(signum)`` delivers a held signal: it trips the signal exactly as its
  arrival does and runs no handler, so all held signals are tripped first and then run in Python's
  order, the others still running at the next check where one raises (``signal.raise_signal`` would
  run each handler at once, and a raising one would stop the rest; calling handlers ourselves would
  copy Python's ordering and frames badly).  SIG_DFL has no Python handler to trip: it is raised;
* *a registry of code objects* (:func:`ends_a_run`): the interpreter itself calls a profiled block's
  ``__exit__``, and a pending signal may be handled at its first instruction, before it can begin
  holding; the handler's ``frame`` tells it so, which no flag set beforehand can;
* :func:`.calls.raised_by_signal_handler` tells a program's handler's exception in a listener by its
  traceback; delivered signals keep that true, as they run the program's handlers in Python's frames.

Giving the handlers back never loses a signal: ``holding`` stays set until they are back, so one that
arrives meanwhile is pended, and the pending ones are taken after the give-back until none is left.  A
program that catches the SystemExit or KeyboardInterrupt and goes on leaves nothing armed: the next
``step_profiler()`` (or the block's end) clears it.  Handlers are installed only on the main thread,
put back only where this guard's is still installed, and a process forked meanwhile (a DataLoader
worker) gets the program's handlers back at once.  No path here takes a lock.
"""
from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
from types import CodeType, FrameType
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, TypeVar

from .._signal_exit import run_before_signal_exit
from ..logging import logger
from .watchdog import WATCHDOG

__all__ = ["SignalGuard", "ends_a_run"]

_STOPPING = (signal.SIGTERM, signal.SIGINT)
_HOLDABLE = tuple(sorted(set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}))

F = TypeVar("F", bound=Callable[..., Any])
_RUN_ENDINGS: Set[CodeType] = set()
_installed: Optional["SignalGuard"] = None  # the guard whose handler is installed somewhere, for a fork


def ends_a_run(function: F) -> F:
    """Mark a function the interpreter calls as a profiled block ends (a context manager's ``__exit__``).

    A pending signal may be handled at the very first instruction of such a function, before it can
    begin holding; one handled anywhere in a marked function is held as if it had.
    """
    _RUN_ENDINGS.add(function.__code__)
    return function


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _program_handles(handler: Any) -> bool:
    """True for a handler of the program's own (not Python's KeyboardInterrupt one, not SIG_DFL)."""
    return callable(handler) and handler is not signal.default_int_handler


def _run_tripped_handlers() -> None:
    """A Python call: the handlers of tripped signals run as it begins, and what they raise comes out here."""


def _as_before(handler: Any, signum: int, frame: Optional[FrameType]) -> None:
    """Do what ``handler`` (a disposition this guard replaced and gave back) does with ``signum``."""
    if callable(handler):
        handler(signum, frame)
    elif handler != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)


class SignalGuard:
    """The signal handling of one profiled run (see the module doc)."""

    def __init__(self) -> None:
        self.holding = False
        self.stop: Optional[int] = None  # a noted SIGTERM/SIGINT the next step boundary acts on
        self.stopped_by_signal = False  # a SIGTERM/SIGINT was delivered as an exception into the run (never reset)
        self.activity = "recording"  # what the profiler is doing, for the watchdog's last line
        self.label = f"pid {os.getpid()}"  # who this is, for the same line (the rank once known)
        self._handler = self._handle  # one bound method, so "is ours still installed" is an equality test
        self._window: Dict[int, Any] = {}  # SIGTERM/SIGINT -> the program's handler, while the window is armed
        self._aside: Dict[int, Any] = {}  # other signals -> the program's handler, while held
        self._given_back: Dict[int, Any] = {}  # what the window replaced, for handlers that still chain to ours
        self._pending: List[int] = []
        self._unwind: Optional[int] = None  # the watchdog asks: raise for this signal when it comes
        self._raised: Optional[Tuple[BaseException, int]] = None  # raised by the handler, not yet dealt with
        self._owes_resolution = False  # the handler saw a SIGTERM/SIGINT the watchdog has not been told about
        self._warned: Set[str] = set()
        # set by a run an engine drives: at the grace's end, ends the run in the frame given (True: window written)
        self.ends_here: Optional[Callable[[Optional[FrameType]], bool]] = None

    # ---- what the run asks ---------------------------------------------------------------------

    @property
    def interrupted(self) -> bool:
        """True once a SIGTERM/SIGINT with its usual meaning (not the program's handler's) arrived that the run
        has not finished dealing with: the process is being stopped."""
        return self.stop is not None or self._raised is not None or any(map(self._stops, self._pending))

    def _stops(self, signum: int) -> bool:
        """Whether ``signum`` stops the process: a SIGTERM/SIGINT whose handler is not the program's own."""
        return signum in _STOPPING and not _program_handles(self._window.get(signum, self._aside.get(signum)))

    @property
    def unwinding(self) -> bool:
        """The handler raised SystemExit/KeyboardInterrupt, and the run has not seen where it went."""
        return self._raised is not None

    @property
    def raised_exception(self) -> Optional[BaseException]:
        """The SystemExit/KeyboardInterrupt the handler raised for a signal, while the program unwinds from it."""
        return None if self._raised is None else self._raised[0]

    def doing(self) -> str:
        """What keeps the signal held, for the watchdog's last line."""
        if self._raised is not None:
            return "the program's cleanup, unwinding from the exception raised for it, has not ended"
        return self.activity

    def holds(self, signum: int) -> bool:
        """Whether ``signum`` arriving now is held: this guard's handler is the one installed for it (a handler the
        program put over it during the window gets the signal instead), and notes or pends it rather than calling
        the program's own at once (asked by the watchdog, which keeps a deadline for what is held only)."""
        installed = (signum in self._window or signum in self._aside) and signal.getsignal(signum) == self._handler
        return installed and (self.holding or signum in self._aside or self._stops(signum))

    def saw_stopping_signal(self) -> bool:
        """The handler ran for a SIGTERM/SIGINT not yet resolved (False: the main thread has not run it yet)."""
        return self._owes_resolution or self.interrupted

    def waiting_for_boundary(self) -> bool:
        """A noted SIGTERM/SIGINT waits for the next step boundary (asked by the watchdog)."""
        return self.stop is not None and not self.holding and self._raised is None

    def request_unwind(self) -> Optional[int]:
        """The watchdog gives up waiting for a boundary: the handler raises when the signal comes again."""
        self._unwind = self.stop
        return self._unwind

    # ---- driven by the run ---------------------------------------------------------------------

    @ends_a_run
    def hold(self) -> None:
        """The profiler begins its own work: every signal with a Python handler waits until :meth:`release`."""
        self.holding = True
        if _on_main_thread():
            self._set_aside_python_handlers()

    def arm(self) -> None:
        """A window begins holding unsaved steps (called inside a hold): the handler goes on SIGTERM/SIGINT."""
        if not _on_main_thread():
            self._warn_once("thread", "profiler: running outside the main thread, where Python allows no signal "
                            "handlers: a SIGTERM or SIGINT while a window is recorded loses that window's steps")
            return
        for signum in _STOPPING:
            if signum in self._aside:  # the program's Python handler, already set aside by the hold
                self._window[signum] = self._aside.pop(signum)
                continue
            current = signal.getsignal(signum)
            if current == signal.SIG_IGN:
                continue  # an ignored signal stays ignored
            if current is None:
                self._warn_once(str(signum), f"profiler: {signal.Signals(signum).name} has a handler installed "
                                "outside Python, which is left in place: that signal loses the window being recorded")
                continue
            self._window[signum] = current  # before the handler: a signal may come at once
            signal.signal(signum, self._handler)
        if self._window:
            self._note_installed()
            WATCHDOG.install(self)

    def went_on(self) -> None:
        """The program caught the exception the handler raised and reached a step boundary: nothing stays armed."""
        self._raised = None

    def release(self, recording: bool, passing: Optional[BaseException] = None) -> None:
        """The profiler's work is done: give back what was held and deliver what is due.

        ``recording``: the window still holds unsaved steps (a noted SIGTERM/SIGINT then waits for the
        next step boundary, the handler stays on them).  Otherwise the window is disarmed, and the
        noted signal is delivered too; ``passing`` is the exception leaving the profiled block, and if
        it is the SystemExit this guard raised for a SIGTERM, SIGTERM is raised again with its default
        action.

        The order closes a race: ``holding`` stays set while the program's handlers are given back, so a
        signal arriving meanwhile (it still finds this guard's handler) is only added to the pending
        ones, and those are taken after the give-back, again until none is left.  A signal arriving later
        finds the program's handler itself.
        """
        due: List[int] = []
        if recording:
            self._note_pending_stop()  # before the give-back: a noted stop keeps the other handlers held
        else:
            if self.stop is not None:
                due.append(self.stop)
                self.stop = None
            if passing is not None and self._raised is not None and passing is self._raised[0] \
                    and self._raised[1] == signal.SIGTERM:
                due.insert(0, signal.SIGTERM)
            self._raised = None
        if not self._stopping():
            self._give_back(self._aside)
        if not recording:
            self._disarm()
        self.holding = False
        while True:
            due += self._take_pending(recording)
            self._resolve_if_free()
            if not due:
                return
            self._deliver(list(dict.fromkeys(due)))
            due = []

    def _note_pending_stop(self) -> None:
        """A held SIGTERM/SIGINT with its usual meaning becomes the noted stop (the next boundary acts on it)."""
        if self.stop is None:
            for signum in self._pending:
                if signum in self._window and self._stops(signum):
                    self._pending.remove(signum)
                    self.stop = signum
                    return

    def _take_pending(self, recording: bool) -> List[int]:
        """The held signals to deliver now; none while a window still holds a noted stop (they wait for it)."""
        if recording:
            self._note_pending_stop()
            if self._stopping():
                self._set_aside_python_handlers()  # a stop noted only now: nothing else may raise into the step
                return []
        due, self._pending = self._pending, []
        return due

    # ---- the handler ---------------------------------------------------------------------------

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if signum in _STOPPING:
            self._owes_resolution = True
        if signum in self._aside or self.holding or (frame is not None and frame.f_code in _RUN_ENDINGS):
            if signum not in self._pending:
                self._pending.append(signum)
            return
        handler = self._window.get(signum)
        if handler is None:  # called by a handler that was put over ours and chains to it
            _as_before(self._given_back.get(signum, signal.SIG_DFL), signum, frame)
            return
        if _program_handles(handler):
            self._resolve_if_free()  # the program's, not held: its handler may take as long as it likes
            handler(signum, frame)
            return
        if self._unwind == signum and self.stop == signum:
            self._unwind = None
            if self.ends_here is not None and self.ends_here(frame):
                return  # a SIGTERM ended the process in there; a SIGINT's KeyboardInterrupt came out of it
            self.stop = None
            exc: BaseException = KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(128 + signum)
            self._raised, self.stopped_by_signal = (exc, signum), True
            raise exc
        if self.stop is None:
            self.stop = signum
            self._set_aside_python_handlers()  # stopping: nothing else may raise into the step
        elif signum != self.stop and signum not in self._pending:
            self._pending.append(signum)  # a SIGTERM after a noted SIGINT (or the reverse): delivered too

    # ---- helpers -------------------------------------------------------------------------------

    def _stopping(self) -> bool:
        return self.stop is not None or self._raised is not None

    def _set_aside_python_handlers(self) -> None:
        for signum in _HOLDABLE:
            if signum in self._window:
                continue
            current = signal.getsignal(signum)
            if callable(current) and current != self._handler:
                self._aside[signum] = current
                signal.signal(signum, self._handler)
        if self._aside:
            self._note_installed()
        if signal.SIGTERM in self._aside or signal.SIGINT in self._aside:
            WATCHDOG.install(self)

    def _note_installed(self) -> None:
        global _installed
        _installed = self

    def _give_back(self, handlers: Dict[int, Any]) -> None:
        """Put the program's handlers back, where ours is still the one installed."""
        for signum, handler in handlers.items():
            if signal.getsignal(signum) == self._handler:
                signal.signal(signum, handler)
        handlers.clear()

    def _disarm(self) -> None:
        global _installed
        if self._window:
            self._given_back.update(self._window)
            self._give_back(self._window)
        if not self._aside:
            if WATCHDOG.guard is self:
                WATCHDOG.uninstall(self)
            if _installed is self:
                _installed = None

    def _resolve_if_free(self) -> None:
        """Tell the watchdog when no SIGTERM/SIGINT the handler saw is held any longer."""
        if self._owes_resolution and not self._stopping() and not any(s in _STOPPING for s in self._pending):
            WATCHDOG.resolved()  # before the flag is cleared: the watchdog reads the flag, then the pipe
            self._owes_resolution = False

    def _deliver(self, due: List[int]) -> None:
        """Deliver held signals to the handlers installed now, as Python would have."""
        if not due:
            return
        for signum in due:
            if signal.getsignal(signum) == signal.SIG_DFL:  # a SIGTERM/SIGINT the window held: the process ends
                self.stopped_by_signal = True
                # The default action skips atexit: other writers' files first.  (A program's own handler,
                # graceful preemption, may keep training: their files stay open.)
                run_before_signal_exit()
                for stream in (sys.stdout, sys.stderr):  # nor does it flush
                    try:
                        stream.flush()
                    except Exception:  # a closed or broken stream
                        pass
                signal.raise_signal(signum)
        if any(signal.getsignal(signum) is signal.default_int_handler for signum in due):
            self.stopped_by_signal = True
        # Trip them all first (interrupt_main runs no handler; map calls it from C, so no handler runs between
        # two calls either), then let Python run the handlers: in signal-number order, and where one raises,
        # the others still run at the next check, as with signals that arrive together.
        list(map(_thread.interrupt_main, due))
        try:
            _run_tripped_handlers()
        except BaseException:
            self.stopped_by_signal = True
            raise

    def forget_in_child(self) -> None:
        """In a process just forked: the program's handlers, nothing held, nothing armed."""
        try:
            for handlers in (self._aside, self._window):
                self._give_back(handlers)
        except ValueError:  # forked from a thread other than the main one
            pass
        self.holding, self.stop, self._raised, self._pending = False, None, None, []

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)


def _forget_in_child() -> None:
    global _installed
    if _installed is not None:
        _installed.forget_in_child()
        _installed = None
    WATCHDOG.forget_in_child()


os.register_at_fork(after_in_child=_forget_in_child)
