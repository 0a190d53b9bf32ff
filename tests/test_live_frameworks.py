"""The live step figures where each framework's job already reports, from its one ``attach`` line (Lightning:
its callback), under the framework's real launcher: 2 ranks on gloo, ZeRO-2, ``"step_metrics"`` on with
``monitor_interval`` 2 and ``peak_tflops`` set, 8 optimizer steps (tests/dist_scripts/live_frameworks_job.py).

* a transformers ``Trainer`` with ``report_to=["tensorboard"]`` (``deepspeed`` launcher);
* Accelerate with a TensorBoard tracker whose ``init_trackers`` runs after ``attach(accelerator)``, and
  DeepSpeed's ``csv_monitor`` in the same ds_config (``accelerate launch``);
* Lightning's ``TensorBoardLogger`` (one process per rank, ``DeepSpeedStrategy``'s CUDA check bypassed).

Each job is started once; its TensorBoard files are read back with TensorBoard's own ``EventAccumulator``.
"""
import csv
import json
import re
import sys
import types
from pathlib import Path

import pytest

from launcher import DIST_SCRIPTS, LauncherJob, accelerate_launch, run_deepspeed, run_ranks_as_nodes

pytest.importorskip("tensorboard")
from tensorboard_testing import scalars  # noqa: E402

sys.path.insert(0, str(DIST_SCRIPTS))
from live_frameworks_job import INTERVAL, PEAK_TFLOPS, STEPS, accelerate_config  # noqa: E402

SCRIPT = DIST_SCRIPTS / "live_frameworks_job.py"
RANKS = (0, 1)
INTERVAL_ENDS = list(range(INTERVAL - 1, STEPS, INTERVAL))  # the global steps (from 0) that end an interval
JOB_ENV = {"HF_HUB_OFFLINE": "1"}
FIGURES = ("step_ms", "iteration_ms", "tflops", "mfu", "tokens_per_s", "straggler_rank")
"""Known in every job: each model's FLOPs are counted and its batches hold token ids (no memory figure on CPU
is asked of them)."""


def finished(out: Path, tensorboard: Path, rank0_output: str, output: str) -> types.SimpleNamespace:
    findings = {rank: json.loads((out / f"findings_rank_{rank}.json").read_text()) for rank in RANKS}
    return types.SimpleNamespace(out=out, scalars=scalars(tensorboard), rank0_output=rank0_output, output=output,
                                 findings=findings)


@pytest.fixture(scope="module")
def trainer_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("live_trainer")
    output = run_deepspeed(SCRIPT, ["trainer", "--out", str(out)], env=JOB_ENV, timeout=400).stdout
    return finished(out, out / "trainer", output, output)


@pytest.fixture(scope="module")
def accelerate_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("live_accelerate")
    (out / "ds_config.json").write_text(json.dumps(accelerate_config(out)))
    with LauncherJob(SCRIPT, ["accelerate", "--out", str(out)], env=JOB_ENV,
                     launcher=accelerate_launch(out / "ds_config.json")) as job:
        status = job.finish(timeout=400)
    assert status == 0, job.output[-6000:]
    return finished(out, out / "accelerate", job.output, job.output)


@pytest.fixture(scope="module")
def lightning_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("live_lightning")
    run_ranks_as_nodes(SCRIPT, ["lightning", "--out", str(out)], out, timeout=400)
    logs = [(out / f"node_{rank}.log").read_text() for rank in RANKS]
    return finished(out, out / "lightning", logs[0], "".join(logs))


PREFIX = {"trainer": "train/", "accelerate": "", "lightning": ""}
"""How each framework names the events' tags: the Trainer's integrations put ``train/`` before them."""


@pytest.fixture(params=list(PREFIX))
def job(request):
    return request.getfixturevalue(f"{request.param}_job"), PREFIX[request.param]


def test_the_step_figures_reach_the_frameworks_logger_once_every_interval(job):
    run, prefix = job
    for figure in FIGURES:
        # once per interval, at the interval's last global step: a second sink would double the points
        assert [step for step, _ in run.scalars[f"{prefix}ds_profutils/{figure}"]] == INTERVAL_ENDS, figure
    points = {figure: [value for _, value in run.scalars[f"{prefix}ds_profutils/{figure}"]] for figure in FIGURES}
    assert all(value > 0 for figure in ("step_ms", "iteration_ms", "tflops", "tokens_per_s")
               for value in points[figure]), points
    assert points["mfu"] == pytest.approx([tflops / PEAK_TFLOPS for tflops in points["tflops"]], rel=1e-4)
    assert all(rank in (-1, 0, 1) for rank in points["straggler_rank"])
    # the step lies within its iteration (end of one optimizer step to the end of the next); not so in the
    # first interval, whose first step has no iteration: its median is the second step's alone
    assert all(step <= iteration * 1.01 for step, iteration in zip(points["step_ms"][1:], points["iteration_ms"][1:]))


def test_one_console_line_per_interval_on_rank_zero_only(job):
    run, _ = job
    steps = [int(step) for step in re.findall(r"ds_profutils step (\d+):", run.output)]
    assert steps == INTERVAL_ENDS and len(re.findall(r"ds_profutils step \d+:", run.rank0_output)) == len(steps)
    assert all(float(mfu) > 0 for mfu in re.findall(r"MFU ([\d.e+-]+)%", run.output))


def test_the_attachment_is_given_back_at_the_end(job):
    run, _ = job
    assert all(run.findings[rank]["given_back"] for rank in RANKS)


def test_the_trainers_own_logging_is_undisturbed(trainer_job):
    assert [step for step, _ in trainer_job.scalars["train/loss"]] == [2, 4, 6, 8]  # logging_steps 2
    keys = set(trainer_job.findings[0]["log_history_keys"])
    assert "loss" in keys and not any(key.startswith("ds_profutils/") for key in keys)


def test_accelerate_also_feeds_deepspeeds_monitor_and_attaching_again_adds_no_sink(accelerate_job):
    config = accelerate_config(accelerate_job.out)
    samples_per_step = config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * len(RANKS)
    with open(accelerate_job.out / "csv" / "live" / "ds_profutils_step_ms.csv") as file:
        rows = list(csv.reader(file))
    # DeepSpeed's monitors are on its own step axis: the samples trained when the interval's last step ended
    assert [int(step) for step, _ in rows[1:]] == [(end + 1) * samples_per_step for end in INTERVAL_ENDS]
    steps_ms = [value for _, value in accelerate_job.scalars["ds_profutils/step_ms"]]
    assert [float(value) for _, value in rows[1:]] == pytest.approx(steps_ms, rel=1e-4)
    assert all(accelerate_job.findings[rank]["attach_again_same"] for rank in RANKS)
