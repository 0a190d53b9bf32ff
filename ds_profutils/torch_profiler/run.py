"""One profiled call: torch.profiler driven through the schedule's windows as training steps end.

The schedule counts steps from 0 when the profiled call begins; each ``step_profiler()`` ends one
step and begins the next.  torch.profiler is created only at the first warmup step of a window and
stopped after its last active step, so the steps outside the windows cost a counter compare.  The
active steps are wrapped in ``ProfilerStep#N`` ranges, so the trace holds exactly the active steps.
N is the training step: with ``step_profiler(engine)`` the engine's ``global_steps`` before the step
(numbers continue across calls and resumed checkpoints), else the schedule's count.

The run is a small state machine; every (state, event) pair it can meet is in ``_TRANSITIONS`` and
anything else is a bug that raises.  Signals are held while a transition runs (:mod:`.signals`), so
no handler runs half-way through one; a SIGTERM/SIGINT noted while a window records turns the next
boundary into ``INTERRUPTED``: the window is written, then the signal is delivered.  A failure inside a
transition (torch cannot start) is logged and ends profiling for the run; it never reaches the
training loop.  What records a window (torch.profiler, Nsight, the step ranges) is
:mod:`.recording`'s, writing it :mod:`.writer`'s.

The run needs no frame of its own on the stack: ``begin()``, ``catch_up()`` at each step boundary and
``end()`` are plain calls (the decorator makes them through :mod:`.calls`).

``step_profiler()`` outside a run is one global load and a None test; inside a run but outside the
windows, a counter and one compare.
"""
from __future__ import annotations

import enum
import threading
import json
import weakref
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..config import ConfigError, ConfigProblem, ProfilerConfig
from ..logging import logger
from ..outputs import cycle_trace_file, probe_writable, process_identity
from .recording import WindowRecording, capture_recording
from .schedule import ProfilerSchedule, Window
from .signals import SignalGuard, ends_a_run
from .writer import RunWriter, show_comms_summary

__all__ = ["TAIL_RANGE", "ProfilerRun"]

_NEVER = -1  # a boundary no step number reaches
TAIL_RANGE = "ds_profutils: after the last step_profiler()"
"""What the step range open when the profiled call returns is renamed to in its trace: no step_profiler()
ended it, so it holds whatever ran after the last training step, not a step."""


class _State(enum.Enum):
    COUNTING = "counting steps until the next window"
    WARMING_UP = "torch.profiler prepared, not recording"
    RECORDING = "recording"
    DONE = "every window saved"


class _Event(enum.Enum):
    WARMUP_BEGINS = "first warmup step of a window"
    ACTIVE_BEGINS = "first active step of a window"
    ACTIVE_STEP = "next active step"
    WINDOW_ENDS = "step after a window"
    SCHEDULE_ENDS = "no window left"
    INTERRUPTED = "step boundary after a SIGTERM/SIGINT"
    RUN_ENDS = "profiled call returned or raised"


class ProfilerRun:
    """The profiler of one profiled call, advanced by ``step_profiler()``.

    ``engine``, when known before the call's first step (``profiler(config=engine)``, or the attached
    engine that drives the run), names the steps by its ``global_steps`` from step 0 on.
    ``engine_driven``: only that engine's steps end the run's steps (``step_profiler()`` leaves it alone).
    """

    def __init__(self, settings: ProfilerConfig, on_done: Callable[["ProfilerRun"], None], engine: Any = None,
                 engine_driven: bool = False) -> None:
        self.settings = settings
        self.engine_driven = engine_driven
        self._on_done = on_done  # called once no window is left: step_profiler() goes idle
        self.schedule = ProfilerSchedule(skip_first=settings.skip_first,
                                         wait=settings.wait,
                                         warmup=settings.warmup,
                                         active=settings.active,
                                         repeat=settings.repeat)
        # Read by step_profiler on every call, so plain attributes: the step number, the step at which
        # the next event happens, and the thread of the profiled call (None while a nested call runs).
        # While unprofiled calls run beside this one (``beside``: their threads), and only then, the
        # thread is checked.  A list: append and remove are atomic, so no lock is needed.
        self.step = 0
        self.next_boundary = 0
        self.owner: Optional[int] = None
        self.beside: List[int] = []
        self.warned_nested = False
        self.signals = SignalGuard()
        self._state = _State.COUNTING
        self._window: Optional[Window] = self.schedule.window(0)
        self._next_event: Optional[_Event] = None
        self._recording = WindowRecording(settings)  # torch.profiler, Nsight and the step ranges
        self._writer: Optional[RunWriter] = None
        # Engines are held weakly: the process's active run must not keep an engine dropped without
        # close() alive (an attached engine's run is then ended by the next one to start, or at exit).
        self._engine: Optional[weakref.ref] = None if engine is None else weakref.ref(engine)  # its steps end ours
        self._engine_steps: Optional[int] = None if engine is None else engine.global_steps
        # an attached engine's run begins at its first forward, after any checkpoint was loaded: a restart's files go
        # on from this step (a decorated call may load one inside: there the first warmup's step stands for it)
        self._began_at = self._engine_steps if engine_driven else None
        self._names_engine: Optional[weakref.ref] = self._engine  # its global_steps name ours; None: our count
        self._opened: List[Tuple[str, int]] = []  # (name, step number) of this window's step ranges
        self._recorded = False
        self._ended = False
        self._returned = False  # set by end(): the profiled call returned (rather than raised)

    # ---- driven by calls.RunBlock and step_profiler ---------------------------------------------

    def begin(self) -> None:
        """Check the output directory (raising ConfigError); ``catch_up()`` then enters step 0."""
        output_dir = self.settings.output_dir
        try:
            probe_writable(Path(output_dir), process_identity())
        except OSError as exc:
            raise ConfigError([
                ConfigProblem("profiler.output_dir", f"{output_dir!r} cannot be written ({exc.strerror or exc}); "
                              f"expected a directory this process can create and write")
            ]) from None
        self._recording.begin(process_identity().rank)
        self.owner = threading.get_ident()
        self._plan_next()

    def catch_up(self) -> None:
        """Fire every event due at the current step (step_profiler calls this at a boundary)."""
        signals = self.signals
        if signals.unwinding:  # the program caught the SystemExit/KeyboardInterrupt and went on
            signals.went_on()
        while self.step == self.next_boundary:
            event = self._next_event
            if signals.stop is not None and self._state is _State.RECORDING:
                event = _Event.INTERRUPTED
            if event is _Event.WARMUP_BEGINS and capture_recording():
                self._skip_window()
                continue
            self._fire(event)

    def _skip_window(self) -> None:
        """A trace capture records (one torch profiler at a time): this window is skipped, said in one line."""
        logger.warning("profiler: the window of cycle %d, beginning at step %d, is skipped: a trace capture is "
                       "recording (docs/capture.md)", self._window.cycle, self.step)
        self._window = self.schedule.window(self._window.cycle + 1)
        self._plan_next()

    @ends_a_run
    def end(self, passing: Optional[BaseException], summary: bool = True) -> None:
        """Stop recording and write what is unsaved; ``passing`` is the exception ending the call, if any.

        Then the held signals are delivered (a SIGTERM that the handler turned into the SystemExit now
        passing is raised again with its default action), and at a normal end the comms logger's
        summary is shown, if ``summary``: it has barriers, so only where every rank ends the run alike
        (not at process exit, where other ranks may be gone).
        """
        self._ended, self._returned = True, passing is None
        signals = self.signals
        signals.hold()  # before any other call: a signal now waits until the files are written
        try:
            self._fire(_Event.RUN_ENDS)
        finally:
            signals.release(recording=False, passing=passing)
        if summary and passing is None and not signals.stopped_by_signal:  # its barriers would meet ranks being stopped
            show_comms_summary(self.settings, process_identity())

    @property
    def engine_gone(self) -> bool:
        """The engine driving this run was garbage-collected (dropped without ``close()``)."""
        return self.engine_driven and self._engine() is None

    @property
    def recording(self) -> bool:
        """The torch profiler records now: the step in progress is in a window's active part."""
        return self._state is _State.RECORDING

    @property
    def window_open(self) -> bool:
        """torch.profiler is prepared or records: a window's warmup or active steps are in progress."""
        return self._state in (_State.WARMING_UP, _State.RECORDING)

    @property
    def done(self) -> bool:
        """Every window is written (the schedule ended, or the run did): nothing is left to write."""
        return self._state is _State.DONE

    def engine_stepped(self, engine: Any) -> bool:
        """True when the engine took an optimizer step since the previous call.

        The first time an engine is seen there is no previous count, so the engine says whether the
        ``step()`` just returned ended a gradient-accumulation boundary: its micro-step count is then a
        multiple of the accumulation steps (DeepSpeed counts a step that fp16 loss scaling skipped as a
        global step too, where ``was_step_applied()`` is False).  See ``_adopt`` for the step names.
        """
        steps = engine.global_steps
        if self._engine is not None and engine is self._engine():
            previous, self._engine_steps = self._engine_steps, steps
            return steps != previous
        boundary = engine.was_step_applied() or engine.micro_steps % engine.gradient_accumulation_steps() == 0
        self._engine, self._engine_steps = weakref.ref(engine), steps
        self._adopt(engine, steps - 1 if boundary else steps)
        return boundary

    # ---- the state machine -----------------------------------------------------------------------

    def _fire(self, event: Optional[_Event]) -> None:
        transition = self._TRANSITIONS.get((self._state, event))
        if transition is None:
            raise RuntimeError(f"profiler: internal error, no transition from {self._state} on {event}")
        actions, next_state = transition
        signals = self.signals
        releases = not signals.holding  # end() holds from before this call until everything is written
        if releases:
            signals.hold()
        signals.activity = f"at step {self.step}: {event.value}"
        try:
            for action in actions:
                action(self)
            self._state = next_state
        except BaseException as exc:
            if isinstance(exc, Exception):
                logger.exception("profiler: %s failed at step %d; profiling stops for this run", event.value,
                                 self.step)
            self._abandon()
            if not isinstance(exc, Exception):  # an interruption from a handler the profiler does not hold
                raise
        finally:
            self._plan_next()
            signals.activity = ("the step has not reached step_profiler()" if self._state is _State.RECORDING
                                else "not recording")
            if releases:
                signals.release(recording=self._state is _State.RECORDING)

    def _plan_next(self) -> None:
        """Set the step at which the next event happens, and which event it is."""
        window = self._window
        if self._state is _State.COUNTING:
            if window is None:
                self.next_boundary, self._next_event = self.step, _Event.SCHEDULE_ENDS
            else:
                self.next_boundary, self._next_event = window.warmup_start, _Event.WARMUP_BEGINS
        elif self._state is _State.WARMING_UP:
            self.next_boundary, self._next_event = window.active_start, _Event.ACTIVE_BEGINS
        elif self._state is _State.RECORDING:
            following = self.step + 1
            self.next_boundary = following
            self._next_event = _Event.ACTIVE_STEP if following < window.stop else _Event.WINDOW_ENDS
        else:
            self.next_boundary, self._next_event = _NEVER, None

    def _abandon(self) -> None:
        """After a failed transition: stop what still runs, keep what was saved, count no more."""
        self._recording.abandon()
        self._state = _State.DONE
        try:
            self._finalize()
        except Exception:
            logger.exception("profiler: finishing the profiler outputs failed; training goes on")

    # ---- actions ----------------------------------------------------------------------------------

    def _prepare(self) -> None:
        if self._writer is None:  # the rank that names the files is read now, not at decoration
            identity = process_identity()
            first = self._global_step()
            if first is not None and self._began_at is not None:
                first = self._began_at
            self._writer = RunWriter.of(self.settings, identity, first)
            self.signals.label = f"rank {identity.rank} (pid {identity.pid})"
        self._recording.prepare()

    def _start_recording(self) -> None:
        self._recorded = True
        self._recording.start(self._writer.identity)
        self.signals.arm()  # from now on the window holds unsaved steps
        self._open_step()

    def _next_step(self) -> None:
        self._recording.close_step()
        self._open_step()

    def _save_window(self) -> None:
        """Stop recording and write the cycle (the last step cut where it stopped, or renamed as the tail)."""
        self._recording.close_step()
        self._recording.stop_capture()
        window, self._window = self._window, self.schedule.window(self._window.cycle + 1)
        opened, self._opened = self._opened, []
        renames = {}
        if self._returned and opened:  # returned inside the window: the open range is the tail, not a step
            renames[opened.pop()[0]] = TAIL_RANGE
        steps = [opened[0][1], opened[-1][1]] if opened else []
        writer = self._writer
        path = cycle_trace_file(self.settings.output_dir, writer.identity.rank)
        entry = {"cycle": window.cycle, "steps": steps, "trace": str(path)}
        metadata = self._metadata()
        try:
            self._recording.add_metadata("ds_profutils", json.dumps({**metadata, "cycles": [entry]}))
        except Exception as exc:  # the cycle is still worth writing without it
            logger.error("profiler: the ds_profutils metadata of %s was not added (%s)", path, exc)
        self.signals.activity = f"after step {self.step}: stopping torch.profiler (it synchronizes the device)"
        profile = self._recording.stop()
        self.signals.activity = f"after step {self.step}: writing {path} and the run trace"
        interrupted = self.signals.interrupted or (self._ended and not self._returned)
        if interrupted:
            logger.warning("profiler: rank %d interrupted at step %d; writing the steps recorded so far (SIGTERM and "
                           "SIGINT wait until the files are written)", writer.identity.rank, self.step)
        writer.save_cycle(profile, path, entry, renames, interrupted, metadata)

    def _discard_warmup(self) -> None:
        self._recording.discard_warmup()

    def _finalize(self) -> None:
        self._on_done(self)
        if not self._recorded:
            logger.warning("profiler: the run ended at step %d, before any active step; nothing was recorded",
                           self.step)
        if self._writer is not None:
            self._writer.finish()

    _TRANSITIONS: Dict[Tuple[_State, Optional[_Event]], Tuple[Tuple[Callable[["ProfilerRun"], None], ...], _State]] = {
        (_State.COUNTING, _Event.WARMUP_BEGINS): ((_prepare, ), _State.WARMING_UP),
        (_State.COUNTING, _Event.SCHEDULE_ENDS): ((_finalize, ), _State.DONE),
        (_State.COUNTING, _Event.RUN_ENDS): ((_finalize, ), _State.DONE),
        (_State.WARMING_UP, _Event.ACTIVE_BEGINS): ((_start_recording, ), _State.RECORDING),
        (_State.WARMING_UP, _Event.RUN_ENDS): ((_discard_warmup, _finalize), _State.DONE),
        (_State.RECORDING, _Event.ACTIVE_STEP): ((_next_step, ), _State.RECORDING),
        (_State.RECORDING, _Event.WINDOW_ENDS): ((_save_window, ), _State.COUNTING),
        (_State.RECORDING, _Event.INTERRUPTED): ((_save_window, _finalize), _State.DONE),
        (_State.RECORDING, _Event.RUN_ENDS): ((_save_window, _finalize), _State.DONE),
        (_State.DONE, _Event.RUN_ENDS): ((), _State.DONE),
    }

    # ---- helpers ----------------------------------------------------------------------------------

    def _adopt(self, engine: Any, current: int) -> None:
        """Name steps by ``engine.global_steps`` from now on, ``current`` being the current step's number.

        A range is named when it opens, so where a step range was already opened under the call's count
        (a window that began at the call's first step, before any engine could be seen) with another
        number, the run keeps the call's count, and says why once.
        """
        if self._names_engine is not None:
            return
        if self._opened and current != self.step:
            logger.warning("profiler: ProfilerStep#N counts this call's steps, not the engine's global steps: the "
                           "window began at the call's first step, whose range was named before the engine was seen "
                           "(it is global step %d); give the engine to profiler(config=engine), or begin the window "
                           "later (skip_first, wait or warmup), for global numbers", current)
            return
        self._names_engine = weakref.ref(engine)

    def _global_step(self) -> Optional[int]:
        """The naming engine's global step now; None where steps are counted per call (or it is gone)."""
        engine = None if self._names_engine is None else self._names_engine()
        return None if engine is None else engine.global_steps

    def _metadata(self) -> Dict[str, Any]:
        identity = self._writer.identity
        return {"host": identity.host, "rank": identity.rank, "world_size": identity.world_size, "pid": identity.pid,
                "run_id": self._writer.run_id, "step_numbering": "call" if self._names_engine is None else "global",
                "profiled_ranks": self.settings.ranks}

    def _open_step(self) -> None:
        number = self._global_step()
        number = self.step if number is None else number
        self._opened.append((self._recording.open_step(number), number))
