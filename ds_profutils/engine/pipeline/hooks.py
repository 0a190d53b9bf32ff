"""The hooks ``attach`` puts on a ``PipelineEngine``: ``train_batch()``/``eval_batch()`` as the step, and its
instructions timed.

The listeners are those of every engine (:class:`..hooks.Listener`: the step recorder, the engine-driven
profiler, the memory snapshots), told of one whole batch: ``step_started`` and ``forward_started`` when
``train_batch()`` starts, ``forward_ended`` and ``step_ended`` when it returns (its optimizer step has moved
``global_steps`` by then); ``eval_batch()`` is an eval forward at the current global step.  The forward is told
with a stand-in whose ``training`` says the batch's mode, since DeepSpeed sets the module's mode only inside.

Instruction times come from the engine's instruction dispatch: ``_exec_schedule`` binds each instruction's
function from ``self._INSTRUCTION_MAP``, so an instance attribute of that name, holding each function wrapped,
times them all without touching the class (other engines in the process stay DeepSpeed's).  ``remove()``
gives the instance back what it held.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from ...logging import warning_once
from ..hooks import BETWEEN_STEPS, EngineHooks, running
from ..recorder import StepRecorder
from ..step import optimizer_step_taken
from .flops import StageFlops
from .instructions import InstructionTimes

__all__ = ["PipelineHooks", "is_pipeline_engine"]

_MAP = "_INSTRUCTION_MAP"
_ABSENT = object()
_PHASES = {"LoadMicroBatch": "forward", "ForwardPass": "forward", "SendActivation": "forward",
           "RecvActivation": "forward", "BackwardPass": "backward", "SendGrad": "backward", "RecvGrad": "backward",
           "ReduceTiedGrads": "step", "ReduceGrads": "step", "OptimizerStep": "step"}
"""The phase each instruction of DeepSpeed's schedule is part of (what the hang watchdog says a stage stuck in it
is in); another kind leaves the phase as it was."""


def is_pipeline_engine(engine: Any) -> bool:
    """Whether ``engine`` is DeepSpeed's ``PipelineEngine`` (imported only when the engine may be one)."""
    if not hasattr(engine, _MAP):
        return False
    from deepspeed.runtime.pipe.engine import PipelineEngine

    return isinstance(engine, PipelineEngine)


class _ModeView:
    """What the listeners read of the module at a batch's start: its mode (``training``)."""

    __slots__ = ("training", )

    def __init__(self, training: bool) -> None:
        self.training = training


class PipelineHooks(EngineHooks):
    """:class:`..hooks.EngineHooks`' listeners, wrappers and removal, with the batch as the step (module doc)."""

    def __init__(self, engine: Any) -> None:
        self._times: Optional[InstructionTimes] = None  # the batch in progress, where its record is measured
        self._training = False  # the batch in progress is a train batch (its forward and backward are counted)
        self.flops = StageFlops()
        super().__init__(engine)

    def _hook(self, engine: Any) -> None:
        """Not the module's forward (once per micro batch here), nor backward and step (which raise on a
        PipelineEngine): the batch calls and the instruction map."""
        self._wrap("train_batch", lambda call, *args, **kwargs: self._around_batch(True, call, *args, **kwargs))
        self._wrap("eval_batch", lambda call, *args, **kwargs: self._around_batch(False, call, *args, **kwargs))
        self._map_before = vars(engine).get(_MAP, _ABSENT)
        self._map = {kind: self._timed(kind.__name__, function) for kind, function in getattr(engine, _MAP).items()}
        setattr(engine, _MAP, self._map)

    def _timed(self, kind: str, function: Callable[..., Any]) -> Callable[..., Any]:
        phase = _PHASES.get(kind)

        def timed(engine: Any, **kwargs: Any) -> Any:
            if phase is not None:
                self.phase = phase
            times = self._times
            if times is None:
                return function(engine, **kwargs)
            if self._training and self.flops.wants(kind):
                return self.flops.count(kind, lambda: times.run(kind, function, engine, kwargs))
            return times.run(kind, function, engine, kwargs)

        timed.__name__ = getattr(function, "__name__", kind)
        return timed

    def remove(self) -> None:
        super().remove()
        engine = self.engine
        if engine is not None and vars(engine).get(_MAP) is self._map:
            if self._map_before is _ABSENT:
                delattr(engine, _MAP)
            else:
                setattr(engine, _MAP, self._map_before)
        self._times = None

    def _around_batch(self, train: bool, batch: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        view = _ModeView(train)
        outside, running.engine_id = running.engine_id, self._engine_id
        self.phase = "forward"  # until its first instruction says which (_PHASES)
        before, ended = getattr(self.engine, "global_steps", None), True
        try:
            if train:
                self._tell("step_started")
            self._tell("forward_started", view, (), {})
            self._times, self._training = self._batch_times(), train
            result = self._around_call(batch, *args, **kwargs)
            if train and self._times is not None:
                self._times.flops_per_micro_batch = self.flops.per_micro_batch
                self._times.hardware_flops_per_micro_batch = self.flops.hardware_per_micro_batch
            return result
        except BaseException:  # as a step() (..hooks.EngineHooks._around_step)
            ended = train and optimizer_step_taken(self.engine, before)
            raise
        finally:
            running.engine_id = outside
            self._times, self._training = None, False
            self.phase = BETWEEN_STEPS
            if ended:
                self._tell("forward_ended", view, None)
                if train:
                    self._step_ended(before)

    def _batch_times(self) -> Optional[InstructionTimes]:
        """The batch's instruction times, put on the record the recorder opened for it (None: none measured)."""
        try:
            for listener in self.listeners:
                record = listener.collectives.step if isinstance(listener, StepRecorder) else None
                if record is not None:
                    engine = self.engine
                    record.fields.update(pipe_stage=engine.stage_id, pipe_stages=engine.num_stages,
                                         data_parallel_rank=engine.grid.data_parallel_id)
                    times = InstructionTimes(listener.device_events if record.start_mark is not None else None)
                    record.parts.append(times)
                    return times
        except Exception as exc:  # noqa: BLE001 - the batch runs untimed; nothing reaches the training loop
            warning_once(f"ds_profutils: pipeline instruction times not recorded ({type(exc).__name__}: {exc})")
        return None
