"""``"step_metrics"`` under the ``deepspeed`` launcher (2 ranks, gloo, CPU): step records below ZeRO-3.

One launcher start (tests/dist_scripts/step_metrics_job.py) trains a ZeRO-2 engine whose rank 1 sleeps
80 ms between steps, then a ZeRO-1 engine recording on rank 0 only and a stage-0 engine with gradient
accumulation 2 and one more hidden layer (the diff of its records and the ZeRO-2 engine's must warn).
The job shares the machine with others, so what is asserted is what load cannot move:
the sleep is in rank 1's gap and not in rank 0's, rank 1 is named, FLOPs are a count, not a time.
"""
import json
import subprocess
import sys

import pytest

from ds_profutils.cli import main

from launcher import DIST_SCRIPTS, REPO, run_deepspeed
from report_testing import read_records_file


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("step_metrics")
    run_deepspeed(DIST_SCRIPTS / "step_metrics_job.py", ["--out", str(out)])
    found = {rank: json.loads((out / f"found_rank_{rank}.json").read_text()) for rank in (0, 1)}
    return out, found


def report_json(directory, capsys):
    assert main(["report", str(directory), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_zero2_records_name_the_rank_that_sleeps_between_steps_by_its_gap(job, capsys):
    out, _ = job
    engine = report_json(out / "zero2", capsys)["engines"]["main"]
    assert engine["ranks"] == [0, 1] and engine["straggler_ranks"] == [1]
    late, waiting = engine["ranks_summary"]["1"], engine["ranks_summary"]["0"]
    assert late["gap_ms_median"] >= 70 and waiting["gap_ms_median"] < 20, (late, waiting)
    assert late["late_by_gap"] is True
    assert sorted(engine["memory"]["ranks"]) == ["0", "1"]
    assert engine["model_numel"] == 64 * 256 + 256 + 256 * 256 + 256 + 256 + 1


def numel(hidden):
    """The parameter count of step_metrics_job.Net with ``hidden`` 256-wide hidden layers."""
    return 64 * 256 + 256 + hidden * (256 * 256 + 256) + 256 + 1


def test_the_diff_of_a_smaller_and_a_larger_model_warns_first_and_lists_model_numel(job):
    """``ds-profutils diff`` as a user runs it, on two engines of one job whose models differ by a layer."""
    out, _ = job
    done = subprocess.run([sys.executable, "-m", "ds_profutils", "diff", str(out / "zero2"), str(out / "stage0")],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    small, large = numel(1), numel(2)
    assert done.stdout.splitlines()[1].startswith("WARNING: engine main: the runs trained models of different sizes")
    text = " ".join(done.stdout.split())  # the text wraps its lines
    assert (f"WARNING: engine main: the runs trained models of different sizes (model_numel {small:,} -> {large:,}): "
            "this compares two different jobs.") in text, done.stdout
    settings = text[text.index("Settings that differ:"):]
    assert f"model_numel {small} -> {large}" in settings.split(". ")[0], done.stdout
    same = subprocess.run([sys.executable, "-m", "ds_profutils", "diff", str(out / "zero2"), str(out / "zero1")],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert same.returncode == 0 and "WARNING" not in same.stdout, same.stdout + same.stderr


def test_records_carry_the_iteration_flops_and_batch_of_each_step(job):
    out, found = job
    for rank in (0, 1):
        records = read_records_file(out / "zero2" / f"zero_fetch_rank_{rank}.jsonl")
        assert [record["global_step"] for record in records] == list(range(16))
        assert {record["segment"] for record in records} == {0}
        assert records[0]["iteration_ms"] is None and all(record["iteration_ms"] > 0 for record in records[1:])
        reference = found[rank]["reference_flops"]
        for record in records:  # one micro step per optimizer step: the record's FLOPs are the step's
            assert abs(record["flops"] - reference) <= 0.1 * reference, (record["flops"], reference)
            assert (record["samples"], record["tokens"], record["flops_source"]) == (8, None, "counted")
        assert records[0]["peak_tflops"] is None  # CPU, no step_metrics.peak_tflops


def test_every_optimizer_step_reaches_the_step_listeners_on_every_rank(job):
    _, found = job
    for rank in (0, 1):
        figures = found[rank]["zero2_figures"]
        assert [step["global_step"] for step in figures] == list(range(16))
        assert figures[0]["iteration_ms"] is None
        assert all(step["flops"] == figures[0]["flops"] and step["samples"] == 8 for step in figures)
        assert all(step["iteration_ms"] >= step["gap_ms"] >= 0 for step in figures[1:])
        assert all(step["peak_allocated_bytes"] > 0 for step in figures)
    assert min(step["gap_ms"] for step in found[1]["zero2_figures"][1:]) >= 70
    # ZeRO-1 recording on rank 0 only: rank 1 writes nothing and still measures for its listeners
    assert [len(found[rank]["zero1_figures"]) for rank in (0, 1)] == [3, 3]


def test_zero1_and_stage0_engines_give_records(job, capsys):
    out, found = job
    assert sorted(path.name for path in (out / "zero1").iterdir()) == ["zero_fetch_zero1_rank_0.jsonl"]
    zero1 = read_records_file(out / "zero1" / "zero_fetch_zero1_rank_0.jsonl")
    assert [record["global_step"] for record in zero1] == [0, 1, 2] and all("all_reduce" in str(record["collectives"])
                                                                            for record in zero1)
    stage0 = read_records_file(out / "stage0" / "zero_fetch_stage0_rank_1.jsonl")
    assert [record["global_step"] for record in stage0] == [0, 0, 1, 1, 2, 2]
    # gradient accumulation 2: the record that ends the optimizer step carries the iteration, the other none
    assert [record["iteration_ms"] is None for record in stage0] == [True, True, True, False, True, False]
    assert all(record["gap_ms"] is None for record in stage0[::2])
    report = report_json(out / "stage0", capsys)["engines"]["stage0"]
    assert report["ranks"] == [0, 1] and report["ranks_summary"]["1"]["steps"] == 3
    assert "partitioned_param_profiler" in found[0]["refused"] and "step_metrics" in found[0]["refused"]
