"""The straggler is the rank the others wait for: named from the records' exposed waits, never the rank
that only waited, and only where the spread clears the stated thresholds."""
import json

import pytest

from ds_profutils.cli import main
from ds_profutils.report import build_report, render_text

from report_testing import record, slowed_run, write_records


def flagged(report, engine="main"):
    return [rank for rank, row in report["engines"][engine]["ranks_summary"].items() if row["straggler"]]


def test_the_slowed_rank_is_named_and_the_rank_that_waited_for_it_is_not(tmp_path):
    """Rank 1 spends 30 ms more per step outside the collectives: equal step times, rank 0 waits 30 ms."""
    slowed_run(tmp_path, ranks=2, steps=10, slowed=1)
    report = build_report(tmp_path)
    engine = report["engines"]["main"]
    assert flagged(report) == [1] and engine["straggler_ranks"] == [1]
    assert engine["steps"].straggler == [1] * 10
    slowed, waiter = engine["ranks_summary"][1], engine["ranks_summary"][0]
    assert slowed["straggler_steps"] == 10 and waiter["straggler_steps"] == 0
    assert slowed["attributed_wait_ms"] == pytest.approx(10 * 30.0, abs=10 * 1.0)
    assert waiter["waited_for_stragglers_ms"] == pytest.approx(slowed["attributed_wait_ms"])
    # The rank that waited has the longest waits; it is still not the one named.
    assert waiter["exposed_wait_ms_median"] > slowed["exposed_wait_ms_median"]
    text = render_text(report)
    assert "STRAGGLER: rank 1 (node-0) held the others back in 10 of 10 steps" in text
    assert "STRAGGLER: rank 0" not in text


def test_among_many_ranks_only_the_slowed_one_is_named(tmp_path):
    slowed_run(tmp_path, ranks=6, steps=8, slowed=4)
    report = build_report(tmp_path)
    assert flagged(report) == [4]
    assert report["engines"]["main"]["ranks_summary"][4]["attributed_wait_ms"] == pytest.approx(8 * 5 * 30, rel=0.05)


def test_a_slow_host_is_named_when_its_ranks_take_turns_as_step_straggler(tmp_path):
    """A whole node slowed (8 ranks of 16, 30 ms per step): each step's least wait falls on any of its
    ranks, so no rank reaches half the steps, but every step's straggler is on that host."""
    for rank in range(16):
        slow = rank >= 8
        rows = [record(rank, step, busy_ms=20.0 + (30.0 if slow else 0.0), world_size=16,
                       host="node-b" if slow else "node-a",
                       collective_ms=1.0 + (rank * 5 + step * 3) % 8 * 0.25 + (0.0 if slow else 30.0))
                for step in range(60)]
        write_records(tmp_path, rank, rows)
    report = build_report(tmp_path)
    engine = report["engines"]["main"]
    assert engine["straggler_ranks"] == [] and all(8 <= rank for rank in engine["steps"].straggler)
    assert engine["straggler_hosts"] == ["node-b"]
    assert engine["hosts_summary"] == {"node-a": {"ranks": list(range(8)), "straggler_steps": 0, "straggler": False},
                                       "node-b": {"ranks": list(range(8, 16)), "straggler_steps": 60,
                                                  "straggler": True}}
    text = render_text(report)
    assert "No straggler rank: no rank held the others back in at least half of the 60 steps" in text
    assert "STRAGGLER HOST: node-b (ranks 8-15) held the others back in 60 of 60 steps" in text


def test_noise_above_the_step_threshold_names_no_host(tmp_path):
    """Two hosts of four ranks, waits jittering 0-6 ms (above the 2 ms floor): each step has a straggler,
    on either host by chance, about half the steps each; that is not a slow host."""
    import random

    jitter = random.Random(7)
    for rank in range(8):
        write_records(tmp_path, rank, [record(rank, step, world_size=8, host=f"node-{rank // 4}",
                                              collective_ms=1.0 + jitter.uniform(0.0, 6.0)) for step in range(40)])
    engine = build_report(tmp_path)["engines"]["main"]
    counts = [row["straggler_steps"] for row in engine["hosts_summary"].values()]
    assert sum(counts) >= 30 and max(counts) >= 20  # half the steps or more, by chance
    assert engine["straggler_hosts"] == [] and engine["straggler_ranks"] == []


def test_one_slow_rank_flags_its_host_in_json_and_a_calm_run_no_host(tmp_path):
    slowed_run(tmp_path, ranks=6, steps=8, slowed=4)  # node-0: ranks 0-1, node-1: 2-3, node-2: 4-5
    report = build_report(tmp_path)
    engine = report["engines"]["main"]
    assert engine["straggler_ranks"] == [4] and engine["straggler_hosts"] == ["node-2"]  # its host, rightly
    assert "STRAGGLER HOST:" not in render_text(report)  # the text names the rank; its host adds nothing
    slowed_run(tmp_path, ranks=6, steps=8, slowed=None)
    assert build_report(tmp_path)["engines"]["main"]["straggler_hosts"] == []


def test_a_run_with_no_slowed_rank_names_none(tmp_path):
    slowed_run(tmp_path, ranks=4, steps=10, slowed=None)
    report = build_report(tmp_path)
    assert flagged(report) == [] and report["engines"]["main"]["steps"].straggler == [None] * 10
    assert "No straggler: no rank held the others back in at least half of the 10 steps." in render_text(report)


@pytest.mark.parametrize("step_ms, spread_ms, named", [
    (10.0, 1.9, False),  # under the 2 ms floor
    (10.0, 2.1, True),
    (50.0, 4.9, False),  # under 10 % of the 50 ms median step
    (50.0, 5.1, True),
])
def test_a_step_needs_a_spread_of_max_2_ms_and_10_percent_of_the_median_step(tmp_path, step_ms, spread_ms, named):
    for rank, wait in ((0, 1.0 + spread_ms), (1, 1.0)):
        write_records(tmp_path, rank, [record(rank, 0, busy_ms=step_ms - wait, fetch_ms=0.0, collective_ms=wait)])
    view = build_report(tmp_path)["engines"]["main"]["steps"]
    assert view.spread_ms == [pytest.approx(spread_ms)]
    assert view.threshold_ms == [max(2.0, step_ms / 10)]
    assert view.straggler == ([1] if named else [None])


@pytest.mark.parametrize("straggler_steps, flagged_overall", [(4, False), (5, True)])
def test_flagged_overall_when_the_straggler_in_at_least_half_the_steps(tmp_path, straggler_steps, flagged_overall):
    for rank in (0, 1):
        write_records(tmp_path, rank, [
            record(rank, step, collective_ms=2.0 + (30.0 if rank == 0 and step < straggler_steps else 0.0))
            for step in range(10)])
    report = build_report(tmp_path)
    summary = report["engines"]["main"]["ranks_summary"][1]
    assert summary["straggler_steps"] == straggler_steps and summary["straggler"] is flagged_overall
    text = render_text(report)
    if not flagged_overall:
        assert "No straggler: no rank held the others back in at least half of the 10 steps " \
               "(step stragglers: rank 1 in 4)." in " ".join(text.split())


def test_a_straggler_per_engine(tmp_path):
    slowed_run(tmp_path, ranks=2, steps=4, slowed=1, engine="main")
    slowed_run(tmp_path, ranks=2, steps=4, slowed=0, engine="critic")
    report = build_report(tmp_path)
    assert flagged(report, "main") == [1] and flagged(report, "critic") == [0]


def test_the_output_states_the_rule_with_its_thresholds(tmp_path, capsys):
    slowed_run(tmp_path, ranks=2, steps=3, slowed=1)
    assert main(["report", str(tmp_path)]) == 0
    assert ("Straggler rule: a step's straggler is the rank with the least exposed wait where the spread of exposed "
            "wait across ranks (max - min) is >= max(2 ms, 10% of the step's median step time); a rank is flagged "
            "STRAGGLER when it is the step straggler in >= 50% of the recorded train steps; with ranks on several "
            "hosts, a host is flagged STRAGGLER HOST when its ranks are in >= 1.5x its share of the ranks (at least "
            "50%, at most 90%) of them.") in " ".join(capsys.readouterr().out.split())  # as one line: prose is wrapped
    assert main(["report", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["engines"]["main"]["ranks_summary"]["1"]["straggler"] is True
    assert data["engines"]["main"]["ranks_summary"]["0"]["straggler"] is False
    rule = data["straggler_rule"]
    assert (rule["min_spread_ms"], rule["min_spread_share_of_median_step"], rule["overall_share_of_steps"],
            rule["host_over_fair_share"], rule["host_max_share"]) == (2.0, 0.1, 0.5, 1.5, 0.9)
