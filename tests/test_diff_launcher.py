"""``ds-profutils diff`` on real 2-rank ZeRO-3 runs under the ``deepspeed`` launcher (gloo, CPU).

One launcher start (tests/dist_scripts/diff_runs.py) writes four runs of the same job, trained
interleaved: ``base``, ``same`` (unchanged), ``slowed`` (rank 1 sleeps 40 ms more in every forward) and
``bucket`` (``stage3_prefetch_bucket_size`` 10**6 instead of 600).  Each diff must tell them apart.
"""
import json

import pytest

from ds_profutils.cli import main
from ds_profutils.diff.build import build_diff
from ds_profutils.diff.text import render_diff

from launcher import DIST_SCRIPTS, run_deepspeed


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("diff_runs")
    run_deepspeed(DIST_SCRIPTS / "diff_runs.py", ["--out", str(out)])
    assert json.loads((out / "done_rank_1.json").read_text())["steps"] == 40
    return out


def test_a_rank_slowed_in_forward_is_a_slower_step_beyond_noise_from_the_others_waits(runs):
    diff = build_diff(runs / "base", runs / "slowed")
    engine = diff["engines"]["main"]
    assert engine["engine"] == {"base": "main", "new": "slowed"}
    step = engine["step_ms"]
    assert step["significant"] and 20.0 < step["change"] < 70.0  # a verdict at the documented level, not an extreme p
    # Rank 1 spent the 40 ms computing (busy); rank 0 spent them waiting for it.
    waiting, slowed = engine["ranks"][0]["change"], engine["ranks"][1]["change"]
    assert waiting["fetch_wait_ms"] + waiting["collective_wait_ms"] > waiting["busy_ms"] + 10.0
    assert slowed["busy_ms"] > slowed["fetch_wait_ms"] + slowed["collective_wait_ms"] + 10.0
    # Whether a part alone clears the level on drifting steps depends on the machine's load (a busy 2-core machine
    # leaves 10-15 effective steps of 36); where one does, it is put on the right rank.
    where = engine["where"]
    assert all(moved["rank"] == 1 for moved in where.get("busy_ms", [])[:1])
    assert all(where[part][0]["rank"] == 0 for part in ("fetch_wait_ms", "collective_wait_ms") if where.get(part))
    assert engine["straggler"]["base"] == [] and engine["straggler"]["new"] == [1]
    text = " ".join(render_diff(diff).split())
    assert "SLOWER, beyond noise" in text and "Straggler (the report's verdict): BASE none; NEW rank 1" in text


def test_two_runs_of_the_unchanged_job_show_no_significant_change(runs, capsys):
    assert main(["diff", str(runs / "base"), str(runs / "same"), "--json"]) == 0
    engine = json.loads(capsys.readouterr().out)["engines"]["main"]
    assert engine["step_ms"]["significant"] is False and 0.9 < engine["step_ms"]["ratio"] < 1.1
    assert engine["straggler"]["base"] == [] and engine["straggler"]["new"] == []


def test_a_bigger_prefetch_bucket_shows_as_more_numel_per_gather(runs):
    events = build_diff(runs / "base", runs / "bucket")["engines"]["main"]["events"]
    first = list(events)[:2]
    assert set(first) == {"forward_prefetch_submit", "forward_all_gather"}
    for name in first:
        base, new = events[name]["base"], events[name]["new"]
        assert new["numel_per_event"] > 1.5 * base["numel_per_event"] and new["count"] < 0.75 * base["count"]
        assert new["numel"] == pytest.approx(base["numel"], rel=0.05)  # the same parameters, in fewer gathers
