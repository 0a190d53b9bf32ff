"""``attach`` on a real ``PipelineEngine`` (one stage, a world of one: no launcher start): one record per
``train_batch()`` with its instruction times, the eval batch as an eval record, bounded memory, and the engine
and its class as DeepSpeed made them after ``close()``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from launcher import DIST_SCRIPTS, run_one_rank
from report_testing import read_records_file, records_file

STEPS = 12


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pipeline_one_rank")
    run_one_rank([str(DIST_SCRIPTS / "pipeline_job.py"), "--out", str(out), "--steps", str(STEPS)], timeout=600)
    return out


def test_one_record_per_train_batch_with_instruction_times(job: Path) -> None:
    records = read_records_file(records_file(job, 0))
    train = [r for r in records if r["mode"] == "train"]
    assert [r["global_step"] for r in train] == list(range(STEPS))  # not one per micro batch
    for r in train:
        assert (r["pipe_stage"], r["pipe_stages"], r["data_parallel_rank"], r["micro_batches"]) == (0, 1, 0, 8)
        kinds = r["instructions_ms"]
        assert {"LoadMicroBatch", "ForwardPass", "BackwardPass", "ReduceGrads", "OptimizerStep"} <= set(kinds)
        assert not {"SendActivation", "RecvActivation", "SendGrad", "RecvGrad"} & set(kinds)  # one stage: no p2p
        assert r["compute_ms"] == pytest.approx(kinds["ForwardPass"] + kinds["BackwardPass"])
        assert r["p2p_ms"] == 0.0 and r["bubble_ms"] == pytest.approx(r["other_ms"])
        assert sum(kinds.values()) + r["other_ms"] == pytest.approx(r["step_time_ms"], rel=1e-6)
    assert all(r["iteration_ms"] is not None for r in train[1:])  # every train_batch ends an optimizer step


def test_flops_are_the_stages_layers_forward_and_backward_per_micro_batch(job: Path) -> None:
    reference = json.loads((job / "found_rank_0.json").read_text())["reference_flops_per_micro_batch"]
    train = [r for r in read_records_file(records_file(job, 0)) if r["mode"] == "train"]
    assert reference > 0
    assert {(r["flops"], r["flops_source"]) for r in train} == {(8 * reference, "counted")}


def test_eval_batch_is_an_eval_record_at_the_current_step(job: Path) -> None:
    evals = [r for r in read_records_file(records_file(job, 0)) if r["mode"] == "eval"]
    assert len(evals) == 1
    assert evals[0]["global_step"] == STEPS and evals[0]["micro_batches"] == 8
    assert "BackwardPass" not in evals[0]["instructions_ms"]


def test_memory_bounded_and_engine_restored(job: Path) -> None:
    found = json.loads((job / "found_rank_0.json").read_text())
    assert found["global_steps"] == STEPS
    assert found["held_step_records"] <= 1  # today's micro-step records held forever: one per micro batch
    assert found["instance_attributes_left"] == []
    assert all(name.startswith("PipelineEngine._exec_") for name in found["class_map"])


def test_a_failing_recorder_leaves_training_and_the_engine_as_deepspeeds(tmp_path: Path) -> None:
    done = run_one_rank([str(DIST_SCRIPTS / "pipeline_job.py"), "--out", str(tmp_path), "--steps", "6",
                         "--break-after", "3", "--monitor-fails-at", "1"], timeout=600)
    found = json.loads((tmp_path / "found_rank_0.json").read_text())
    assert found["global_steps"] == 6  # every batch trained
    assert found["instance_attributes_left"] == []  # its last listener gone, the hooks came off at once
    assert "step recorder of engine 'main' failed (ZeroDivisionError" in done.stdout + done.stderr
    train = [r for r in read_records_file(records_file(tmp_path, 0)) if r["mode"] == "train"]
    # the batches before the failure, batch 1 too: it raised after its optimizer step (the monitor's write)
    assert [r["global_step"] for r in train] == [0, 1, 2]
