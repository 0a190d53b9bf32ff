"""A profiler must never hurt the job, under the deepspeed launcher (2 ranks, gloo, ZeRO-2, step_metrics): one
job (tests/dist_scripts/isolation_job.py) injects a failure on one rank per phase and runs with
``DS_PROFUTILS_FOO=1`` in its environment.  Asserted is what load cannot move: no step of either rank near the
60 s process-group timeout a stall would take, none after warm-up slower than five times the median where a phase
has the steps for a median, every rank at the script's end, which rank's figures are missing, how many exchanges
each rank made."""
import json
import subprocess
from statistics import median

import pytest

from launcher import DIST_SCRIPTS, ended_as_documented, run_deepspeed

MARKER = "isolation job: rank {} reached the end"
STALL_MS = 15_000
"""No step, warm-up and failures included, takes this long; one rank waiting for another in a gather takes the
job's 60 s process-group timeout (a first step's FLOP count or a loaded machine's slowest step: seconds)."""


def read_only_mount(directory):
    """The ``unshare`` prefix that runs the job with ``directory`` a read-only tmpfs, or why it cannot."""
    try:
        subprocess.run(["unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o ro,size=1m tmpfs "$0"', str(directory)],
                       check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"cannot mount a read-only tmpfs in a mount namespace here ({exc})"
    return ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o ro,size=1m tmpfs "$0" && exec "$@"',
            str(directory)], None


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("isolation")
    read_only = out / "read_only"
    read_only.mkdir()
    prefix, why_not = read_only_mount(read_only)
    args = ["--out", str(out)] + (["--read-only", str(read_only)] if prefix else [])
    proc = run_deepspeed(DIST_SCRIPTS / "isolation_job.py", args, env={"DS_PROFUTILS_FOO": "1"}, check=False,
                         prefix=prefix or (), timeout=600)
    # every rank reached the end, exit 0 or gloo's teardown abort after it; and no traceback anywhere (issue 37)
    assert ended_as_documented(proc.stdout, proc.returncode, r"isolation job: rank \d reached the end"), proc.stdout[-4000:]
    assert "Traceback" not in proc.stdout, proc.stdout[-4000:]
    found = {rank: json.loads((out / f"found_rank_{rank}.json").read_text()) for rank in (0, 1)}
    return out, proc.stdout, found, why_not


def test_the_job_ends_on_every_rank_and_no_step_stalls(job):
    _, output, found, _ = job
    assert MARKER.format(0) in output and MARKER.format(1) in output
    for rank in (0, 1):
        for phase, times in found[rank]["times"].items():
            # every step, the failing ones first among them: far below the 60 s a stall in a gather would take
            assert max(times) < STALL_MS, (rank, phase, times)
            after_warm_up = times[2:]
            if len(after_warm_up) >= 6:  # enough steps for a median that one slow step cannot carry
                assert max(after_warm_up) <= 5 * median(after_warm_up), (rank, phase, times)


def test_a_records_path_that_is_a_directory_is_one_line_on_that_rank_and_live_goes_on(job):
    out, output, found, _ = job
    assert found[1]["path"]["failed"] and not found[0]["path"]["failed"]
    assert output.count(f"output_dir {out / 'path'} cannot be written (Is a directory): step records are off on "
                        "rank 1, training goes on") == 1
    writes = found[0]["path"]["writes"]
    assert [write["step"] for write in writes] == list(range(1, 24, 2))  # every interval, the raising sink beside
    assert all("ds_profutils/tokens_per_s" in write for write in writes)  # rank 1 still measures for live
    assert output.count("live metrics could not be written to Raising: OSError: the sink's server is gone") == 1
    assert found[0]["path"]["group_is_default"]  # DeepSpeed's clone of the world: our exchange on the default group
    assert (out / "path" / "zero_fetch_rank_0.jsonl").stat().st_size > 0


def test_a_failed_memory_read_leaves_that_ranks_rows_empty_and_the_exchange_in_step(job):
    _, output, found, _ = job
    assert found[1]["memory"]["recorder_closed"] and not found[0]["memory"]["recorder_closed"]
    assert "cannot read /proc/self/statm" in output
    writes = found[0]["memory"]["writes"]
    assert [write["step"] for write in writes] == [1, 3, 5, 7, 9, 11]
    # rank 1's figures are there in the first interval only: no sum over ranks without it
    assert ["ds_profutils/tokens_per_s" in write for write in writes] == [True] + [False] * 5
    assert all(write["ds_profutils/step_ms"] > 0 for write in writes)  # rank 0's figures go on
    assert found[1]["memory"]["writes"] == []  # only the group's rank 0 writes the events


def test_a_rank_whose_live_figures_fail_stops_every_ranks_exchange_at_the_same_interval(job):
    _, output, found, _ = job
    for rank in (0, 1):
        assert found[rank]["stop"]["stopped"] and found[rank]["stop"]["exchanges"] == 4, found[rank]["stop"]
        # deferred: the flag of exchange 3 takes effect at the boundary of 3 + 2, on every rank alike
        assert found[rank]["deferred"] == {"stopped": True, "exchanges": 5}
    assert [write["step"] for write in found[0]["stop"]["writes"]] == [0, 1, 2, 3]
    # failing to read the gathered rows (not to pack its own) on rank 1: the same interval, every rank
    assert [found[rank]["stop_reading"] for rank in (0, 1)] == [{"stopped": True, "exchanges": 4}] * 2


def test_with_nothing_reading_the_live_figures_the_exchange_stops_after_the_first_interval(job):
    """No console line, no monitor, no sink on any rank: two intervals, one exchange (whose flags said so); with a
    sink on rank 0 alone (the path phase) every interval was exchanged; a sink on rank 1 alone reads nothing."""
    _, output, found, _ = job
    assert [found[rank]["under_file"]["exchanges"] for rank in (0, 1)] == [1, 1]
    for case in ("none", "late_on_rank_0", "rank_1_only"):  # deferred: decided at exchange 0, in effect at 2
        expected = {"stopped": True, "exchanges": 2}
        assert [found[rank][f"deferred_unread_{case}"] for rank in (0, 1)] == [expected] * 2, case
    assert output.count("Kept get no live events once the live exchange stops") == 1  # rank 0's late sink only


def test_the_exchange_runs_on_the_engines_group_not_the_whole_world(job):
    _, _, found, _ = job
    group = found[1]["group"]
    assert group["ranks"] == [1] and [write["step"] for write in group["writes"]] == [0, 1, 2]


def assert_one_line_per_rank(output, found, phase, line):
    """Recording is off on both ranks, and each said so in ``line`` (formatted with its rank) once."""
    assert found[0][phase]["failed"] and found[1][phase]["failed"]
    for rank in (0, 1):
        assert output.count(line.format(rank=rank)) == 1, line.format(rank=rank)


def test_an_output_dir_under_a_file_is_one_line_per_rank_and_training_goes_on(job):
    out, output, found, _ = job
    assert_one_line_per_rank(output, found, "under_file", f"output_dir {out / 'plain' / 'records'} cannot be created "
                             "(Not a directory): step records are off on rank {rank}, training goes on; no step "
                             "records of rank {rank} are on disk")


def test_a_read_only_output_dir_is_one_line_per_rank_and_training_goes_on(job):
    out, output, found, why_not = job
    if why_not:
        pytest.skip(why_not)
    assert_one_line_per_rank(output, found, "read_only", f"output_dir {out / 'read_only'} cannot be written "
                             "(Read-only file system): step records are off on rank {rank}, training goes on")


def test_a_variable_naming_no_setting_is_named_and_the_job_trains(job):
    _, output, found, _ = job
    assert output.count("environment variable DS_PROFUTILS_FOO names no setting") == 1  # rank 0, once
    assert len(found[0]["times"]["path"]) == 24
