"""One ``attach(...)`` line in a transformers Trainer job and in an Accelerate job, under their real launchers
(2 ranks, gloo, ZeRO-3 from a ds_config with our sections, gradient accumulation 2).

One launcher start per framework checks everything: records for every micro step keyed by the
engine's global step, evaluation forwards recorded as eval during training, a second ``train()``
(a resume from a checkpoint: a new engine) or a second attach appending to the same file, traces of
the torch profiler the engine drives (no decorator) whose ``ProfilerStep#N`` are those global steps,
continued by each phase, the report reading them; then the job trains on until the test sends SIGTERM
to its process group, and every rank's files still hold every finished step, each line and trace whole.
"""
import json
import re
import signal
import types

import pytest

from ds_profutils.report import build_report, render_text
from launcher import DIST_SCRIPTS, REPO, LauncherJob, accelerate_launch
from profiler_testing import profiler_steps, read_trace
from report_testing import read_records_file

RANKS = (0, 1)
RESUMED_AT, FINISHED_AT = 4, 8  # the phases of each job end at these global steps (see the job scripts)
KILL_AFTER = 12  # the test's SIGTERM comes once both ranks finished this global step
JOB_ENV = {"HF_HUB_OFFLINE": "1"}


PHASE_STARTS = (0, RESUMED_AT, FINISHED_AT)  # each phase attaches anew: its profiler's schedule starts there
SCHEDULE = {"skip_first": 0, "wait": 0, "warmup": 1, "active": 2, "repeat": 0}


def profiler_section(out):
    """Driven by the engine ``attach`` found: every cycle is a warmup step and two active steps."""
    return {"output_dir": str(out / "records"), **SCHEDULE}


def scheduled_steps(last):
    """The global steps the schedule records up to ``last``: each phase counts from its own start."""
    cycle = SCHEDULE["warmup"] + SCHEDULE["active"]
    ends = (*PHASE_STARTS[1:], last + 1)
    return [step for start, end in zip(PHASE_STARTS, ends) for step in range(start, end)
            if (step - start) % cycle >= SCHEDULE["warmup"]]


def records_section(out):
    return {"enabled": True, "output_dir": str(out / "records"), "log_interval": 1, "memory": True}


def trainer_config(out):
    """The demo's ds_config ("auto" values the Trainer fills), without its scheduler: a resumed run would
    find the first run's step count filled in, and the demo's decay already at its end."""
    config = json.loads((REPO / "ds_configs" / "hf_trainer_zero3.json").read_text())
    del config["scheduler"]
    config.update(partitioned_param_profiler=records_section(out), profiler=profiler_section(out))
    return config


def accelerate_config(out):
    """The optimizer is made in code, so the config has none."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 10**6,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "partitioned_param_profiler": records_section(out),
        "profiler": profiler_section(out),
    }


def run_until_killed(out, script, args, launcher=None):
    """Start the job, SIGTERM its whole process group once both ranks finished KILL_AFTER; what it left."""
    kwargs = {} if launcher is None else {"launcher": launcher}
    with LauncherJob(script, [*args, "--out", str(out), "--until-killed"], env=JOB_ENV, **kwargs) as job:
        # (?!\d), not \b: two ranks' lines may share one ("...step 12rank 1 finished global step 12")
        job.wait_for(rf"rank \d finished global step {KILL_AFTER}(?!\d)", count=len(RANKS), timeout=400)
        job.signal_group(signal.SIGTERM)
        status = job.finish()
    finished = {rank: max(int(step) for step in re.findall(rf"rank {rank} finished global step (\d+)", job.output))
                for rank in RANKS}
    return types.SimpleNamespace(out=out, output=job.output, status=status, finished=finished,
                                 findings={rank: json.loads((out / f"findings_rank_{rank}.json").read_text())
                                           for rank in RANKS},
                                 records={rank: read_records_file(out / "records" / f"zero_fetch_rank_{rank}.jsonl")
                                          for rank in RANKS},
                                 traces={rank: read_trace(out / "records" / f"trace_rank_{rank}.json") for rank in RANKS})


@pytest.fixture(scope="module")
def trainer_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_trainer")
    (out / "ds_config.json").write_text(json.dumps(trainer_config(out)))
    return run_until_killed(out, DIST_SCRIPTS / "hf_trainer_job.py", ["--deepspeed", str(out / "ds_config.json")])


@pytest.fixture(scope="module")
def accelerate_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerate")
    (out / "ds_config.json").write_text(json.dumps(accelerate_config(out)))
    return run_until_killed(out, DIST_SCRIPTS / "accelerate_job.py", [], accelerate_launch(out / "ds_config.json"))


# Per framework: the job, and how many eval forwards each evaluation runs per rank (the Trainer evaluates
# 8 samples, 2 per batch, split over 2 ranks; the Accelerate job runs one forward).
JOBS = {"trainer": ("trainer_job", 2), "accelerate": ("accelerate_job", 1)}


@pytest.fixture(params=list(JOBS))
def job(request):
    fixture, evals = JOBS[request.param]
    return request.getfixturevalue(fixture), evals


@pytest.mark.parametrize("rank", RANKS)
def test_a_record_for_every_micro_step_keyed_by_the_engines_global_step(job, rank):
    run, _ = job
    train = [record for record in run.records[rank] if record["mode"] == "train"]
    steps = [record["global_step"] for record in train]
    # two micro steps per optimizer step, in order, through both phases and the killed one, nothing else
    assert steps == [n // 2 for n in range(len(steps))]
    # each micro step its own micro_step (DeepSpeed's engine.micro_steps moves only at the boundary here)
    assert [record["micro_step"] for record in train] == list(range(len(train)))
    assert len(steps) >= 2 * run.finished[rank] >= 2 * KILL_AFTER  # every finished step is there
    assert all(record["rank"] == rank and record["world_size"] == 2 and record["engine"] == "main" for record in train)
    assert all(record["events"]["forward_fetch_wait"]["count"] > 0 for record in train)  # ZeRO-3 fetched
    assert all(record["memory"]["peak_allocated_bytes"] > 0 for record in train)  # the config's memory switch


@pytest.mark.parametrize("rank", RANKS)
def test_evaluation_forwards_during_training_are_recorded_as_eval(job, rank):
    run, per_evaluation = job
    evals = [record["global_step"] for record in run.records[rank] if record["mode"] == "eval"]
    before_the_kill = [step for step in evals if step <= FINISHED_AT]
    assert before_the_kill == [step for step in (2, 4, 6, 8) for _ in range(per_evaluation)]
    assert all(record["events"]["forward_fetch_wait"]["count"] > 0 for record in run.records[rank]
               if record["mode"] == "eval")


def test_the_trainer_attaches_each_trains_engine_under_one_name_and_appends(trainer_job):
    for rank in RANKS:
        findings = trainer_job.findings[rank]
        assert findings["attach_again_same"]
        assert findings["after_first"] == {"name": "main", "attachment": False, "engine_steps": RESUMED_AT}
        assert findings["after_second"] == {"name": "main", "attachment": False, "new_engine": True,
                                            "engine_steps": FINISHED_AT, "engine_given_back": True}
        assert findings["attached_to_current_engine_at_every_step"] and findings["steps_watched"] == FINISHED_AT
        # the resumed engine's records follow the first one's in the same file, its micro steps counted on from
        # the global step it resumed at (2 per optimizer step)
        resumed = [record for record in trainer_job.records[rank]
                   if record["mode"] == "train" and record["global_step"] == RESUMED_AT]
        assert [record["micro_step"] for record in resumed] == [2 * RESUMED_AT, 2 * RESUMED_AT + 1] and {record["pid"] for record in trainer_job.records[rank]} == {
            trainer_job.records[rank][0]["pid"]}
    assert not list((trainer_job.out / "records").glob("zero_fetch_engine*"))  # no second series beside "main"


def test_accelerate_takes_the_prepared_engine_and_a_second_attach_appends(accelerate_job):
    for rank in RANKS:
        assert accelerate_job.findings[rank] == {"attach_again_same": True, "name": "main",
                                                 "engine_is_the_prepared_model": True,
                                                 "second": {"new_attachment": True, "name": "main"},
                                                 "engine_steps": FINISHED_AT}


@pytest.mark.parametrize("rank", RANKS)
def test_the_engine_drives_the_profiler_profilerstep_n_is_the_records_global_step(job, rank):
    """No decorator, no step_profiler(): the trace holds the scheduled optimizer steps of every phase, in
    one run trace the later phases continued, up to where the SIGTERM cut the last window (which was
    written whole, json.load above); a window cut by the kill ends at most a cycle before the rank's last step."""
    run, _ = job
    steps = profiler_steps(run.traces[rank])
    assert steps == scheduled_steps(steps[-1]), steps
    assert steps[-1] >= KILL_AFTER and steps[-1] >= run.finished[rank] - 3
    assert set(steps) <= {record["global_step"] for record in run.records[rank] if record["mode"] == "train"}
    assert run.traces[rank]["ds_profutils"]["step_numbering"] == "global"


def test_sigterm_to_the_process_group_leaves_every_ranks_records_whole(job):
    """read_records_file fails on a torn line; the steps are checked above.  The job ends by SIGTERM."""
    run, _ = job
    assert run.status != 0
    assert all(run.finished[rank] >= KILL_AFTER for rank in RANKS)
    assert "Traceback" not in run.output.split(f"finished global step {KILL_AFTER}")[0], run.output[-3000:]


def test_the_report_reads_every_record(job):
    run, _ = job
    report = build_report(run.out / "records")
    assert report["problems"] == [] and list(report["engines"]) == ["main"]
    engine = report["engines"]["main"]
    assert engine["ranks"] == list(RANKS)
    assert engine["records"] == {mode: sum(record["mode"] == mode for rank in RANKS for record in run.records[rank])
                                 for mode in ("train", "eval")}


def test_the_memory_rise_after_the_trainers_profiled_steps_is_marked_as_the_profilers(trainer_job):
    """The torch profiler's own buffers raise the process's memory at the end of its first window (the trace is
    built there): the report's jump at the step after it is marked ``during_profiler``, and said in the text;
    every jump is marked exactly where it starts in a step the records call profiled, or the step after one."""
    report = build_report(trainer_job.out / "records")
    memory = report["engines"]["main"]["memory"]
    first_window = scheduled_steps(RESUMED_AT)[:SCHEDULE["active"]]
    for rank in RANKS:
        profiled = {record["global_step"] for record in trainer_job.records[rank] if record.get("profiler_active")}
        assert set(first_window) <= profiled, profiled
        jumps = [jump for jump in memory["jumps"] if jump["rank"] == rank]
        assert [jump["during_profiler"] for jump in jumps] == [
            jump["global_step"] in profiled or jump["global_step"] - 1 in profiled for jump in jumps]
        after = [jump for jump in jumps if jump["global_step"] == first_window[-1] + 1]
        assert after and after[0]["during_profiler"], memory["jumps"]
    text = " ".join(render_text(report).split())  # the text wraps its lines
    assert "during the torch profiler's window (its own buffers, not a leak)" in text
