"""A killed job keeps every rank's traces and fetch records, under the real deepspeed launcher (2 ranks,
gloo, ZeRO-3, a DataLoader with a worker process), however it is stopped.

DeepSpeed's launch.py, on SIGINT/SIGTERM or a rank exiting non-zero, SIGTERMs each rank's whole process
tree in turn and SIGKILLs it 30 s later; the ``deepspeed`` runner has no handler on one node.  After
each interruption every rank has a parseable ``trace_rank_{r}.json`` holding exactly its recorded
steps under their ``ProfilerStep#N`` numbers, and its per-cycle files; no file is named as unwritten.
Its fetch records hold every step that finished, one whole line each, and the interrupted step's
record is complete or absent.
"""
import json
import os
import signal

import psutil
import pytest

from ds_profutils.report import build_report
from launcher import DIST_SCRIPTS, LauncherJob
from profiler_testing import profiler_steps, read_trace
from report_testing import read_records_file

CYCLE = 11  # one warmup step and ten active: cycle c records steps 11c+1 .. 11c+10
MARKER_STEP = 13  # the script prints "recording" here: cycle 0 is on disk, cycle 1 records
RANKS = (0, 1)


@pytest.fixture
def output_dir(tmp_path):
    return tmp_path / "profiles"


def _job(tmp_path, output_dir, *args):
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "profiler": {"output_dir": str(output_dir), "skip_first": 0, "wait": 0, "warmup": 1, "active": CYCLE - 1,
                     "repeat": 0},
        "partitioned_param_profiler": {"enabled": True, "output_dir": str(output_dir)},
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return LauncherJob(DIST_SCRIPTS / "profiler_interrupted.py",
                       ["--deepspeed_config", str(path), "--marker-step", str(MARKER_STEP), *args])


def _recording_ranks(job):
    """{rank: pid} once both ranks record."""
    return {int(m[1]): int(m[2]) for m in job.wait_for(r"recording rank (\d) pid (\d+)", count=len(RANKS))}


def _assert_each_rank_kept_its_steps(output_dir, output, last=None):
    assert "was not written" not in output, output
    last_steps = {"trace": {}, "records": {}}
    for rank in RANKS:
        trace = read_trace(output_dir / f"trace_rank_{rank}.json")
        steps = profiler_steps(trace)
        assert steps == [n for n in range(1, steps[-1] + 1) if n % CYCLE], (rank, steps)
        assert steps[-1] == last if last is not None else steps[-1] >= MARKER_STEP, (rank, steps)
        assert (trace["ds_profutils"]["rank"], trace["ds_profutils"]["step_numbering"]) == (rank, "global")
        cycles = [profiler_steps(read_trace(p)) for p in sorted((output_dir / f"rank_{rank}").glob("*.pt.trace.json"))]
        assert [step for cycle in cycles for step in cycle] == steps and len(cycles) == steps[-1] // CYCLE + 1
        last_steps["records"][rank] = _assert_records_hold_every_finished_step(output_dir, rank,
                                                                               interrupted_step=steps[-1])
        last_steps["trace"][rank] = steps[-1]
    assert not list(output_dir.rglob(".*")), "temporary files left behind"
    # The report reads every file whole and names exactly the ranks whose files stop before the others'.
    report = build_report(output_dir)
    expected = {(kind, rank) for kind, by_rank in last_steps.items() for rank, step in by_rank.items()
                if step < max(by_rank.values())}
    assert {(entry["kind"], entry["rank"]) for entry in report["incomplete"]} == expected, report["incomplete"]
    assert all(entry["reason"].startswith("ends at step") for entry in report["incomplete"])
    assert report["problems"] == [] and set(report["traces"]) == set(RANKS)


def _assert_records_hold_every_finished_step(output_dir, rank, interrupted_step):
    """Steps before the one in flight finished: each is one whole line.  The step in flight is there only if
    its engine.step() returned before the interruption."""
    records = read_records_file(output_dir / f"zero_fetch_rank_{rank}.jsonl")
    global_steps = [record["global_step"] for record in records]
    assert global_steps == list(range(len(records))) and len(records) in (interrupted_step, interrupted_step + 1)
    assert all(record["mode"] == "train" and record["rank"] == rank and record["events"] for record in records)
    return global_steps[-1]


def test_sigterm_to_the_whole_process_group_as_timeout_and_slurm_send(tmp_path, output_dir):
    """Every process gets SIGTERM at once, then launch.py SIGTERMs rank 0 again while it writes."""
    with _job(tmp_path, output_dir, "--slow-export") as job:
        _recording_ranks(job)
        job.signal_group(signal.SIGTERM)
        status = job.finish()
    assert status == -signal.SIGTERM  # the runner, which has no handler
    assert all(f"rank {rank} interrupted at step" in job.output for rank in RANKS)
    _assert_each_rank_kept_its_steps(output_dir, job.output)


def test_ctrl_c_sigint_to_the_whole_process_group(tmp_path, output_dir):
    with _job(tmp_path, output_dir) as job:
        _recording_ranks(job)
        job.signal_group(signal.SIGINT)
        status = job.finish()
    assert status != 0
    _assert_each_rank_kept_its_steps(output_dir, job.output)


def test_sigterm_to_the_launch_process_only(tmp_path, output_dir):
    """launch.py SIGTERMs rank 0's tree; rank 1 first sees its peer vanish inside a collective."""
    with _job(tmp_path, output_dir) as job:
        _recording_ranks(job)
        launch, = [p for p in psutil.Process(job.process.pid).children() if "deepspeed.launcher.launch" in p.cmdline()]
        launch.terminate()
        status = job.finish()
    assert status == 1 and "Main process received SIGTERM, exiting" in job.output
    _assert_each_rank_kept_its_steps(output_dir, job.output)


def test_one_sigterm_to_each_rank_and_a_second_while_it_writes(tmp_path, output_dir):
    with _job(tmp_path, output_dir, "--slow-export") as job:
        pids = _recording_ranks(job)
        for pid in pids.values():
            os.kill(pid, signal.SIGTERM)
        for rank, pid in pids.items():
            job.wait_for(f"rank {rank} interrupted at step")
            os.kill(pid, signal.SIGTERM)  # the export takes 3 s more: this one comes while it runs
        job.finish()
    assert "exits with return code = -15" in job.output  # launch.py: the first rank to end was killed by SIGTERM
    _assert_each_rank_kept_its_steps(output_dir, job.output)


def test_a_rank_that_raises_mid_window(tmp_path, output_dir):
    """Rank 1 raises at the start of step 16; rank 0 waits for it in step 16's collective until rank 1
    is gone, or launch.py's SIGTERM reaches it first."""
    with _job(tmp_path, output_dir, "--mode", "raise", "--raise-at", "16") as job:
        job.finish()
    assert "ValueError: rank 1 fails at step 16" in job.output
    assert "exits with return code = 1" in job.output
    _assert_each_rank_kept_its_steps(output_dir, job.output, last=16)


def test_sigint_with_the_users_except_keyboardinterrupt(tmp_path, output_dir):
    with _job(tmp_path, output_dir, "--mode", "keyboard") as job:
        for pid in _recording_ranks(job).values():
            os.kill(pid, signal.SIGINT)
        status = job.finish()
    assert status == 0, job.output
    assert all(f"user handler ran on rank {rank}" in job.output for rank in RANKS)
    _assert_each_rank_kept_its_steps(output_dir, job.output)
