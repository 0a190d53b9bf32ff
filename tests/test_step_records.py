"""Step records without ZeRO-3 fetches (the ``"step_metrics"`` side of the recorder), on the stand-in engine:
the whole iteration, the profiler's active window, and the figures for live metrics on every rank."""
import time

import torch

from ds_profutils.config import PartitionedParamProfilerConfig
from ds_profutils.engine import Attachment
from ds_profutils.engine.recorder import StepRecorder

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
