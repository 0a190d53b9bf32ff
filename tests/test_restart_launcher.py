"""A preempted Trainer job restarted in a new process from an earlier checkpoint, under the launcher.

The first process records global steps 0-7 and saves a checkpoint at step 4; the restart (a new
process, as a scheduler starts it) trains steps 4-7 again.  The records file keeps the first run's
steps, the report shows steps 0-7 once each, every step's figures taken from one run only: the
restart's for 4-7, the first run's for 0-3.
"""
import json

import pytest

from ds_profutils.report import build_report
from launcher import DIST_SCRIPTS, REPO, run_deepspeed
from report_testing import read_records_file

RANKS = (0, 1)


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    out = tmp_path_factory.mktemp("restart")
    config = json.loads((REPO / "ds_configs" / "hf_trainer_zero3.json").read_text())
    del config["scheduler"], config["profiler"]  # a resumed scheduler would start at its end; traces aside
    config["partitioned_param_profiler"]["output_dir"] = str(out / "records")
    (out / "ds_config.json").write_text(json.dumps(config))
    for phase in ("first", "restart"):
        run_deepspeed(DIST_SCRIPTS / "hf_trainer_restart.py",
                      ["--deepspeed", str(out / "ds_config.json"), "--out", str(out), "--phase", phase],
                      env={"HF_HUB_OFFLINE": "1"})
        for rank in RANKS:
            assert json.loads((out / f"{phase}_rank_{rank}.json").read_text())["global_steps"] == 8
    return out


def train_records(out, rank):
    return [record for record in read_records_file(out / "records" / f"zero_fetch_rank_{rank}.jsonl")
            if record["mode"] == "train"]


@pytest.mark.parametrize("rank", RANKS)
def test_the_restart_keeps_the_first_runs_records_and_marks_its_own_as_a_new_segment(restarted, rank):
    records = train_records(restarted, rank)
    steps = [record["global_step"] for record in records]
    # two micro steps per optimizer step: 0-7 of the first process, then 4-7 of the restart
    assert steps == [n // 2 for n in range(16)] + [4 + n // 2 for n in range(8)]
    first, second = records[:16], records[16:]
    assert len({record["pid"] for record in first}) == 1 and len({record["pid"] for record in second}) == 1
    assert first[0]["pid"] != second[0]["pid"]
    assert {record["segment"] for record in second} == {max(record["segment"] for record in first) + 1}


def test_the_report_shows_each_step_once_from_the_latest_run(restarted):
    engine = build_report(restarted / "records")["engines"]["main"]
    view = engine["steps"]
    assert view.global_steps == list(range(8))
    assert engine["superseded_records"] == len(RANKS) * 8  # steps 4-7 of the first run, 2 micro steps each
    for rank_index, rank in enumerate(view.ranks):
        records = train_records(restarted, rank)
        latest = {}
        for record in records:  # each step from the last run that recorded it: the restart's for 4-7
            latest.setdefault(record["global_step"], {})[record["pid"]] = latest.get(record["global_step"], {}).get(
                record["pid"], 0.0) + record["step_time_ms"]
        for position, step in enumerate(view.global_steps):
            by_run = latest[step]
            expected = by_run[records[-1]["pid"]] if step >= 4 else next(iter(by_run.values()))
            assert view.step_ms.get(rank_index, position) == pytest.approx(expected), (rank, step)
            if step >= 4:  # the sum of both runs would be larger than either alone
                assert view.step_ms.get(rank_index, position) < sum(by_run.values())
