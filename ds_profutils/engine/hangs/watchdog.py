"""The hang watchdog: one daemon thread per process that writes ``hang_rank_{r}.json`` when no optimizer step
of any attached engine has ended for ``step_metrics.hang_timeout_s`` seconds.

A hung job's ranks sit in a collective until the process-group timeout (DeepSpeed's default: 10 minutes)
and then die naming nobody.  Each rank's watchdog writes, before that, where it is: its engines' global
step and phase, the collective it is inside (with its sequence number on its group, :mod:`.sequence`) and
every thread's stack (:mod:`.hang_file`); the report lines the ranks' files up and names the rank that
never arrived.

The step path pays one timestamp per optimizer step (:meth:`Watchdog.beat`, from :class:`EngineWatch`, told
of the engine's optimizer steps by its hooks).  The thread wakes about once a second; when it writes, it reads
the engine's global step, the phase its hooks keep (:attr:`..hooks.EngineHooks.phase`, a few attribute writes
on the step path) and the collective wrappers' markers, and touches no device, no collective and no lock
the step path takes; it writes the file again every timeout while stuck, and once more, saying
``resolved`` and how long the step took, if the step ends after all (also just before the job closes: closing
the last engine waits for the thread's last look).  Where the program itself closes its last engine with no step
since, the file says so once more (``closed_after_s``): a long evaluation or save after the last step, or a hang the
program stopped waiting for (a caught Ctrl-C or timeout) -- the report tells the reader which it cannot; not where
an exception is in flight, an uncaught one or a SIGTERM ends the job (a hung job is ended so).  The thread ends
when the last watched engine is closed or collected.
"""
from __future__ import annotations

import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Dict, List, Optional, Set

from ..._signal_exit import close_at_exit, ending_on_signal
from ...logging import logger, warning_once
from ...outputs import ProcessIdentity, hang_file, process_identity
from ..hooks import BETWEEN_STEPS, EngineHooks, OptimizerStepListener
from .hang_file import hang_content, write_hang_file

__all__ = ["POLL_SECONDS", "EngineWatch", "Watchdog", "watch_engine"]

POLL_SECONDS = 1.0
"""How often the thread looks: a hang is written at most this late after its timeout."""
JOIN_SECONDS = 5.0
"""How long closing the last engine waits for the thread's last look (a hang file being written ends first)."""


class Watchdog:
    """The process's one watchdog thread and the engines it watches (weakly: a dropped engine is not kept)."""

    def __init__(self, identity: ProcessIdentity, training_thread: int) -> None:
        self.identity = identity
        self.training_thread = training_thread
        self.watches: "weakref.WeakSet[EngineWatch]" = weakref.WeakSet()
        self.beat_at = time.monotonic()  # the last optimizer step's end (or the start), written by the step path
        self._stuck_since: Optional[float] = None  # the thread's: the beat a hang file was written for, or None
        self._writes = 0  # the files written for it
        self._stuck: Dict[Path, Dict[str, Any]] = {}  # per directory, the last of them written there (an engine
        # closed since still has its file there, naming it)
        self.closed_by_program = False  # the last engine was closed by the program itself (_program_closes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ds_profutils-hang-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def beat(self) -> None:
        """An optimizer step ended (the step path's one write)."""
        self.beat_at = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def join(self) -> None:
        """Wait (a bounded while) for the stopped thread's last look: a step that ended just before the last engine
        closed is written resolved before the process may end (the thread is a daemon)."""
        if self._thread is not threading.current_thread() and self._thread.is_alive():
            self._thread.join(JOIN_SECONDS)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        written_at = 0.0
        # the engines of the last look, held weakly between looks (a strong list kept every watch of a collected
        # engine in the set: the thread never ended, and wrote a hang of the engine gone); the last file names them
        looked: List["weakref.ReferenceType[EngineWatch]"] = []
        while not self._stop.wait(POLL_SECONDS):
            try:
                with _lock:  # attach and close change the set; the step path never takes this lock
                    watches = list(self.watches)
            except RuntimeError:  # an engine collected while copied (the set's own callback): look again
                continue
            if not watches:
                if self._ended():
                    break
                continue  # an engine attached meanwhile: the next look has it
            looked = [weakref.ref(watch) for watch in watches]
            try:
                self._resolve(watches)
                beat, now = self.beat_at, time.monotonic()
                timeout = min(watch.timeout_s for watch in watches)
                if now - beat >= timeout and (self._stuck_since is None or now - written_at >= timeout):
                    self._writes += 1
                    self._stuck_since = beat  # before the write: an attach meanwhile sees the hang and beats not
                    self._write(watches, beat, self._writes)
                    written_at = now
            except Exception as exc:  # noqa: BLE001 - the watchdog never stops the job; it says so once
                _said(exc)
            del watches
        try:  # a step that ended just before the last engine closed (no later look comes), or the close itself
            self._resolve([watch for watch in (ref() for ref in looked) if watch is not None],
                          closed=self.closed_by_program)
        except Exception as exc:  # noqa: BLE001
            _said(exc)
        _forget(self)

    def _resolve(self, watches: List["EngineWatch"], closed: bool = False) -> None:
        """Where a hang file was written and an optimizer step has ended since, write it once more, resolved; also
        where the program has ``closed`` its last engine meanwhile, said as such (not a step: the wait ended there,
        for a reason the watchdog cannot see).  Written into every directory the hang went to that is still there
        (an engine closed or collected since included), each from its own last file, where the rank waited; the
        wait is over whether or not each write succeeds."""
        beat, stuck_since, stuck = self.beat_at, self._stuck_since, self._stuck
        if stuck_since is None:
            return
        now = time.time()
        if beat != stuck_since:
            after = beat - stuck_since
            ending = {"resolved": True, "resolved_after_s": after}
            watched = {watch.output_dir for watch in watches}
            fresh = self._content(watches, stuck_since, self._writes, resolved_after_s=after) if watches else None
            said = "the step ended after all, %.0f s after the one before (%s says resolved)"
        elif closed:
            after = time.monotonic() - stuck_since
            ending, watched, fresh = {"closed_after_s": after}, set(), None
            said = ("the program closed the engine %.0f s after the last step, with no step since (%s says so: a long "
                    "evaluation or save, or a hang it stopped waiting for)")
        else:
            return
        self._stuck_since, self._writes, self._stuck = None, 0, {}
        contents = {directory: fresh if directory in watched else  # (watched is empty where fresh is None)
                    {**content, "time": now, **ending}
                    for directory, content in stuck.items() if directory.is_dir()}
        logger.warning("ds_profutils: " + said, after, self._write_files(contents))

    def _ended(self) -> bool:
        """Whether no engine is watched (the last closed or collected): then the thread ends, and no watch is
        added to it any more (:func:`watch_engine` starts another)."""
        with _lock:
            if self.watches:
                return False
            self._stop.set()
            return True

    def _content(self, watches: List["EngineWatch"], beat: float, writes: int,
                 resolved_after_s: Optional[float] = None) -> Dict[str, Any]:
        since = time.time() - (time.monotonic() - beat)
        return hang_content(self.identity, [watch.where() for watch in watches],
                            timeout_s=min(watch.timeout_s for watch in watches), since=since,
                            training_thread=self.training_thread,
                            cuda_device=next((w.cuda_device for w in watches if w.cuda_device is not None), None),
                            writes=writes, resolved_after_s=resolved_after_s)

    def _write(self, watches: List["EngineWatch"], beat: float, writes: int) -> None:
        """The hang file of a wait going on since ``beat``, into every watched engine's output_dir."""
        content = self._content(watches, beat, writes)
        contents = {watch.output_dir: content for watch in watches}
        path = self._write_files(contents)
        self._stuck.update(contents)
        logger.warning("ds_profutils: no optimizer step has ended for %.0f s on rank %d; where it is: %s",
                       content["stuck_s"], self.identity.rank, path)

    def _write_files(self, contents: Dict[Path, Dict[str, Any]]) -> str:
        """Write each directory's content on its own (one that cannot be written keeps none of the others from
        theirs); where the first went, for the log line."""
        written = []
        for output_dir, content in sorted(contents.items()):
            try:
                written.append(write_hang_file(output_dir, self.identity, content))
            except OSError as exc:
                _said(exc)
        _written_here.update(written)
        return str(written[0]) if written else "no file, none could be written"


def _said(exc: Exception) -> None:
    warning_once(f"ds_profutils: the hang watchdog could not write its file ({type(exc).__name__}: {exc}); training "
                 "goes on")


_lock = threading.Lock()  # taken at attach and close, and by the thread as it ends; never on the step path
_written_here: Set[Path] = set()  # the hang files this process wrote (kept at a re-attach: this job's own)
_watchdog: Optional[Watchdog] = None


def _forget(watchdog: Watchdog) -> None:
    global _watchdog
    with _lock:
        if _watchdog is watchdog:
            _watchdog = None


class EngineWatch(OptimizerStepListener):
    """One engine watched: the heartbeat at each of its optimizer steps' end; its global step and the phase its
    ``hooks`` keep, read when a file is written."""

    def __init__(self, hooks: EngineHooks, name: str, output_dir: Path, timeout_s: float, watchdog: Watchdog) -> None:
        engine = hooks.engine
        super().__init__(engine)  # held weakly, as the hooks hold it
        self._hooks = weakref.ref(hooks)
        self.name = name
        self.output_dir = output_dir
        self.timeout_s = timeout_s
        device = getattr(engine, "device", None)
        self.cuda_device: Optional[int] = device.index if getattr(device, "type", None) == "cuda" else None
        self._watchdog = watchdog
        self._forget_at_exit = close_at_exit(self.close)  # a job ending without close(): its wait's end said too

    def optimizer_step_ended(self, global_step: int) -> None:
        self._watchdog.beat()

    def where(self) -> Dict[str, Any]:
        """The engine's name, global step and phase now (read from the watchdog's thread)."""
        hooks = self._hooks()
        return {"name": self.name, "global_step": self._global_steps(),
                "phase": hooks.phase if hooks is not None else BETWEEN_STEPS}

    def stop_after_error(self, exc: Exception) -> None:
        logger.error("ds_profutils: the hang watch of engine %r stopped after an error (%s: %s); training goes on",
                     self.name, type(exc).__name__, exc)
        self._unwatch(by_program=False)  # the job goes on: a wait written as a hang has not ended

    def close(self) -> None:
        """Watch this engine no more; the thread ends with the last engine (after its last look)."""
        self._unwatch(by_program=_program_closes(self._watchdog.training_thread))

    def _unwatch(self, by_program: bool) -> None:
        self._forget_at_exit()
        with _lock:
            self._watchdog.watches.discard(self)
            last = not self._watchdog.watches
            if last:
                self._watchdog.closed_by_program = by_program
                self._watchdog.stop()
        if last:
            self._watchdog.join()


def _program_closes(training_thread: int) -> bool:
    """Whether the program itself closes now: on its training thread, with no exception in flight, none that ended
    the program (an uncaught one, a gloo timeout, is printed before exit handlers run) and no SIGTERM ending it."""
    ended_by = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return (threading.get_ident() == training_thread and sys.exc_info()[0] is None and ended_by is None
            and not ending_on_signal())


def _remove_earlier_file(output_dir: Path, identity: ProcessIdentity) -> None:
    """An unresolved hang file of an earlier run in a reused output_dir would read as this run's hang.  One this
    process wrote (an engine closed after a hang and attached again, a Trainer resumed in-process) is this job's own
    evidence, and stays (known by its path, not its pid: a relaunched container has the same pids and host name)."""
    path = hang_file(output_dir, identity.rank)
    if path in _written_here:
        return
    try:
        path.unlink()
    except FileNotFoundError:
        return
    except OSError as exc:
        warning_once(f"ds_profutils: cannot remove an earlier run's hang file in {output_dir} ({exc.strerror})")


def watch_engine(hooks: EngineHooks, name: str, output_dir: str, timeout_s: float) -> EngineWatch:
    """Watch the engine ``hooks`` follow (called ``name``) from now on with the process's watchdog, started if none
    runs; hang files go to ``output_dir``.  Add the returned listener to ``hooks``; ``close()`` it at detach."""
    global _watchdog
    with _lock:
        watchdog = _watchdog
        fresh = watchdog is None or not watchdog.alive or watchdog._stop.is_set()
        if fresh:
            watchdog = _watchdog = Watchdog(process_identity(), threading.get_ident())
        directory = Path(output_dir)
        _remove_earlier_file(directory, watchdog.identity)  # under the lock: the thread writes none meanwhile
        watch = EngineWatch(hooks, name, directory, timeout_s, watchdog)
        watchdog.watches.add(watch)
    if fresh:
        watchdog.start()
    if watchdog._stuck_since is None:  # a hang written stands until a step ends: an attach is none
        watchdog.beat()  # the timeout counts from the attach: a hang before the first step is found too
    return watch
