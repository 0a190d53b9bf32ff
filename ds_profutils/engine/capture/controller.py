"""CaptureController: one engine's trace captures, riding on the live interval exchange.

Every interval LiveMetrics asks it for this rank's capture columns (:meth:`columns`; on rank 0 this is where
``capture_request.json`` is looked for: one rename, no collective of its own), hands it every exchange's rows
as they are read (:meth:`received`: the same rows, in the same order, on every rank, so every rank holds the
same decisions): a decision from exchange k takes effect at the boundary of exchange k + lag (0 on gloo, 2
on the deferred path, where every rank has read those rows), and its first step S is the step after it, the
same on every rank.  The chosen ranks trace S..S+N-1 (:mod:`.tracer`), following the engine's
optimizer steps as a listener; rank 0 writes the manifest (:mod:`.files`), naming each chosen rank's host
(:mod:`.hosts`: each rank sets it in torch.distributed's store at attach).  Nothing here raises into the
step: a failure is said once and the capture is dropped on this rank (its columns keep their width, so the
exchange stays the same on every rank).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..._signal_exit import close_at_exit
from ...config import ProfilerConfig
from ...logging import logger
from ...outputs import CAPTURE_MANIFEST, MAIN_ENGINE, ProcessIdentity, capture_dir
from ...torch_profiler import calls
from ..hooks import OptimizerStepListener
from .decide import COLUMNS, CaptureDecider, Plan, Request, request_columns
from .files import take_request, write_manifest, write_refusal
from .hosts import HostDirectory, publish_host
from .tracer import CaptureTrace

__all__ = ["CaptureController", "attach_capture"]


class CaptureController(OptimizerStepListener):
    """The captures of ``engine`` (named ``engine_name``) on this rank; ``settings`` is the resolved
    ``"trace_capture"`` section (its ``output_dir`` set), ``options`` the torch.profiler options,
    ``group_rank``/``ranks`` this rank's place in the exchange and the group's global ranks."""

    width = COLUMNS

    def __init__(self, engine: Any, engine_name: str, settings: Any, options: ProfilerConfig,
                 identity: ProcessIdentity, group_rank: int, ranks: List[int]) -> None:
        super().__init__(engine)
        self.settings = settings
        self.options = options
        self.identity = identity
        self.engine_name = engine_name
        self.output_dir = Path(settings.output_dir)
        self.is_reporter = group_rank == 0
        self._hosts = HostDirectory(identity) if self.is_reporter else None  # rank 0: the manifests' hosts
        self.decider = CaptureDecider(settings, list(ranks))
        self._taken = 0  # requests rank 0 took
        self._requests: Dict[int, Request] = {}  # rank 0: the requests taken, by number
        self._unfinished: List[Plan] = []  # rank 0: manifests not yet done
        self._planned: Optional[Plan] = None  # this rank traces it (its first step fixed)
        self._trace: Optional[CaptureTrace] = None
        self._wrote = -1  # the first step of the last capture this rank wrote
        self._failed = False  # an error of ours: no further captures, nor requests taken on rank 0
        self._unwritable = False  # a trace this rank could not write: no further captures here (rank 0 takes requests)
        self._closed = False  # rows read at close (an accelerator's last exchanges) start no capture
        self._forget_at_exit = close_at_exit(self.close)  # a job ending without close() still writes its capture

    # ---- the exchange's side ----------------------------------------------------------------------------

    def columns(self) -> List[float]:
        """This rank's capture columns for this interval's row (rank 0: with a request it takes now)."""
        request = None
        if self.is_reporter and self.settings.on_request and not self._failed:
            try:
                request = take_request(self.output_dir, self._taken + 1)
            except Exception as exc:  # noqa: BLE001 - never into the step
                self._fail(exc)
            if request is not None:
                self._taken = request.number
                self._requests[request.number] = request
        return request_columns(request, self._wrote)

    def received(self, index: int, rows: Sequence[Sequence[float]], columns: Sequence[Sequence[float]],
                 steps: int, global_step: int, lag: int) -> None:
        """Exchange ``index``'s rows (figures and capture columns), read on every rank in order; a capture they
        decide starts ``lag`` intervals on, when every rank holds them (:meth:`.decide.CaptureDecider.decide`)."""
        if self._closed:
            return
        try:
            decision = self.decider.decide(index, rows, columns, steps, global_step, lag)
            if isinstance(decision, Plan):
                if self.is_reporter:
                    self._announce(decision)
                if self.identity.rank in decision.ranks and not (self._failed or self._unwritable):
                    self._planned = decision
            elif isinstance(decision, str) and self.is_reporter:
                request = self._requests.pop(int(columns[0][0]), None)
                write_refusal(self.output_dir, request.request_id if request else "", decision)
            if self.is_reporter:
                self._check_done(columns)
        except Exception as exc:  # noqa: BLE001 - never into the step
            self._fail(exc)

    # ---- the engine's steps on a chosen rank --------------------------------------------------------------

    def forward_started(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        plan, trace = self._planned, self._trace
        if plan is None:
            return
        if trace is not None:
            if not trace.in_step:
                self._guarded(lambda: trace.begin_step(self._global_steps()))
            return
        steps = self._global_steps()
        if steps != plan.first_step:
            if steps is not None and steps > plan.first_step:  # the step was missed (a resumed engine): none
                self._planned = None
            return
        run = calls._current
        if run is not None and run.window_open:
            logger.warning(f"ds_profutils: capture at step {plan.first_step} skipped on this rank: a \"profiler\" "
                           "window is open (one torch profiler at a time; a window already running goes first)")
            self._planned = None
            return
        try:
            self._trace = CaptureTrace(self.options, self._folder(plan), self.identity, self.settings.gzip)
            self._trace.start(plan.first_step)
        except Exception as exc:  # noqa: BLE001 - never into the step
            self._trace = None
            self._fail(exc)

    def optimizer_step_ended(self, global_step: int) -> None:
        plan, trace = self._planned, self._trace
        if plan is None or trace is None:
            return
        if global_step >= plan.first_step + plan.steps - 1:
            self._finish()
        else:
            self._guarded(trace.end_step)

    @property
    def capturing(self) -> bool:
        """Whether a capture records on this rank now (a profiler window starting now is skipped)."""
        return self._trace is not None

    def close(self) -> None:
        """The job ends: a capture still recording is closed and written (its steps so far)."""
        self._forget_at_exit()
        self._closed = True
        if self._trace is not None:
            self._finish()
        steps = self._global_steps()
        for plan in self._unfinished:  # decided, but the job ends before its first step: no capture to list
            if steps is None or steps <= plan.first_step:
                with contextlib.suppress(OSError):
                    (self._folder(plan) / CAPTURE_MANIFEST).unlink()
                    self._folder(plan).rmdir()

    def stop_after_error(self, exc: Exception) -> None:
        self._fail(exc)

    # ---- helpers ------------------------------------------------------------------------------------------

    def _guarded(self, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - never into the step
            self._fail(exc)

    def _finish(self) -> None:
        plan, trace = self._planned, self._trace
        self._planned = self._trace = None
        if trace is None:
            return
        if not trace.write():
            self._unwritable = True  # as the write's ERROR line says
            return
        self._wrote = plan.first_step
        steps = f"{trace.steps[0]}-{trace.steps[-1]}" if trace.steps else "none"
        cut = "" if len(trace.steps) == plan.steps else f" (cut short: {plan.steps} asked)"
        print(f"ds_profutils: capture of steps {steps}{cut} written to {trace.path}", flush=True)

    def _folder(self, plan: Plan) -> Path:
        return capture_dir(self.output_dir, self.engine_name, plan.first_step)

    def _announce(self, plan: Plan) -> None:
        request = self._requests.get(plan.request_number)
        write_manifest(self._folder(plan), plan, self.engine_name, request, done=False,
                       hosts=self._hosts.hosts(plan.ranks))
        self._unfinished.append(plan)
        print(f"ds_profutils: capture ({plan.reason}) of steps {plan.first_step}-{plan.first_step + plan.steps - 1} "
              f"on ranks {plan.ranks} goes to {self._folder(plan)}", flush=True)

    def _check_done(self, columns: Sequence[Sequence[float]]) -> None:
        """Rank 0: a manifest is done once every chosen rank's row says it wrote that capture."""
        written = {rank: int(column[-1]) for rank, column in zip(self.decider.ranks, columns)
                   if column[-1] == column[-1]}  # NaN: a rank whose row is empty (its live figures failed) says nothing
        for plan in list(self._unfinished):
            if all(written.get(rank, -1) >= plan.first_step for rank in plan.ranks):
                self._unfinished.remove(plan)
                write_manifest(self._folder(plan), plan, self.engine_name,
                               self._requests.pop(plan.request_number, None), done=True,
                               hosts=self._hosts.hosts(plan.ranks))

    def _fail(self, exc: BaseException) -> None:
        if not self._failed:
            logger.error(f"ds_profutils: trace capture failed on this rank ({type(exc).__name__}: {exc}); "
                         "no further captures here, training goes on")
        self._failed = True
        self._planned = None
        trace, self._trace = self._trace, None
        if trace is not None:
            trace.write()



def attach_capture(attachment: Any, capture: Any, records_dir: str, profiler: ProfilerConfig,
                   identity: ProcessIdentity) -> None:
    """Put trace captures on ``attachment`` (its live exchange carries them; docs/capture.md): into
    step_metrics' output_dir (``records_dir``) unless trace_capture names its own, with torch.profiler's
    options from the "profiler" section."""
    live = attachment.live
    if live is None:  # no recorder here: nothing feeds the exchange
        return
    publish_host(identity)  # for rank 0's manifests, read when it writes one (no collective: .hosts)
    capture = capture.model_copy(update=dict(output_dir=capture.output_dir or records_dir))
    controller = CaptureController(attachment.engine, attachment.name or MAIN_ENGINE, capture, profiler, identity,
                                   live.group_rank, live.group_ranks)
    live.rider = controller
    attachment.add(controller, controller.close)
    if live.group_rank == 0:
        print(f"ds_profutils: trace captures of engine {attachment.name!r} go to {capture.output_dir}/capture_<S>/ "
              f"(ask with: ds-profutils capture {capture.output_dir})", flush=True)
