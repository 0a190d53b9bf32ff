"""Trace captures on real jobs (tests/dist_scripts/capture_job.py under the deepspeed launcher, gloo, ZeRO-2,
trace_capture with gzip, step_metrics off): one 2-rank job asked for a capture by ``ds-profutils capture --wait``
while it trains, and two 4-rank jobs with ``on_anomaly`` (rank 2 slowed from step 40, and an even one) launched
at once.  One launch per variant (module-scoped fixtures)."""
import json
import subprocess
import sys

import pytest

from ds_profutils.report.traces import summarize_trace

from launcher import DIST_SCRIPTS, REPO, LauncherJob, _environment, ended_as_documented

SCRIPT = DIST_SCRIPTS / "capture_job.py"
LAST_LINE = r"capture_job: done rank \d"
INTERVAL = 5
ENV = {"OMP_NUM_THREADS": "1"}


def finished(job: LauncherJob, ranks: int, timeout: float) -> str:
    code = job.finish(timeout)
    assert ended_as_documented(job.output, code, LAST_LINE, ranks), job.output[-4000:]
    return job.output


@pytest.fixture(scope="module")
def requested(tmp_path_factory):
    out = tmp_path_factory.mktemp("capture_request")
    with LauncherJob(SCRIPT, ["--out", str(out), "--interval", str(INTERVAL)], env=ENV) as job:
        job.wait_for(r"capture_job: step 1\d", timeout=240)
        asked = subprocess.run([sys.executable, "-m", "ds_profutils", "capture", str(out), "--steps", "2", "--ranks",
                                "all", "--wait", "90"], cwd=REPO, env=_environment(None), capture_output=True,
                               text=True, timeout=150)
        output = finished(job, 2, 240)
    return out, asked, output


@pytest.fixture(scope="module")
def anomalies(tmp_path_factory):
    """The slowed and the even 4-rank job, run at once; step_jump high enough that the loaded machine's own
    swings cannot fire it (the straggler rule is what this checks; the step-jump rule: test_capture.py)."""
    outs = {case: tmp_path_factory.mktemp(f"capture_{case}") for case in ("slow", "even")}
    args = {case: ["--out", str(out), "--interval", str(INTERVAL), "--steps", "100", "--on-anomaly", "--step-jump",
                   "4", "--announce", "1000"] for case, out in outs.items()}
    args["slow"] += ["--slow-rank", "2", "--slow-from", "40", "--slow-ms", "60"]
    with LauncherJob(SCRIPT, args["slow"], num_gpus=4, env=ENV) as slow, \
            LauncherJob(SCRIPT, args["even"], num_gpus=4, env=ENV) as even:
        outputs = {"slow": finished(slow, 4, 420), "even": finished(even, 4, 420)}
    return outs, outputs


def test_a_request_while_the_job_trains_is_one_gzip_capture_of_exactly_the_steps_asked(requested):
    out, asked, output = requested
    assert asked.returncode == 0, asked.stdout + asked.stderr
    folders = sorted(path for path in out.iterdir() if path.is_dir())
    assert [path.name for path in folders] == [f"capture_{json.loads((folders[0] / 'manifest.json').read_text())['first_step']}"]
    manifest = json.loads((folders[0] / "manifest.json").read_text())
    first = manifest["first_step"]
    assert (manifest["reason"], manifest["ranks"], manifest["steps"], manifest["done"]) == ("request", [0, 1], 2, True)
    began = json.loads((out / "steps.json").read_text())
    asked_at = max(step for step, at in began if at <= manifest["requested_at"])
    assert asked_at >= 10 and asked_at < first <= asked_at + 3 * INTERVAL
    for rank in (0, 1):
        trace = folders[0] / f"trace_rank_{rank}.json.gz"
        summary = summarize_trace(trace)
        assert [entry["step"] for entry in summary["steps"]] == [first, first + 1] and summary["incomplete"] is None
        assert summary["rank"] == rank and summary["world_size"] == 2
    assert f"written to {folders[0]}" in asked.stdout and f"ds-profutils timeline {folders[0]}" in asked.stdout
    assert max(step for step, _ in began) == 149  # the job trained on to its end
    assert not [path for path in out.rglob("*trace*") if path.parent != folders[0]]
    assert not list(out.glob("zero_fetch_*"))  # step_metrics off: the recorder ran for the exchange, no files
    report = subprocess.run([sys.executable, "-m", "ds_profutils", "report", str(out)], cwd=REPO,
                            env=_environment(None), capture_output=True, text=True, timeout=60)
    assert report.returncode == 0 and f"{folders[0].name}: request, steps {first}-{first + 1}" in report.stdout
    timeline = subprocess.run([sys.executable, "-m", "ds_profutils", "timeline", str(folders[0]), "-o",
                               str(out / "merged.json")], cwd=REPO, env=_environment(None), capture_output=True,
                              text=True, timeout=60)
    assert timeline.returncode == 0 and "of 2 ranks" in timeline.stdout, timeline.stderr


def test_a_slow_rank_fires_one_capture_of_at_most_three_ranks_including_it_and_an_even_run_none(anomalies):
    outs, outputs = anomalies
    folders = [path for path in outs["slow"].iterdir() if path.name.startswith("capture_")]
    assert len(folders) == 1, outputs["slow"][-3000:]  # cooldown_steps (100) outlasts the job's 100 steps
    manifest = json.loads((folders[0] / "manifest.json").read_text())
    first = manifest["first_step"]
    assert manifest["reason"] == "straggler" and manifest["figures"]["straggler_rank"] == 2 and 41 <= first <= 80
    assert 2 in manifest["ranks"] and len(manifest["ranks"]) <= 3 and manifest["done"]
    assert sorted(path.name for path in folders[0].glob("trace_rank_*")) == [
        f"trace_rank_{rank}.json.gz" for rank in manifest["ranks"]]
    for rank in manifest["ranks"]:  # each chosen rank traced the same two steps, whole
        summary = summarize_trace(folders[0] / f"trace_rank_{rank}.json.gz")
        assert [entry["step"] for entry in summary["steps"]] == [first, first + 1] and summary["incomplete"] is None
    assert not [path for path in outs["even"].iterdir() if path.name.startswith("capture_")], outputs["even"][-3000:]
