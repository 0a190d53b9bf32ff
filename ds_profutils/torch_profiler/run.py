"""One profiled call: torch.profiler driven through the schedule's windows as training steps end.

Steps are numbered from 0 when the profiled call begins; each ``step_profiler()`` ends one step and
begins the next.  torch.profiler is created only at the first warmup step of a window and stopped
after its last active step, so the steps outside the windows cost a counter compare.  The active
steps are wrapped in ``ProfilerStep#N`` ranges with N the training step, so the trace holds exactly
the active steps, under their own numbers.

The run is a small state machine; every (state, event) pair it can meet is in ``_TRANSITIONS`` and
anything else is a bug that raises.  A failure inside a transition (torch cannot start, a disk is
full) is logged and ends profiling for the run; it never reaches the training loop.

``step_profiler()`` outside a run is one global load and a None test; inside a run but outside the
windows, a counter and one compare.
"""
from __future__ import annotations

import contextlib
import enum
import json
import logging
import threading
from pathlib import Path
from threading import get_ident
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.autograd.profiler import record_function

from ..config import ConfigError, ConfigProblem, ProfilerConfig
from ..logging import log_dist, logger
from ..nvtx import set_torch_profiler_recording
from ..outputs import (ProcessIdentity, atomic_path, cycle_dir, cycle_trace_file, probe_writable, process_identity,
                       summary_file, trace_file)
from .export import merge_traces, rename_trace_events
from .nsight import NsightCapture, nsys_command
from .schedule import ProfilerSchedule, Window
from .signals import ExitOnSignal
from .summary import OperatorSummary

__all__ = ["TAIL_RANGE", "ProfilerRun", "profiled_run", "step_profiler"]

_NEVER = -1  # a boundary no step number reaches
TAIL_RANGE = "ds_profutils: after the last step_profiler()"
"""What the step range open when the profiled call returns is renamed to in its trace: no step_profiler()
ended it, so it holds whatever ran after the last training step, not a step."""
_ALL_RANKS = [-1]  # log_dist: every rank logs


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
    RUN_ENDS = "profiled call returned or raised"


@contextlib.contextmanager
def _errors_logged(what: str) -> Iterator[None]:
    """Log (never raise) a failure to write an output: profiling must not break training."""
    try:
        yield
    except Exception:
        logger.exception("profiler: %s failed; training goes on", what)


class ProfilerRun:
    """The profiler of one profiled call, advanced by ``step_profiler()``."""

    def __init__(self, settings: ProfilerConfig) -> None:
        self.settings = settings
        self.schedule = ProfilerSchedule(skip_first=settings.skip_first,
                                         wait=settings.wait,
                                         warmup=settings.warmup,
                                         active=settings.active,
                                         repeat=settings.repeat)
        # Read by step_profiler on every call, so plain attributes: the step number, the step at which
        # the next event happens, and the thread of the profiled call (None while a nested call runs).
        # ``shared`` is set while unprofiled calls run beside this one; only then is the thread checked.
        self.step = 0
        self.next_boundary = 0
        self.owner: Optional[int] = None
        self.shared = False
        self._unprofiled_calls = 0
        self._state = _State.COUNTING
        self._window: Optional[Window] = self.schedule.window(0)
        self._next_event: Optional[_Event] = None
        self._torch: Optional[torch.profiler.profile] = None
        self._step_range: Optional[record_function] = None
        self._nsight: Optional[NsightCapture] = None
        self._signals = ExitOnSignal()
        self._identity: Optional[ProcessIdentity] = None
        self._summary: Optional[OperatorSummary] = None
        self._cycles: List[Dict[str, Any]] = []
        self._recorded = False
        self._engine_steps: Optional[int] = None
        self._warned_nested = False
        self._returned = False  # set by end(): the profiled call returned (rather than raised)

    # ---- driven by profiled_run and step_profiler ------------------------------------------------

    def begin(self) -> None:
        """Check the output directory (raising ConfigError), then enter step 0."""
        output_dir = self.settings.output_dir
        try:
            probe_writable(Path(output_dir), process_identity())
        except OSError as exc:
            raise ConfigError([
                ConfigProblem("profiler.output_dir", f"{output_dir!r} cannot be written ({exc.strerror or exc}); "
                              f"expected a directory this process can create and write")
            ]) from None
        if self.settings.nsight_enabled:
            self._nsight = NsightCapture.for_accelerator()
            if self._nsight is not None and process_identity().rank == 0:
                print(f"ds_profutils profiler: Nsight capture ranges bracket each active window; record them with: "
                      f"{nsys_command(self.settings.nsight_output)} <your launch command>",
                      flush=True)
        self.owner = get_ident()
        self._plan_next()
        self.catch_up()

    def catch_up(self) -> None:
        """Fire every event due at the current step (step_profiler calls this at a boundary)."""
        while self.step == self.next_boundary:
            self._fire(self._next_event)

    def end(self, returned: bool) -> None:
        """Stop recording and write every output; called once when the profiled call returned or raised.

        The signal handlers are put back whatever happens, also when a second signal cuts the export short.
        """
        self._returned = returned
        try:
            self._fire(_Event.RUN_ENDS)
        finally:
            self._signals.restore()

    @contextlib.contextmanager
    def unprofiled_call(self) -> Iterator[None]:
        """A profiled call started while this run is active: it runs unprofiled, this run untouched.

        While it runs, only this run's thread's ``step_profiler()`` calls count, and none at all when
        it is nested on this run's own thread.
        """
        if not self._warned_nested:
            self._warned_nested = True
            logger.warning("profiler: a profiled call started while another one is running (nested, or in "
                           "another thread); it runs unprofiled and the running profiler is unaffected")
        nested = self.owner == get_ident()
        with _claim_lock:
            self._unprofiled_calls += 1
            self.shared = True
            if nested:
                self.owner = None
        try:
            yield
        finally:
            with _claim_lock:
                if nested:
                    self.owner = get_ident()
                self._unprofiled_calls -= 1
                self.shared = self._unprofiled_calls > 0

    # ---- the state machine -----------------------------------------------------------------------

    def _fire(self, event: Optional[_Event]) -> None:
        transition = self._TRANSITIONS.get((self._state, event))
        if transition is None:
            raise RuntimeError(f"profiler: internal error, no transition from {self._state} on {event}")
        actions, next_state = transition
        try:
            for action in actions:
                action(self)
        except Exception:
            logger.exception("profiler: %s failed at step %d; profiling stops for this run", event.value, self.step)
            self._abandon()
            return
        self._state = next_state
        self._plan_next()

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
        for stop in (self._close_step, self._stop_capture, self._stop_torch):
            with contextlib.suppress(Exception):
                stop()
        with _errors_logged("finishing the profiler outputs"):
            self._finalize()
        self._state = _State.DONE
        self._plan_next()

    # ---- actions ----------------------------------------------------------------------------------

    def _prepare(self) -> None:
        if self._identity is None:
            self._bind_outputs()
        self._torch = torch.profiler.profile(activities=self._activities(),
                                             record_shapes=self.settings.record_shapes,
                                             profile_memory=self.settings.profile_memory,
                                             with_stack=self.settings.with_stack,
                                             with_flops=self.settings.with_flops,
                                             with_modules=self.settings.with_modules)
        self._torch.prepare_trace()
        self._signals.install()

    def _start_recording(self) -> None:
        self._recorded = True
        self._torch.start_trace()
        identity = self._identity
        self._torch.add_metadata_json("ds_profutils", json.dumps(self._metadata()))
        if identity.source != "torch.distributed":  # torch records distributedInfo only from torch.distributed
            self._torch.add_metadata_json("distributedInfo",
                                          json.dumps({"rank": identity.rank, "world_size": identity.world_size}))
        set_torch_profiler_recording(True)
        if self._nsight is not None:
            self._nsight.start()
        self._open_step()

    def _next_step(self) -> None:
        self._close_step()
        self._open_step()

    def _save_window(self) -> None:
        self._close_step()
        self._stop_capture()
        profile = self._stop_torch()
        if profile is None:  # stopped already: a signal cut short the transition that did it
            return
        window, self._window = self._window, self.schedule.window(self._window.cycle + 1)
        # A run that raised inside the window ends in the step that raised, which keeps its name; one
        # that returned ends in the tail after its last step_profiler(), which is not a step.
        tail = self._returned and self.step < window.stop
        last_step = self.step - 1 if tail else min(self.step, window.stop - 1)
        with _errors_logged(f"writing the trace of cycle {window.cycle}"):
            path = cycle_trace_file(self.settings.output_dir, self._identity.rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(path, self._identity) as temporary:
                profile.export_chrome_trace(str(temporary))
                if tail:  # cosmetic: a failure keeps the exported trace as it is
                    with _errors_logged(f"renaming the unfinished step of cycle {window.cycle}"):
                        rename_trace_events(temporary, f"ProfilerStep#{self.step}", TAIL_RANGE)
            steps = [window.active_start, last_step] if last_step >= window.active_start else []
            self._cycles.append({"cycle": window.cycle, "steps": steps, "trace": str(path)})
        if self._summary is not None:
            with _errors_logged(f"summarising cycle {window.cycle}"):
                self._summary.add_cycle(profile)

    def _discard_warmup(self) -> None:
        profile, self._torch = self._torch, None
        profile.start_trace()  # torch's own way out of a prepared, never-started profiler
        profile.stop_trace()

    def _finalize(self) -> None:
        _release(self)
        try:
            self._write_run_outputs()
        finally:
            self._signals.restore()

    _TRANSITIONS: Dict[Tuple[_State, Optional[_Event]], Tuple[Tuple[Callable[["ProfilerRun"], None], ...], _State]] = {
        (_State.COUNTING, _Event.WARMUP_BEGINS): ((_prepare, ), _State.WARMING_UP),
        (_State.COUNTING, _Event.SCHEDULE_ENDS): ((_finalize, ), _State.DONE),
        (_State.COUNTING, _Event.RUN_ENDS): ((_finalize, ), _State.DONE),
        (_State.WARMING_UP, _Event.ACTIVE_BEGINS): ((_start_recording, ), _State.RECORDING),
        (_State.WARMING_UP, _Event.RUN_ENDS): ((_discard_warmup, _finalize), _State.DONE),
        (_State.RECORDING, _Event.ACTIVE_STEP): ((_next_step, ), _State.RECORDING),
        (_State.RECORDING, _Event.WINDOW_ENDS): ((_save_window, ), _State.COUNTING),
        (_State.RECORDING, _Event.RUN_ENDS): ((_save_window, _finalize), _State.DONE),
        (_State.DONE, _Event.RUN_ENDS): ((), _State.DONE),
    }

    # ---- helpers ----------------------------------------------------------------------------------

    def _bind_outputs(self) -> None:
        """Name the outputs by the global rank, read when torch.profiler first starts (not at decoration,
        when torch.distributed may not be up yet)."""
        self._identity = process_identity()
        rank = self._identity.rank
        summary_ranks = self.settings.summary_ranks
        if summary_ranks is None or rank in summary_ranks:
            self._summary = OperatorSummary(self.settings.summary_sort_by, self.settings.summary_row_limit)

    def _activities(self) -> List[torch.profiler.ProfilerActivity]:
        if self._nsight is not None:  # CUPTI serves one client: on the active steps that is Nsight
            return [torch.profiler.ProfilerActivity.CPU]
        return sorted(torch.profiler.supported_activities(), key=lambda activity: activity.value)

    def _metadata(self) -> Dict[str, Any]:
        identity = self._identity
        return {"host": identity.host, "rank": identity.rank, "world_size": identity.world_size, "pid": identity.pid}

    def _open_step(self) -> None:
        self._step_range = record_function(f"ProfilerStep#{self.step}")
        self._step_range.__enter__()
        if self._nsight is not None:
            self._nsight.push_step(self.step)

    def _close_step(self) -> None:
        step_range, self._step_range = self._step_range, None
        if step_range is None:
            return
        if self._nsight is not None:
            self._nsight.pop_step()
        step_range.__exit__(None, None, None)

    def _stop_capture(self) -> None:
        if self._nsight is not None:
            self._nsight.stop()

    def _stop_torch(self) -> Optional[torch.profiler.profile]:
        set_torch_profiler_recording(False)
        profile, self._torch = self._torch, None
        if profile is not None:
            profile.stop_trace()
        return profile

    def _write_run_outputs(self) -> None:
        if not self._cycles:
            if not self._recorded:  # (otherwise every export failed, and each failure was logged)
                log_dist(f"profiler: the run ended at step {self.step}, before any active step; nothing was "
                         f"recorded", ranks=_ALL_RANKS, level=logging.WARNING)
            return
        output_dir, identity = self.settings.output_dir, self._identity
        merged = trace_file(output_dir, identity.rank)
        with _errors_logged("writing the merged trace"):
            merge_traces([Path(cycle["trace"]) for cycle in self._cycles], merged,
                         {"ds_profutils": {**self._metadata(), "cycles": self._cycles}}, identity)
        table = self._summary.table() if self._summary is not None else None
        if table is not None:
            summary = summary_file(output_dir, identity.rank)
            with _errors_logged("writing the operator summary"):
                with atomic_path(summary, identity) as temporary:
                    temporary.write_text(table)
            logger.info("profiler: operator summary of rank %d (%s)\n%s", identity.rank, summary, table)
        log_dist(f"profiler: {len(self._cycles)} cycle(s) recorded; run trace {merged}, per-cycle traces in "
                 f"{cycle_dir(output_dir, identity.rank)}/ (open with TensorBoard or https://ui.perfetto.dev)",
                 ranks=_ALL_RANKS)

    def engine_stepped(self, engine: Any) -> bool:
        """True when the engine took an optimizer step since the previous call.

        On the first call there is no previous count, so DeepSpeed's ``was_step_applied()`` decides.
        """
        steps, previous = engine.global_steps, self._engine_steps
        self._engine_steps = steps
        return engine.was_step_applied() if previous is None else steps != previous


# ---- one active run per process, and step_profiler's routing to it ---------------------------------

_claim_lock = threading.Lock()
_current: Optional[ProfilerRun] = None


def step_profiler(engine: Any = None) -> None:
    """End the current training step for the running profiler; call it once per step.

    With ``engine`` (a DeepSpeed engine), only calls after which the engine has taken an optimizer step
    count, so the micro-steps of gradient accumulation make one profiler step.  Without a running
    profiler this costs a None test.  Outside the windows it is the whole cost of a step, so it is
    written out here rather than calling a method: a counter and one compare.
    """
    run = _current
    if run is None or (run.shared and run.owner != get_ident()):
        return
    if engine is not None and not run.engine_stepped(engine):
        return
    run.step += 1
    if run.step == run.next_boundary:
        run.catch_up()


def _claim(run: ProfilerRun) -> ProfilerRun:
    """Make ``run`` the process's active run, unless one is active already; return the active run."""
    global _current
    with _claim_lock:
        if _current is None:
            _current = run
        return _current


def _release(run: ProfilerRun) -> None:
    global _current
    with _claim_lock:
        if _current is run:
            _current = None


@contextlib.contextmanager
def profiled_run(settings: ProfilerConfig) -> Iterator[Optional[ProfilerRun]]:
    """Profile the block with ``settings``; yields the run, or None when another run is active.

    Raises ConfigError before the block when ``output_dir`` cannot be written.  Whatever way the block
    ends (return, exception, SIGTERM/SIGINT turned into SystemExit), the outputs are written first.
    """
    run = ProfilerRun(settings)
    active = _claim(run)
    if active is not run:
        with active.unprofiled_call():
            yield None
        return
    try:
        run.begin()
    except BaseException:
        _release(run)
        raise
    returned = False
    try:
        yield run
        returned = True
    finally:
        try:
            run.end(returned)
        finally:
            _release(run)
