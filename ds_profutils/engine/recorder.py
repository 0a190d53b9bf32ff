"""The per-step records of one engine on one rank (record schema 3, docs/zero_fetch.md).

The recorder decides the step boundaries and writes the records; each step's figures are held by a
:class:`~.step.StepRecord` it opens: the step's clocks and its collectives (:mod:`.collectives`) for an engine
of any ZeRO stage, and, where ZeRO-3 fetches are recorded, what the step learned about them (``fetches``: a
:class:`ds_profutils.zero3.CoordinatorFetches`, whose profiler sits in the engine's parameter coordinator and
whose ``recording`` flag the recorder switches per step).  Step boundaries are ours, not DeepSpeed's (it resets
its counters at the *next* forward): a record is opened when a forward starts (the step numbers are read then)
and finished when ``engine.step()`` returns, or an eval forward ends; a forward under ``no_grad`` while a train
forward awaits its backward is part of that micro step (:meth:`~.step.StepRecord.awaits_backward`).  Steps that
``log_interval`` skips run with ``recording`` off: one attribute test per fetch event, what DeepSpeed's own
disabled profiler costs.

A record is written once its device times are known (at once on the host clock).  Each is one line
written by one ``write`` call on an unbuffered file: every finished step is on disk, and a kill never
leaves half a line.  A train step interrupted before ``engine.step()`` returned is not written at all.

Beyond the step itself (docs/step_records.md): the record that ends an optimizer step carries the whole
iteration and its gap, with the gap's eval forwards and checkpoint saves (:mod:`.throughput.totals`); with
a :class:`~.throughput.flops.FlopCounter` each micro step its FLOPs, tokens and samples; and after each optimizer
step the ``step_listeners`` get its :class:`~.live.StepFigures` (live metrics), also on a rank writing no file.

Restarts: the file is opened at the first forward.  A process whose engine starts above global step 0
(a resume) appends to what an earlier process wrote; one that starts at step 0 replaces it, saying so.
Every record carries ``segment``: one more than the file's last in a process that starts appending, and
one more again whenever a global step the file already finished comes again (a second ``train()``
resumed from an earlier checkpoint), so the readers keep the latest record of each step.
"""
from __future__ import annotations

import time
import weakref
from collections import deque
from time import perf_counter_ns
from typing import Any, Callable, Deque, List, Optional, Sequence, Tuple

import torch
from deepspeed.accelerator import get_accelerator

from .._device_clock import DeviceEvents
from .._signal_exit import close_at_exit
from ..config import PartitionedParamProfilerConfig
from ..diagnosis.settings import effective_values
from ..logging import logger
from ..nvtx import ranges_active
from ..outputs import ProcessIdentity, fetch_records_file
from ..zero3 import CoordinatorFetches
from ..zero3.fetches import fetch_wait_ms
from . import collectives
from .hooks import Listener
from .live import StepFigures
from .memory import StepMemory
from .records_file import RecordsFile
from .step import EngineCollectives, MicroSteps, StepRecord, optimizer_step_due, optimizer_step_taken
from .throughput.flops import FlopCounter
from .throughput.totals import OptimizerStepTotals

__all__ = ["RECORDER_ATTR", "RECORD_SCHEMA", "StepRecorder"]

RECORDER_ATTR = "_ds_profutils_fetch_recorder"
"""The engine attribute that holds its recorder while attached."""
RECORD_SCHEMA = 3
SETTLE_SECONDS = 2.0
"""How long ``close`` waits for device times before writing host times (never blocking on the device)."""


class StepRecorder(Listener):
    """Owns an engine's per-step records on this rank: the open :class:`~.step.StepRecord`, the JSONL file,
    and (on ZeRO-3) the fetch profiler in the engine's coordinator.

    ``close()`` (also at exit) writes what is finished, gives the coordinator DeepSpeed's profiler back
    and closes the file.  ``append``: add to the file (the engine was recorded earlier in this process)
    rather than start it afresh.  ``coordinator``: the engine's ZeRO-3 parameter coordinator, whose
    fetches the records then hold; None records the steps and collectives of an engine without one.
    ``writes``: False on a rank outside ``ranks`` that measures for ``step_listeners`` only (no file).
    ``flops``: counts each micro step's FLOPs (None: no ``flops`` fields).  ``config_hash``: the engine's resolved
    config, hashed (with ``model_numel`` and the world size it tells another job's file apart).
    ``profiler_active``: whether the engine-driven torch profiler records now (the step's record then says so)."""

    def __init__(self, engine: Any, coordinator: Any, settings: PartitionedParamProfilerConfig, *, name: str,
                 identity: ProcessIdentity, dtype: torch.dtype, device_events: Optional[DeviceEvents],
                 memory: Optional[StepMemory], append: bool = False, writes: bool = True,
                 flops: Optional[FlopCounter] = None, peak_tflops: Optional[float] = None,
                 model_numel: Optional[int] = None, config_hash: Optional[str] = None,
                 profiler_active: Optional[Callable[[], bool]] = None,
                 step_listeners: Sequence[Callable[[StepFigures], None]] = ()) -> None:
        self.name, self.settings = name, settings
        self.path = fetch_records_file(settings.output_dir, identity.rank, name)
        self.device_events = device_events
        self.memory = memory
        self.writes = writes
        self.flops = flops
        self.step_listeners: List[Callable[[StepFigures], None]] = list(step_listeners)
        self._profiler_active = profiler_active
        what = "step records" if coordinator is None else "step and ZeRO-3 fetch records"
        self.records_file = RecordsFile(self.path, what, identity.rank)  # opened at the first forward (module doc)
        if writes:
            self.records_file.make_directory()
        self._append, self._closed = append, False
        self.segment = 0
        self._finished_step = -1  # the highest global step whose optimizer step this file has
        self.fetches = None if coordinator is None else CoordinatorFetches(
            engine, coordinator, element_size=torch.empty((), dtype=dtype).element_size(),
            device_events=device_events)
        self._header = {
            "schema": RECORD_SCHEMA, "engine": name, "rank": identity.rank, "world_size": identity.world_size,
            "local_rank": identity.local_rank, "host": identity.host, "pid": identity.pid,
            "recording_ranks": settings.ranks, "dtype": str(dtype)[len("torch."):], "clock": "host",
            "model_numel": model_numel, "peak_tflops": peak_tflops, "job_config_hash": config_hash,
            **(self.fetches.header if self.fetches is not None else {})
        }  # on the device clock, each record says its own clock
        self._first_fields = {"ds_config": effective_values(engine)}  # on the first record this process writes
        self._engine = engine
        self._open: Optional[StepRecord] = None
        self._side_forward, self._forward_returned = False, True  # the last forward: a side one (no_grad)? returned?
        self._waits_at_open = 0
        self._micro_steps = MicroSteps()
        self._unwritten: Deque[StepRecord] = deque()
        self.totals = OptimizerStepTotals()
        self._steps_before: Optional[int] = None  # global_steps when engine.step() started
        self._own_work_from: Optional[int] = None  # the end of an optimizer step whose listeners are being told
        self._step_records: List[StepRecord] = []  # the measured micro steps of the optimizer step in progress
        self.collectives = EngineCollectives(engine)
        # once: at close, or when the recorder is collected with its engine
        self._detach_collectives = weakref.finalize(self, collectives.attach_engine(self.collectives,
                                                                                    device_events))
        self._forget_at_exit = close_at_exit(self.close)  # a SIGTERM the profiler re-raises skips atexit
        setattr(engine, RECORDER_ATTR, self)

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran: the file is complete and the coordinator has DeepSpeed's profiler back."""
        return self._closed

    def _open_file(self) -> None:
        """Open the records file at the first forward: append on a resume (module doc), else start it."""
        last = self.records_file.start(self._append, self._engine.global_steps > 0, self._header)
        if last is not None:
            self.segment = int(last.get("segment") or 0) + (0 if self._append else 1)
            # in this process the run goes on (a repeat starts a segment); a new process started one already
            self._finished_step = int(last.get("global_step", -1)) if self._append else -1

    def forward_started(self, module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Any) -> None:
        engine = self._engine
        self._forward_returned = False
        # DPO's reference logits after the policy's forward: that micro step's time (the last forward's kind, kept)
        self._side_forward = self._open is not None and module.training and not torch.is_grad_enabled() and \
            self._open.awaits_backward()
        if self._side_forward:
            self._open.side_failed = False  # retried, if it failed
            if self.fetches is not None:  # and fetches: DeepSpeed's reset at this forward's start must zero none
                self.fetches.profiler.keep_events = True
            return
        if self._open is not None and self._open.side_failed:
            self._cut_short()  # the batch retried whole after its side forward's error
        if self._open is not None or self._unwritten:  # an eval forward, one whose step() never came; device times
            self._finish_open(closing=False)
            self._write_ready()
        global_step = engine.global_steps
        recorded = self.writes and global_step % self.settings.log_interval == 0
        # a forward under no_grad in train mode (reference logits of DPO, PEFT, before the policy's) is no micro step
        mode = ("train" if torch.is_grad_enabled() else "no_grad") if module.training else "eval"
        micro_step = self._micro_steps.next(engine, mode == "train")
        if self.fetches is not None:
            self.fetches.begin(recorded, self.settings.trace_ranges and ranges_active())
        if not recorded and not self.step_listeners:
            if self.memory is not None:
                self.memory.forget()
            return
        if recorded and not self.records_file.opened:
            self._open_file()
        if mode == "train" and global_step <= self._finished_step:
            self.segment += 1  # this file finished the step before: a run went back to an earlier checkpoint
            self._finished_step = global_step - 1
        fields = {"mode": mode, "global_step": global_step, "micro_step": micro_step, "segment": self.segment,
                  "time": time.time(), "comms_logger": collectives.comms_logger_on()}
        if self._profiler_active is not None and self._profiler_active():
            fields["profiler_active"] = True
        if self.flops is not None:
            self.flops.forward_started(module, args, kwargs)
        events = self.device_events if recorded else None  # a step measured only for listeners: host clock
        compute_stream = get_accelerator().current_stream() if events is not None else None
        self._waits_at_open = events.waits if events is not None else 0
        self._open = self.collectives.step = StepRecord(fields, events.mark() if events is not None else None,
                                                        compute_stream)
        self._open.written = recorded
        if self.memory is not None:
            self.memory.begin("forward")

    def forward_ended(self, module: torch.nn.Module, output: Any) -> None:
        step, self._forward_returned = self._open, True
        if step is None or self._side_forward:
            return
        if self.flops is not None:
            self.flops.forward_ended(output)
        self._mark_end(step)
        step.forward_done = True
        evaluating = step.fields["mode"] != "train"
        if evaluating:  # no step() follows: what comes next is another engine's or the loop's
            self._pause()
        if self.memory is not None and evaluating:
            self.memory.end()
        elif self.memory is not None:
            self.memory.begin("backward")  # which ends the forward's phase

    def forward_left(self) -> None:
        if self._side_forward and self.fetches is not None:
            self.fetches.profiler.keep_events = False
        if self.flops is not None:
            self.flops.forward_left()

    def backward_ended(self) -> None:
        """Without a ``step()`` to come (Accelerate's micro steps before the boundary) the step ends here."""
        step = self._open
        if step is not None and self.flops is not None:
            self.flops.backward_ended()
        if step is not None and step.forward_done and step.fields["mode"] == "train":
            step.backward_done = True
            self._mark_end(step)
            if self.memory is not None:
                self.memory.end()

    def step_started(self) -> None:
        self._steps_before = self._engine.global_steps
        if self._open is not None:
            self._open.backward_done = False  # a step() follows after all: the record ends with it
            if self.flops is not None:
                self.flops.backward_ended()  # after a torch-style backward: the counting mode ends here
        if self._open is not None and self.memory is not None:
            self.memory.begin("step")

    def step_ended(self) -> None:
        step, before, self._steps_before = self._open, self._steps_before, None
        boundary = optimizer_step_taken(self._engine, before)
        if step is not None and step.forward_done:
            self._mark_end(step)
            step.step_done = True
            step.ends_optimizer_step = boundary
            self._finish_open(closing=False)
        if boundary:
            self._own_work_from = step.end_ns if step is not None else perf_counter_ns()
            self._optimizer_step_ended(before, self._own_work_from)
        self._write_ready()

    def step_listeners_done(self) -> None:
        """What ran since the optimizer step's end (the live exchange, writing, a profiler's export) was ours."""
        if self._own_work_from is not None:
            self.totals.own_work(perf_counter_ns() - self._own_work_from)
            self._own_work_from = None

    def checkpoint_saved(self, elapsed_ns: int) -> None:
        self.totals.checkpoint_saved(elapsed_ns)

    def failed(self, exc: BaseException) -> None:
        """An error left the engine's forward, backward or step (an OOM the program catches to retry): the train micro
        step it cut short is none.  A step() that took its optimizer step first is ended by the hooks; a side forward's
        error leaves the micro step to the retry: of that forward (whole), or of the batch (cut short then)."""
        if optimizer_step_taken(self._engine, self._steps_before):
            return  # the hooks end it
        step, self._steps_before = self._open, None
        if step is None or step.fields["mode"] != "train" or step.backward_done:
            return
        if self._side_forward and not self._forward_returned:
            step.side_failed = True
        else:
            self._cut_short()

    def _cut_short(self) -> None:
        """The open train micro step is none: no record, number or FLOP count (its time is the gap's)."""
        self._micro_steps.take_back()
        if self.flops is not None:
            self.flops.discard()  # a count in progress is taken again at the retry
        self._finish_open(closing=True)  # not whole: dropped, its marks released

    def _optimizer_step_ended(self, global_step: int, end_ns: int) -> None:
        """Global step ``global_step`` is done: its iteration and gap go on the record that ended it, its
        figures to the listeners (host clock: final now, whatever the device clock says later)."""
        records, self._step_records = self._step_records, []
        iteration_ms, gap_ms, sums = self.totals.ended(end_ns)
        gap_collective_ms = self.collectives.take_gap_collective_ms()  # the frameworks' waits in the gap
        self._finished_step = max(self._finished_step, global_step)
        if not records or records[-1].fields["global_step"] != global_step:
            return  # not measured (log_interval with nothing listening)
        last = records[-1].fields
        last["iteration_ms"], last["gap_ms"], last["gap_collective_ms"] = iteration_ms, gap_ms, gap_collective_ms
        last["eval_ms"], last["save_ms"] = sums.eval_ms, sums.save_ms  # parts of the gap (eval forwards, saves)
        if not self.step_listeners:
            return
        figures = sums.figures(global_step, records, iteration_ms, gap_ms, gap_collective_ms)
        for listener in self.step_listeners:
            listener(figures)

    def _mark_end(self, step: StepRecord) -> None:
        """The step ends here for now (its forward's end; then its step()'s end, which replaces it)."""
        step.end_ns = perf_counter_ns()
        if self.device_events is not None and step.start_mark is not None:
            self.device_events.release(step.end_mark)
            step.end_mark = self.device_events.mark()

    def _pause(self) -> None:
        """Nothing more is this step's: neither fetches nor collectives."""
        self.collectives.step = None
        if self.fetches is not None:
            self.fetches.pause()

    def _finish_open(self, closing: bool) -> None:
        """Close the open record: take the step's figures and queue it for writing if it is complete."""
        step, self._open = self._open, None
        if step is None:
            return
        self._pause()
        memory = self.memory.record() if self.memory is not None else None
        if not step.complete(closing, closing and optimizer_step_due(self._engine)):
            if self.device_events is not None:
                self.device_events.release(step.start_mark, step.end_mark)
            return  # a count in progress goes on: the next forward may be this micro step's (two forwards)
        fields = step.fields
        if memory is not None:
            fields["memory"] = memory
        if self.flops is not None:
            figures = self.flops.figures()
            if figures is not None:
                fields.update(figures.record_fields())
        if step.written and self.fetches is not None:
            step.fetches = self.fetches.take()
            fields.update(step.fetches.fields)
        if fields["mode"] == "train":
            if not step.ends_optimizer_step:
                fields["iteration_ms"] = fields["gap_ms"] = fields["eval_ms"] = fields["save_ms"] = None
            self._step_records.append(step)
            fetch_wait = fetch_wait_ms(step.fetches.entries()) if step.fetches is not None else 0.0
            self.totals.micro_step(step.start_ns, step.end_ns, step.timing(),
                                   figures if self.flops is not None else None, memory, fetch_wait)
        else:  # an eval or no-grad forward: in the gap of the optimizer step in progress
            self.totals.eval_forward(step.end_ns - step.start_ns)
        if not step.written:
            return
        if self.device_events is not None and step.start_mark is not None:
            step.step_pair = self.device_events.pair(step.start_mark, step.end_mark, step.end_ns - step.start_ns)
            # the times this step's events found the pool exhausted and waited on the device
            fields["device_waits"] = self.device_events.waits - self._waits_at_open
        self._unwritten.append(step)

    def _write_ready(self, settled: bool = False) -> None:
        """Write the queued records whose device times are known (all of them when ``settled``)."""
        if self.device_events is not None:
            self.device_events.poll()
        host_clock = self.device_events is None  # every time is final once taken
        while self._unwritten and (settled or host_clock or all(pair.resolved for pair in self._unwritten[0].pairs())):
            # an interruption while it is built leaves the step queued
            line = self._unwritten[0].line(self._header, self._first_fields, self.device_events is not None)
            self._unwritten.popleft()
            self._first_fields = {}  # the file's first record only
            self.records_file.write(line)

    def close(self) -> None:
        """Write what is finished (an eval forward that ended; no train step whose ``step()`` did not return), give
        the coordinator DeepSpeed's profiler back, close the file.  Device times are awaited ``SETTLE_SECONDS`` at
        most; later ones are written as host times."""
        if self.closed:  # stopped after an error: the collective wrappers (sequence numbers) stayed until now
            self._detach_collectives()
            return
        try:
            if self.writes and not self.records_file.opened:
                self._open_file()  # no forward came: the file says this run recorded nothing
            self._finish_open(closing=True)
            if self.device_events is not None:
                self.device_events.settle(SETTLE_SECONDS)
            self._write_ready(settled=True)
        finally:
            self._detach()

    def _detach(self, collectives_too: bool = True) -> None:
        """Close the file and give the coordinator back as DeepSpeed made it."""
        self._forget_at_exit()
        self._closed = True
        self.records_file.close()
        if self.memory is not None:
            self.memory.close()
        self.collectives.step = None
        if collectives_too:
            self._detach_collectives()
        if self.fetches is not None:
            self.fetches.remove()
        if self.flops is not None:
            self.flops.discard()  # a count in progress leaves the counting mode
        if getattr(self._engine, RECORDER_ATTR, None) is self:
            delattr(self._engine, RECORDER_ATTR)

    def stop_after_error(self, exc: Exception) -> None:
        what = "ZeRO-3 fetch recorder" if self.fetches is not None else "step recorder"
        logger.error("ds_profutils: the %s of engine %r failed (%s: %s); it stops recording and training goes on; "
                     "%s", what, self.name, type(exc).__name__, exc, self.records_file.on_disk())
        if self.closed:
            return
        try:
            self._write_ready(settled=True)  # what finished, on host times where device times are not known
        except Exception:  # the same failure again: the records before it are on disk
            pass
        self._detach(collectives_too=False)  # the hang watchdog still lines ranks up by their sequence numbers
