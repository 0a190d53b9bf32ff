"""The deadline of a held SIGTERM/SIGINT, kept by a thread that does not wait for the main thread.

CPython runs Python signal handlers on the main thread only, between bytecodes.  A main thread stuck
in a call that does not return (torch.profiler's stop synchronizes the device; a collective waits for
a dead peer) runs none, so a profiler that holds SIGTERM and SIGINT while it writes could hold them
for ever.  But CPython's C-level handler, run in whatever thread the kernel chose, also writes the
signal's number to the wakeup fd (``signal.set_wakeup_fd``).  While the signal guard (:mod:`.signals`,
which owns this watchdog) has its handler installed, that fd is a pipe that this module's thread
reads, and the thread:

* starts a clock at the first SIGTERM/SIGINT the guard holds, and at :data:`DEADLINE_S`
  ends the process with ``os._exit(128 + signum)`` after one line on stderr saying why;
* ends it at once, with exit status 130, at the third SIGINT held (Ctrl-C pressed three times);
* after :data:`GRACE_S` without a step boundary, asks the main thread to unwind: it sends the signal
  again to the main thread alone (``signal.pthread_kill``, which also interrupts a blocking system
  call such as a sleep), and the guard's handler then raises SystemExit or KeyboardInterrupt;
* after :data:`GRACE_S` with the handler not yet run, sends the main thread the signal first: the
  kernel gives a process's signal to any of its threads that does not block it (a torch or gloo
  thread, this one), the C-level handler runs there, and a main thread blocked in a sleep or a wait
  runs the Python handler only when that call returns, if ever;
* passes every byte on to the wakeup fd the program had set (asyncio's), if any.

The main thread writes a 0 byte into the same pipe once it has dealt with every SIGTERM/SIGINT its
handler saw (delivered them, handed them to the program's handler, or seen the program go on after
the exception).  A pipe keeps order, so the 0 comes after the bytes of those signals, and the clock
stops there; a signal the main thread has not seen (it is stuck) keeps the clock running.  Only a
held signal starts the clock: one the guard hands at once to a handler of the program's (graceful
preemption) has no deadline, as without the profiler.  (Where another thread took the signal,
CPython marks it pending before it writes the byte, so a busy main thread may note it first; a
noted signal stays unresolved until it is delivered, so its clock still runs.)

The thread takes no lock and never waits for the main thread.  It does need the GIL: a call that
blocks while holding the GIL stops it too (torch's waits on the device and on collectives release
it); only the launcher's SIGKILL ends such a process.
"""
from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from typing import Dict, Optional, Protocol

__all__ = ["DEADLINE_S", "GRACE_S", "WATCHDOG", "Watched", "Watchdog"]

DEADLINE_S = 25.0
"""Seconds from the first held SIGTERM/SIGINT to the end of the process: DeepSpeed's launcher, SLURM and
Kubernetes send SIGKILL after 30 s, and a rank that ends itself first can say why.  Read when used, so a
test (or a job with another kill timeout) can set it."""
GRACE_S = 5.0
"""Seconds a noted SIGTERM/SIGINT waits for the next ``step_profiler()`` (where the window is written
before anything else runs) before the main thread is made to unwind instead."""
_GIVE_UP_SIGINTS = 3
_RESOLVED = 0  # the byte the main thread writes: every signal before it is dealt with
_STOPPING = frozenset({signal.SIGTERM, signal.SIGINT})
_FLUSH_WAIT_S = 1.0
_END_WAIT_S = 1.0  # the thread's end, awaited at uninstall
_POLL_S = 0.25  # while the clock runs: the guard's state (waiting for a boundary or not) changes without a byte


class Watched(Protocol):
    """What the watchdog asks of the holder of the signals it watches (:class:`~.signals.SignalGuard`, which
    owns the state machine and this watchdog: the watchdog only keeps time and acts when it runs out)."""

    label: str  # who this is, for the last line

    def holds(self, signum: int) -> bool:
        """Whether ``signum`` arriving now is held (noted or pended by the holder's handler), not handed at once to a
        handler of the program's: only a held signal has a deadline."""

    def waiting_for_boundary(self) -> bool:
        """A noted SIGTERM/SIGINT waits for the next step boundary."""

    def request_unwind(self) -> Optional[int]:
        """Give up waiting for the boundary: the signal to send again, for the handler to raise; None if none."""

    def doing(self) -> str:
        """What keeps the signal held, for the last line."""

    def saw_stopping_signal(self) -> bool:
        """The main thread has run the handler for a SIGTERM/SIGINT it has not yet resolved."""


def _flush_standard_streams() -> None:
    """Flush stdout and stderr, giving up after a second: their locks may be held by the stuck thread."""

    def flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed or broken stream
                pass

    flusher = threading.Thread(target=flush, name="ds_profutils-flush", daemon=True)
    flusher.start()
    flusher.join(_FLUSH_WAIT_S)


class Watchdog:
    """The process's one watchdog: its pipe, its thread, and the guard it watches."""

    def __init__(self) -> None:
        self._read = self._write = -1
        self._thread: Optional[threading.Thread] = None
        self._chained = -1  # the program's wakeup fd while ours is installed
        self._installed = False
        self._generation = 0  # a thread runs while its generation is the current one (uninstall moves it on)
        self._thread_generation = 0  # the generation of ``_thread``
        self._uninstalling = False  # signal handlers' installs wait for its end
        self.guard: Optional[Watched] = None
        # Kept by the watchdog thread only:
        self._first_at: Optional[float] = None
        self._signum = 0
        self._sigints = 0
        self._unwind_sent = False
        self._main_thread_sent = False
        self._own: Dict[int, int] = {}  # signals it sent itself, whose bytes are not counted

    # ---- called by the main thread -------------------------------------------------------------

    def install(self, guard: Watched) -> None:
        """Watch ``guard``; route the wakeup bytes to this watchdog (keeping the program's fd chained)."""
        self.guard = guard
        if self._uninstalling or self._installed:  # a signal handler's during an uninstall: installed as that ends
            return
        if self._read < 0:
            self._read, self._write = os.pipe()
            os.set_blocking(self._read, False)
            os.set_blocking(self._write, False)  # set_wakeup_fd requires it
        previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._chained = previous if previous != self._write else -1
        self._installed = True
        if self._thread is None or self._thread_generation != self._generation:
            self._reset()  # no clock of an earlier window's carries over
            self._thread_generation = self._generation
            self._thread = threading.Thread(target=self._loop, args=(self._generation, ),
                                            name="ds_profutils-signal-watchdog", daemon=True)
            self._thread.start()

    def uninstall(self, guard: Watched) -> None:
        """Stop watching ``guard`` and give the program its wakeup fd back; the clock stops, and the thread ends with
        its pipe (nothing of ours is left between windows: the next window's install starts them again).  Signal
        handlers may run inside it: one that installs (a program's that starts a profiled call) is installed as it
        ends; one that uninstalls again only lets go of its guard."""
        if self._uninstalling:  # a signal handler's, inside an uninstall: it only lets go of its guard
            if self.guard is guard:
                self.guard = None
            return
        self._uninstalling = True  # first: a handler's install from here on is one this uninstall leaves in place
        if self.guard is guard:
            self.guard = None
        try:
            if self._installed:
                self._installed = False
                current = signal.set_wakeup_fd(self._chained)
                if current != self._write:  # the program set its own meanwhile: that one stays
                    signal.set_wakeup_fd(current)
            self._generation += 1  # the thread's: it ends at its next byte, and the next install starts another
            self.resolved()  # that byte
            thread = self._thread
            if thread is not None and thread is not threading.current_thread():
                thread.join(_END_WAIT_S)
                if not thread.is_alive():  # else (starved of the GIL for a second) the next uninstall tries again
                    self._thread = None
                    self._drain()
                    os.close(self._read)
                    os.close(self._write)
                    self._read = self._write = -1
        finally:
            self._uninstalling = False
        if self.guard is not None:  # a signal handler's install meanwhile
            self.install(self.guard)

    def _drain(self) -> None:
        """The bytes the ended thread left unread (a signal's, just before the uninstall's) go on to the program's
        wakeup fd, as the thread would have passed them."""
        while True:
            try:
                data = os.read(self._read, 4096)
            except OSError:  # BlockingIOError: none left
                return
            if not data:
                return
            self._forward(data)

    def resolved(self) -> None:
        """Every SIGTERM/SIGINT the main thread has seen is dealt with (the clock stops at this byte)."""
        if self._write >= 0:
            try:
                os.write(self._write, bytes([_RESOLVED]))
            except OSError:  # the pipe is full: the watchdog is far behind, and catches up on the guard's state
                pass

    def forget_in_child(self) -> None:
        """In a process just forked (a DataLoader worker): no thread, no pipe of the parent's, no wakeup fd."""
        if self._installed:
            try:
                signal.set_wakeup_fd(self._chained)
            except ValueError:  # forked from a thread other than the main one
                pass
        for fd in (self._read, self._write):
            if fd >= 0:
                os.close(fd)
        self._read = self._write = self._chained = -1
        self._thread, self._installed, self.guard = None, False, None
        self._reset()

    # ---- the watchdog thread -------------------------------------------------------------------

    def _loop(self, generation: int) -> None:
        while generation == self._generation:
            try:
                self._take(self._timeout(), generation)
                self._on_clock(generation)
            except Exception as exc:  # never let the thread die: the next hold would have no deadline
                self._say(f"ds_profutils: the signal watchdog failed ({type(exc).__name__}: {exc}); it goes on\n")
                time.sleep(0.1)

    def _take(self, timeout: Optional[float], generation: int) -> None:
        """Read the bytes written to the pipe (waiting up to ``timeout``) and act on each; a thread of an earlier
        generation reads none (they are the next thread's)."""
        ready, _, _ = select.select([self._read], [], [], timeout)
        data = b""
        if ready and generation == self._generation:
            try:
                data = os.read(self._read, 4096)
            except BlockingIOError:
                pass
        self._forward(data)
        for byte in data:
            self._on_byte(byte)

    def _timeout(self) -> Optional[float]:
        if self._first_at is None:
            return None
        return max(0.0, min(_POLL_S, DEADLINE_S - (time.monotonic() - self._first_at)))

    def _forward(self, data: bytes) -> None:
        chained = self._chained
        data = data.replace(bytes([_RESOLVED]), b"")
        if chained >= 0 and data:
            try:
                os.write(chained, data)
            except OSError:  # full or closed: the program's loop would have lost them too
                pass

    def _on_byte(self, byte: int) -> None:
        if byte == _RESOLVED:
            self._reset()
            return
        if self._own.get(byte):  # sent by this thread: never a new signal, whoever handled it since
            self._own[byte] -= 1
            return
        guard = self.guard
        if byte not in _STOPPING or guard is None or not guard.holds(byte):
            return
        if self._first_at is None:
            self._first_at, self._signum = time.monotonic(), byte
        if byte == signal.SIGINT:
            self._sigints += 1
            if self._sigints >= _GIVE_UP_SIGINTS:
                self._end(signal.SIGINT, f"SIGINT received {self._sigints} times")

    def _on_clock(self, generation: int) -> None:
        if self._first_at is None:
            return
        guard = self.guard
        if guard is None:  # the run let go of its handlers: what it held was delivered
            self._reset()
            return
        elapsed = time.monotonic() - self._first_at
        name = signal.Signals(self._signum).name
        if elapsed >= DEADLINE_S:
            self._end(self._signum, f"{name} arrived {elapsed:.0f} s ago and the profiler still holds it "
                      f"({guard.doing()})")
        elif elapsed >= GRACE_S and not self._unwind_sent and guard.waiting_for_boundary():
            self._unwind_sent = True
            signum = guard.request_unwind()
            if signum is not None:  # None: the boundary came meanwhile
                self._send_to_main_thread(signum)
        elif elapsed >= GRACE_S and not self._main_thread_sent and not guard.saw_stopping_signal():
            # The pipe after the flag: a signal seen and resolved meanwhile left its resolution's byte there (the
            # guard writes it before clearing the flag), and the clock stops at it.
            started = self._first_at
            self._take(0.0, generation)
            if self._first_at == started and self.guard is guard and guard.holds(self._signum):
                self._main_thread_sent = True
                self._send_to_main_thread(self._signum)

    def _send_to_main_thread(self, signum: int) -> None:
        """Interrupt what the main thread waits in and run its handler for ``signum`` (a byte not counted)."""
        self._own[signum] = self._own.get(signum, 0) + 1
        signal.pthread_kill(threading.main_thread().ident, signum)

    def _reset(self) -> None:
        """Nothing is held any longer: the clock stops.  A byte of a signal this thread sent comes before the
        resolution that follows its handling, so none is still awaited."""
        self._first_at, self._sigints = None, 0
        self._unwind_sent = self._main_thread_sent = False
        self._own.clear()

    def _end(self, signum: int, reason: str) -> None:
        """End the process now: the main thread cannot be waited for."""
        status = 128 + signum
        guard = self.guard
        who = guard.label if guard is not None else f"pid {os.getpid()}"
        _flush_standard_streams()
        self._say(f"ds_profutils: {who}: {reason}; ending the process now with exit status {status} (cycles "
                  f"finished before are on disk)\n")
        os._exit(status)

    @staticmethod
    def _say(line: str) -> None:
        try:
            os.write(2, line.encode(errors="replace"))
        except OSError:
            pass


WATCHDOG = Watchdog()
