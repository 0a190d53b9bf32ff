"""Step records without ZeRO-3 fetches (the ``"step_metrics"`` side of the recorder), on the stand-in engine:
the whole iteration, the profiler's active window, and the figures for live metrics on every rank."""
import time

import pytest
import torch

from ds_profutils.config import PartitionedParamProfilerConfig
from ds_profutils.engine import Attachment
from ds_profutils.engine.hooks import Listener, OptimizerStepListener, do_nothing
from ds_profutils.engine.recorder import StepRecorder

from test_flops_windows import Blocks, FailingBackward, TorchEngine, attached, reference, train_step
from test_zero_attach import IDENTITY, Engine, read_records


def attach_recorder(engine, tmp_path, writes=True, log_interval=1, **kwargs):
    settings = PartitionedParamProfilerConfig(enabled=True, output_dir=str(tmp_path), log_interval=log_interval)
    attachment = Attachment(engine, "main", None)
    recorder = StepRecorder(engine, None, settings, name="main", identity=IDENTITY, dtype=torch.float32,
                            device_events=None, memory=None, writes=writes, **kwargs)
    attachment.recorder = recorder
    attachment.add(recorder, recorder.close)
    return attachment


def test_the_record_ending_an_optimizer_step_carries_the_iteration_and_its_gap(tmp_path):
    engine = Engine()
    with attach_recorder(engine, tmp_path, model_numel=123):
        for _ in range(3):
            engine.train_step()
            time.sleep(0.05)  # the program's own work between steps: data loading, logging
    records = read_records(tmp_path)
    assert [record["iteration_ms"] is None for record in records] == [True, False, False]
    assert all(record["iteration_ms"] >= record["gap_ms"] >= 45 for record in records[1:])
    assert all(record["model_numel"] == 123 and record["segment"] == 0 for record in records)
    assert "events" in records[0] and records[0]["events"] == {}  # no coordinator: no fetch events


def test_our_own_work_at_a_steps_end_is_in_the_iteration_not_the_programs_gap(tmp_path):
    """The live exchange (on gloo: waiting for the other ranks) runs as the optimizer step ends, after its record
    closed: the iteration holds it, the gap (the program's time between steps) does not."""
    engine = Engine()
    with attach_recorder(engine, tmp_path, step_listeners=[lambda figures: time.sleep(0.05)]):
        for _ in range(3):
            engine.train_step()
    records = read_records(tmp_path)[1:]
    assert len(records) == 2
    assert all(record["gap_ms"] < 25 and record["iteration_ms"] >= record["step_time_ms"] + 45 for record in records)


def test_a_later_listeners_work_at_a_steps_end_is_ours_too(tmp_path):
    """The engine-driven torch profiler exports its window as ``step()`` returns, after the recorder heard it: that
    time is in the iteration, not in the program's gap."""

    class Exporting(Listener):
        def step_ended(self):
            time.sleep(0.05)

    engine = Engine()
    with attach_recorder(engine, tmp_path) as attachment:
        attachment.add(Exporting(), do_nothing)
        for _ in range(3):
            engine.train_step()
    records = read_records(tmp_path)[1:]
    assert len(records) == 2
    assert all(record["gap_ms"] < 25 and record["iteration_ms"] >= record["step_time_ms"] + 45 for record in records)


def test_a_step_log_interval_skips_still_ends_the_next_ones_iteration(tmp_path):
    engine = Engine()
    with attach_recorder(engine, tmp_path, log_interval=2):
        for _ in range(5):
            engine.train_step()
            time.sleep(0.02)
    records = read_records(tmp_path)
    assert [record["global_step"] for record in records] == [0, 2, 4]
    # from the end of step 1 (not recorded) to the end of step 2: one step and one sleep, not two
    assert records[0]["iteration_ms"] is None and all(15 <= record["iteration_ms"] < 60 for record in records[1:])


def test_steps_in_the_profilers_active_window_say_so(tmp_path):
    engine = Engine()
    with attach_recorder(engine, tmp_path, profiler_active=lambda: engine.global_steps in (1, 2)):
        for _ in range(4):
            engine.train_step()
    assert [record.get("profiler_active") for record in read_records(tmp_path)] == [None, True, True, None]


def test_a_rank_that_writes_no_file_still_hands_every_step_to_its_listeners(tmp_path):
    engine = Engine()
    figures = []
    with attach_recorder(engine, tmp_path, writes=False, step_listeners=[figures.append]):
        for _ in range(3):
            engine.train_step()
            time.sleep(0.02)
    assert not list(tmp_path.iterdir())
    assert [step.global_step for step in figures] == [0, 1, 2]
    assert figures[0].iteration_ms is None and all(step.gap_ms >= 15 for step in figures[1:])
    assert all(step.step_ms > 0 and step.flops is None and step.peak_allocated_bytes is None for step in figures)


EVAL_S, SAVE_S = 0.06, 0.04


class EvaluatingEngine(Engine):
    """The stand-in engine whose eval forwards take EVAL_S and whose ``save_checkpoint`` takes SAVE_S."""

    def __init__(self):
        super().__init__()
        self.module.register_forward_hook(lambda module, args, output: None if module.training else time.sleep(EVAL_S))
        self.saved = []
        self.accumulating = False

    def step(self):
        self.micro_steps += 1
        self.global_steps += 0 if self.accumulating else 1

    def save_checkpoint(self, save_dir, tag=None):
        time.sleep(SAVE_S)
        self.saved.append((save_dir, tag))
        return True


def test_eval_forwards_and_checkpoint_saves_are_named_parts_of_the_next_steps_gap(tmp_path):
    engine = EvaluatingEngine()
    figures = []
    with attach_recorder(engine, tmp_path, step_listeners=[figures.append]):
        engine.train_step()
        engine.eval_forward()
        assert engine.save_checkpoint(str(tmp_path / "checkpoint"), tag="one") is True  # the engine's own result
        engine.train_step()
        engine.train_step()
        assert "save_checkpoint" in vars(engine)  # wrapped on the instance while attached
    assert "save_checkpoint" not in vars(engine) and engine.saved == [(str(tmp_path / "checkpoint"), "one")]
    records = [record for record in read_records(tmp_path) if record["mode"] == "train"]
    assert [(record["eval_ms"], record["save_ms"]) for record in (records[0], records[2])] == [(0.0, 0.0)] * 2
    step = records[1]
    assert step["eval_ms"] >= EVAL_S * 1e3 and step["save_ms"] >= SAVE_S * 1e3
    assert step["eval_ms"] + step["save_ms"] <= step["gap_ms"] <= step["iteration_ms"]
    assert [(step.eval_ms, step.save_ms) for step in figures] == [(record["eval_ms"], record["save_ms"])
                                                                  for record in records]


def test_a_no_grad_forward_in_train_mode_counts_as_eval_and_a_micro_step_record_has_no_gap_parts(tmp_path):
    engine = EvaluatingEngine()
    with attach_recorder(engine, tmp_path):
        engine.train_step()
        with torch.no_grad():  # reference logits (DPO), a hand-written eval loop without model.eval()
            engine.forward()
        engine.forward()
        engine.backward()  # a micro step whose step() does not end an optimizer step
        engine.accumulating = True  # gradient accumulation: this step() leaves the count where it was
        engine.step()
        engine.accumulating = False
        engine.train_step()
    records = read_records(tmp_path)
    assert [record["mode"] for record in records] == ["train", "no_grad", "train", "train"]
    assert records[2]["eval_ms"] is None and records[2]["save_ms"] is None
    assert records[3]["eval_ms"] > 0 and records[3]["save_ms"] == 0.0
    assert records[3]["eval_ms"] <= records[3]["gap_ms"]


def test_a_micro_step_an_error_cut_short_is_no_record_and_its_retry_is_the_steps(tmp_path):
    """An OOM the program catches to retry the batch (transformers' find_executable_batch_size, a loop of its own):
    raised in the backward, in ``step()`` or in the forward, the attempt is no micro step -- the global step has one
    record, numbered as without the attempt, its FLOPs counted whole; the attempt's time is in the iteration's gap."""

    class FailingStepEngine(TorchEngine):
        step_fails = False

        def step(self):
            if self.step_fails:
                self.step_fails = False
                raise torch.OutOfMemoryError("out of memory in the optimizer step (stand-in)")
            super().step()

    engine = FailingStepEngine(Blocks())
    x = torch.randn(8, 32)
    with attached(engine, tmp_path):
        train_step(engine, x)
        with pytest.raises(torch.OutOfMemoryError):  # global step 1: its backward fails
            output = engine(x)
            time.sleep(0.1)
            engine.backward(FailingBackward.apply(output).sum())
        train_step(engine, x)
        with pytest.raises(RuntimeError):  # global step 2: its forward fails
            engine(torch.randn(8, 31))
        time.sleep(0.1)
        train_step(engine, x)
        engine.step_fails = True  # global step 3: its step() fails
        with pytest.raises(torch.OutOfMemoryError):
            engine.backward(engine(x).pow(2).mean())
            time.sleep(0.1)
            engine.step()
        train_step(engine, x)
    records = read_records(tmp_path)
    assert [(record["global_step"], record["micro_step"]) for record in records] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert {record["flops"] for record in records} == {reference(lambda: engine.module(x).pow(2).mean().backward())}
    assert all(record["iteration_ms"] - record["step_time_ms"] >= 100 and record["gap_ms"] >= 100
               for record in records[1:])


def test_an_error_after_the_optimizer_step_or_in_a_side_forward_leaves_the_micro_step_whole(tmp_path):
    """A ``step()`` that raises after its optimizer step was taken (DeepSpeed's monitor and timers come after
    ``_take_model_step``) ended that step; a reference forward under no_grad (DPO's) that raises and is retried
    leaves the policy's micro step awaiting its backward: one train record per global step either way."""

    class MonitorFails(TorchEngine):
        raises = None

        def step(self):
            super().step()
            if self.raises is not None:
                raises, self.raises = self.raises, None
                raise raises("the monitor's write after the optimizer step (stand-in)")

    engine = MonitorFails(Blocks())
    x = torch.randn(8, 32)
    reference_fails = {"next": True}
    forward = engine.module.forward

    def reference_forward(inputs):
        if not torch.is_grad_enabled() and reference_fails["next"]:
            reference_fails["next"] = False
            raise torch.OutOfMemoryError("out of memory in the reference forward (stand-in)")
        return forward(inputs)

    engine.module.forward = reference_forward

    def dpo_step(retry_batch):
        """The policy's forward, the reference's (failing once), retried alone or with the whole batch."""
        output = engine(x)
        with pytest.raises(torch.OutOfMemoryError), torch.no_grad():
            engine(x)
        if retry_batch:
            output = engine(x)
        with torch.no_grad():
            reference = engine(x)
        engine.backward((output - reference).pow(2).mean())
        engine.step()

    steps_ended = []

    class Counting(OptimizerStepListener):
        def optimizer_step_ended(self, global_step):
            steps_ended.append(global_step)

    with attached(engine, tmp_path) as attachment:
        attachment.add(Counting(engine), do_nothing)
        train_step(engine, x)
        engine.raises = RuntimeError
        with pytest.raises(RuntimeError):
            train_step(engine, x)  # global step 1, taken: every listener hears it end
        dpo_step(retry_batch=False)  # global step 2
        reference_fails["next"] = True
        dpo_step(retry_batch=True)  # global step 3
        train_step(engine, x)
        engine.raises = KeyboardInterrupt
        with pytest.raises(KeyboardInterrupt):
            train_step(engine, x)  # global step 5: a program may catch it and go on (ended)
        engine.raises = SystemExit
        with pytest.raises(SystemExit):
            train_step(engine, x)  # global step 6: the profiler's SIGTERM, which a program may catch too (ended)
        train_step(engine, x)
    records = read_records(tmp_path)
    assert [(record["mode"], record["global_step"], record["micro_step"]) for record in records] == [
        ("train", step, step) for step in range(8)]
    assert steps_ended == list(range(8))


@pytest.mark.parametrize("fetch_records", [False, True])
def test_on_the_host_clock_an_async_collectives_wait_is_exposed_unless_fetch_records_count_it(fetch_records):
    """ZeRO-3 on CPU with step_metrics alone: the time blocked in the parameter all-gathers' wait() stalled the step as
    the blocking gradient reduction did, so busy time (step - exposed wait) is the rank's own work, not its waiting
    for a late peer's all-gathers.  With fetch records on, those waits are the fetch waits: counted once."""
    from ds_profutils.engine.step import StepRecord

    step = StepRecord({"mode": "train"}, None, None)
    step.add_collective("all_gather_into_tensor", None, True, 30_000_000, None)  # waited 30 ms in wait()
    step.add_collective("reduce_scatter_tensor", None, False, 5_000_000, None)
    if fetch_records:
        step.fetches = object()  # the step's StepFetches: the all-gathers' waits are its fetch waits
    step.end_ns = step.start_ns + 50_000_000
    timing = step.timing()
    assert timing["collective_ms"] == pytest.approx(35.0)
    assert timing["collective_wait_ms"] == pytest.approx(5.0 if fetch_records else 35.0)
    assert timing["collectives"]["all_gather_into_tensor"]["exposed_ms"] == pytest.approx(0.0 if fetch_records else 30.0)
