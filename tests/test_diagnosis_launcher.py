"""The straggler's cause and the config advice on real jobs: tests/dist_scripts/diagnosis_job.py under the deepspeed
launcher (2 ranks, gloo), one launch for every case, each case a run directory the report and the diff read."""
import re

import pytest

from ds_profutils.diff.build import build_diff
from ds_profutils.report import build_report

from launcher import DIST_SCRIPTS, ended_as_documented, run_deepspeed
from report_testing import read_records_file

KEY = "zero_optimization.stage3_prefetch_bucket_size"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("diagnosis")
    proc = run_deepspeed(DIST_SCRIPTS / "diagnosis_job.py", ["--out", str(out)], timeout=900, check=False)
    assert ended_as_documented(proc.stdout, proc.returncode, r"diagnosis_job: done rank \d"), proc.stdout[-4000:]
    return out


def engine(runs, case):
    return build_report(runs / case)["engines"]["job"]


def test_more_work_is_told_from_a_slower_rank(runs):
    report = engine(runs, "more_work")
    summary = report["ranks_summary"]
    assert report["straggler_ranks"] == [1] and report["work_unit"] == "gflop"
    assert summary[1]["cause"] == "more_work" and summary[0]["cause"] is None
    assert summary[1]["tokens_median"] == 2 * summary[0]["tokens_median"]
    assert summary[1]["cause_figures"]["work_ratio"] == pytest.approx(2.0, rel=0.01)
    assert [found["topic"] for found in report["advice"] if found["key"] is None] == ["batching"]


@pytest.mark.parametrize("case", ["compute", "input_pipeline"])
def test_a_rank_slowed_in_forward_or_between_steps_gets_that_cause(runs, case):
    report = engine(runs, case)
    assert report["straggler_ranks"] == [1] and report["ranks_summary"][1]["cause"] == case
    assert report["ranks_summary"][1]["late_by_gap"] is (case == "input_pipeline")


def test_an_even_run_names_no_straggler_and_no_cause(runs):
    report = engine(runs, "even")
    assert report["straggler_ranks"] == []
    assert all(row["cause"] is None for row in report["ranks_summary"].values())
    assert not [found for found in report["advice"] if found["key"] is None]


def test_a_small_prefetch_bucket_gets_advice_to_raise_it_and_the_default_none(runs):
    small = [found for found in engine(runs, "z3_small_bucket")["advice"] if found["key"] == KEY]
    assert [(found["now"], found["direction"]) for found in small] == [(100, "raise")]
    assert not [found for found in engine(runs, "z3_default")["advice"] if found["key"] == KEY]


def test_the_diff_finds_that_raising_the_bucket_did_what_the_advice_said(runs):
    checked = build_diff(runs / "z3_small_bucket", runs / "z3_default")["engines"]["job"]["advice_checked"]
    assert [(found["key"], found["base"], found["new"], found["as_expected"]) for found in checked] == [
        (KEY, 100, 50_000_000, True)]
    assert re.fullmatch(r"events\.forward_all_gather\.count", checked[0]["figure"]) and checked[0]["change_pct"] < -50


def test_records_carry_the_effective_config_once_and_the_prefetches_waited_in_flight(runs):
    """The first record of each file has DeepSpeed's resolved values (defaults filled in), the others none; every
    ZeRO-3 train record says which waited elements a prefetch had launched: the waits' less the on-demand submits'."""
    for case, bucket in (("z3_small_bucket", 100), ("z3_default", 50_000_000)):
        for rank in (0, 1):
            records = read_records_file(runs / case / f"zero_fetch_job_rank_{rank}.jsonl")
            assert records[0]["ds_config"][KEY] == bucket and records[0]["ds_config"]["zero_optimization.stage"] == 3
            assert records[0]["ds_config"]["zero_optimization.overlap_comm"] is True  # DeepSpeed's stage-3 default
            assert not any("ds_config" in record for record in records[1:])
            for record in records:
                events = record["events"]
                numel = [sum(events[f"{d}_{kind}"]["numel"] for d in ("forward", "backward") if f"{d}_{kind}" in events)
                         for kind in ("fetch_wait", "fetch_submit")]
                assert record["prefetch"]["in_flight_waited"] == numel[0] - numel[1]
            assert sum(record["prefetch"]["in_flight_waited"] for record in records) > 0
