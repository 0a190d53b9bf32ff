"""Done-when of the hang watchdog under the deepspeed launcher (2 ranks, gloo, ZeRO-2, hang_timeout_s 5): rank 1
sleeping before the forward of global step 6 leaves hang files within 40 s; after SIGTERM to the job, the report
names rank 1 (with a frame of the job's script) and rank 0 waiting inside a collective, HANG first; the records
of steps 0-5 are kept.  The same job without the sleep writes no hang file.  Both jobs run side by side."""
import json
import signal
import subprocess
import sys
import time

from launcher import DIST_SCRIPTS, REPO, LauncherJob, ended_as_documented

from report_testing import read_records_file

SCRIPT = DIST_SCRIPTS / "hang_job.py"
def report(directory, *options):
    done = subprocess.run([sys.executable, "-m", "ds_profutils", "report", str(directory), *options],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_hung_job_names_the_rank_that_never_arrived_and_a_healthy_one_writes_no_hang_file(tmp_path):
    hung_dir, healthy_dir = tmp_path / "hung", tmp_path / "healthy"
    with LauncherJob(SCRIPT, ["--out", str(hung_dir), "--sleep-s", "600"]) as hung, \
            LauncherJob(SCRIPT, ["--out", str(healthy_dir), "--steps", "20"]) as healthy:
        hung.wait_for("hang_job sleeping", timeout=300)
        slept_at = time.monotonic()
        files = [hung_dir / "hang_rank_0.json", hung_dir / "hang_rank_1.json"]
        while not all(path.exists() for path in files) and time.monotonic() - slept_at < 40:
            time.sleep(0.5)
        found_after_s = time.monotonic() - slept_at
        assert all(path.exists() for path in files), hung.output[-3000:]
        hung.signal_group(signal.SIGTERM)
        hung.finish(timeout=120)
        healthy_code = healthy.finish(timeout=400)
        assert ended_as_documented(healthy.output, healthy_code, r"hang_job done rank \d"), healthy.output[-3000:]
    assert found_after_s < 40
    hang = json.loads(report(hung_dir, "--json"))["engines"]["main"]["hang"]
    assert hang["culprits"] == [1] and hang["waiting"] == [0] and hang["global_step"] == 6
    culprit, waiting = hang["ranks"]["1"], hang["ranks"]["0"]
    assert culprit["state"] == "outside_collectives" and culprit["phase"] == "between steps"
    assert any("hang_job.py" in frame for frame in culprit["stack"][:3]), culprit["stack"]
    assert waiting["state"] == "in_collective" and waiting["collective"] and waiting["waiting_s"] >= 5
    assert waiting["seq"] > 0 and waiting["group"] == [0, 1]
    text = report(hung_dir).splitlines()
    assert text[1].startswith("HANG: engine main at global step 6, between steps: no optimizer step for "), text[:6]
    assert text[2] == "  never arrived: rank 1"
    for rank in (0, 1):
        records = read_records_file(hung_dir / f"zero_fetch_rank_{rank}.jsonl")
        assert [record["global_step"] for record in records][:6] == list(range(6))
        assert all(record["collective_seq"]["0-1"][0] > 0 for record in records[:6])
    assert not list(healthy_dir.glob("hang_rank_*")) and not list(healthy_dir.glob(".hang_rank_*"))
    healthy_records = read_records_file(healthy_dir / "zero_fetch_rank_1.jsonl")
    assert len(healthy_records) == 20
    # deepspeed.comm's own torch.distributed calls and the live exchange (at step 10, then no more: nothing reads it)
    # are no framework waits
    assert all(record["gap_collective_ms"] == 0 for record in healthy_records[1:])
    assert not any(op.startswith("torch.distributed.") for record in healthy_records for op in record["collectives"])
