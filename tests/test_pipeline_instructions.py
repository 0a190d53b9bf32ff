"""One pipeline batch's instruction times (engine/pipeline/instructions.py) on the device clock, with stand-in
device events whose stream clock the test moves (tests/stream_clock.py): each instruction is timed between two
events, and the grouped figures follow; a raising instruction leaves nothing behind."""
from __future__ import annotations

import pytest
from stream_clock import StreamClockAccelerator

from ds_profutils._device_clock import DeviceEvents
from ds_profutils.engine.hooks import BETWEEN_STEPS
from ds_profutils.engine.pipeline import InstructionTimes, PipelineHooks


def test_device_times_by_kind_and_grouped() -> None:
    accelerator = StreamClockAccelerator()
    times = InstructionTimes(DeviceEvents(accelerator.Event))
    for kind, device_ms in (("LoadMicroBatch", 0.5), ("ForwardPass", 3.0), ("SendActivation", 4.0),
                            ("RecvGrad", 1.0), ("BackwardPass", 6.0), ("ReduceGrads", 2.0), ("OptimizerStep", 1.5),
                            ("ForwardPass", 3.0)):
        times.run(kind, lambda engine, ms=device_ms: accelerator.advance(ms), None, {})
    times.device_events.poll()
    figures = times.fields(step_ms=25.0)
    assert figures["instructions_ms"] == {"LoadMicroBatch": 0.5, "ForwardPass": 6.0, "SendActivation": 4.0,
                                          "RecvGrad": 1.0, "BackwardPass": 6.0, "ReduceGrads": 2.0,
                                          "OptimizerStep": 1.5}
    assert (figures["compute_ms"], figures["p2p_ms"], figures["reduce_ms"], figures["optimizer_ms"],
            figures["load_ms"]) == (12.0, 5.0, 2.0, 1.5, 0.5)
    assert figures["other_ms"] == pytest.approx(4.0) and figures["bubble_ms"] == pytest.approx(9.0)
    assert figures["bubble_share"] == pytest.approx(9.0 / 25.0) and figures["micro_batches"] == 2
    assert len(times.pairs()) == 8


def test_a_raising_instruction_gives_its_events_back() -> None:
    accelerator = StreamClockAccelerator()
    events = DeviceEvents(accelerator.Event)
    times = InstructionTimes(events)

    def fails(engine: object) -> None:
        raise RuntimeError("the engine's own error")

    with pytest.raises(RuntimeError, match="the engine's own error"):
        times.run("SendGrad", fails, None, {})
    assert times.pairs() == [] and times.fields(10.0)["instructions_ms"] == {}
    assert len(events._free) == 1  # its start event is free again


def test_host_clock_without_device_events() -> None:
    times = InstructionTimes(None)
    assert times.run("ForwardPass", lambda engine, value: value, None, {"value": 7}) == 7
    assert times.pairs() == [] and times.fields(1000.0)["compute_ms"] > 0


def test_a_stage_is_in_the_phase_of_the_instruction_it_runs() -> None:
    """What the hang watchdog says of a stuck stage (docs/hangs.md): one stuck in a backward pass, or waiting for
    its gradient, is in its backward, not in the batch's forward; between batches, between steps."""
    kinds = [type(name, (), {}) for name in ("LoadMicroBatch", "ForwardPass", "SendActivation", "RecvGrad",
                                             "BackwardPass", "SendGrad", "ReduceGrads", "OptimizerStep")]
    seen = []

    class Stage:
        """DeepSpeed's dispatch: ``_exec_schedule`` calls ``self._INSTRUCTION_MAP[type(command)]`` on the engine."""

        def __init__(self) -> None:
            self._INSTRUCTION_MAP = {kind: lambda engine, kind=kind: seen.append((kind.__name__, hooks.phase))
                                     for kind in kinds}

        def train_batch(self) -> None:
            for kind in kinds:
                self._INSTRUCTION_MAP[kind](self)

        def eval_batch(self) -> None:
            pass

    stage = Stage()
    hooks = PipelineHooks(stage)
    stage.train_batch()
    assert seen == [("LoadMicroBatch", "forward"), ("ForwardPass", "forward"), ("SendActivation", "forward"),
                    ("RecvGrad", "backward"), ("BackwardPass", "backward"), ("SendGrad", "backward"),
                    ("ReduceGrads", "step"), ("OptimizerStep", "step")]
    assert hooks.phase == BETWEEN_STEPS
    hooks.remove()
