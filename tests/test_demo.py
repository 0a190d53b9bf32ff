"""The README's main job, end to end: examples/train.py with ds_configs/zero3_all_profiling.json.

Runs it as the README does (2 ranks under the deepspeed launcher, CPU), with the output directories
moved to a temp dir through the environment overrides a user would use for one run.
"""
import json
import subprocess

import pytest

from launcher import REPO, run_deepspeed
from report_testing import read_records_file

CONFIG = REPO / "ds_configs" / "zero3_all_profiling.json"


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    proc = run_deepspeed(REPO / "examples" / "train.py", ["--deepspeed_config", str(CONFIG)],
                         env={
                             "DS_PROFUTILS_PROFILER_OUTPUT_DIR": str(out),
                             "DS_PROFUTILS_PARTITIONED_PARAM_PROFILER_OUTPUT_DIR": str(out),
                             "DS_PROFUTILS_STEP_METRICS_OUTPUT_DIR": str(out),
                         })
    return out, proc.stdout


def test_trains_and_prints_every_step_on_rank_0_as_output_not_as_a_warning(demo_run):
    steps = [line for line in demo_run[1].splitlines() if "[Rank 0] step " in line]
    assert len(steps) == 8 and not any("[Rank 1] step " in line for line in demo_run[1].splitlines())
    # numbered as the records, the traces' ProfilerStep#N and the report number them: global steps from 0
    assert [line.split("[Rank 0] step ")[1].split(":")[0] for line in steps] == [str(n) for n in range(8)]
    assert not any("WARNING" in line for line in steps)


def test_prints_the_live_line_of_both_ranks_figures_every_monitor_interval_on_rank_0(demo_run):
    interval = json.loads(CONFIG.read_text())["step_metrics"]["monitor_interval"]
    lines = [line for line in demo_run[1].splitlines() if "ds_profutils step " in line]
    # after global steps 3 and 7 of the 8, once each (rank 1 printing too would make four)
    assert [int(line.split("ds_profutils step ")[1].split(":")[0]) for line in lines] == \
        list(range(interval - 1, 8, interval)) == [3, 7]
    assert all(" ms, iteration " in line and "FLOP/s" in line and "straggler" in line for line in lines), lines


@pytest.mark.parametrize("rank", [0, 1])
def test_writes_a_trace_per_rank_with_exactly_the_active_steps(demo_run, rank):
    settings = json.loads(CONFIG.read_text())["profiler"]
    trace = json.loads((demo_run[0] / f"trace_rank_{rank}.json").read_text())
    assert trace["distributedInfo"]["rank"] == rank and trace["distributedInfo"]["world_size"] == 2
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert len(steps) == settings["active"] * settings["repeat"]


@pytest.mark.parametrize("rank", [0, 1])
def test_writes_fetch_records_per_rank(demo_run, rank):
    records = read_records_file(demo_run[0] / f"zero_fetch_rank_{rank}.jsonl")
    assert records and all(r["rank"] == rank for r in records)
    # ZeRO-3 with persistence threshold 0: each train forward gathers the whole model (ToyModel: 1153).
    gathers = [r["events"]["forward_all_gather"]["numel"] for r in records if "forward_all_gather" in r["events"]]
    assert len(gathers) == len(records) == 8 and set(gathers) == {16 * 64 + 64 + 64 + 1}
    assert [r["global_step"] for r in records] == list(range(8))
    # The demo config turns DeepSpeed's comms logger on: attach warns, and every record says so.
    assert all(r["comms_logger"] for r in records)
    assert "DeepSpeed's comms logger is on: it synchronizes the device after every collective" in demo_run[1]


def test_one_way_to_profile_and_nothing_that_reads_like_a_fault(demo_run):
    """The example profiles through attach(engine) alone: no second profiler left idle, with its warning."""
    stdout = demo_run[1]
    assert "stays idle" not in stdout and "Traceback" not in stdout and "ERROR" not in stdout


def test_says_where_every_file_went_and_ends_with_the_fetch_report_and_the_command_to_print_it_again(demo_run):
    out, stdout = demo_run
    assert "zero_fetch_rank_<r>.jsonl" in stdout  # attach's line
    assert f"run trace         {out / 'trace_rank_0.json'}" in stdout  # the profiler's printout when its window ends
    assert "every profiled rank r (all ranks) writes trace_rank_{r}.json" in stdout
    assert "counted-operator FLOP/s" in stdout and "not model FLOPs utilisation" in stdout
    report = stdout.split("The fetch report:\n", 1)[1]
    assert "== engine main: ranks 0-1 of 2" in report and "forward_fetch_wait" in report
    # The job's last line (the launcher's own lines about its processes aside) names the command.
    last = [line for line in stdout.splitlines() if "[launch.py:" not in line][-1]
    assert last.startswith("The fetch report again, later: ")
    command = last.split(": ", 1)[1]
    # The command it names runs as printed (the ds-profutils next to the job's Python, or python -m).
    assert command.split()[-2:] == ["report", str(out)]
    again = subprocess.run(command.split(), capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "== engine main: ranks 0-1 of 2" in again.stdout
