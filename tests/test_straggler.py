"""The straggler is the rank the others wait for: the one with the least time inside the step's collectives
(exposed wait for schema 2 records), never the rank that only waited, only where the spread clears the
stated thresholds, and overall only when it is the step straggler more often than chance allows."""
import json

import pytest

from ds_profutils.cli import main
from ds_profutils.report import build_report, render_text

from report_testing import record, schema3, slowed_run, write_records


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
    text = " ".join(render_text(report).split())
    assert ("STRAGGLER: rank 1 (node-0) held the others back in 10 of 10 steps (p = 0.00098 by chance, named at <= "
            "0.0125); their waiting beyond its own in those steps: 300.0 ms") in text
    assert "STRAGGLER: rank 0" not in text
    assert "schema 2 or older): the step straggler is the rank with the least exposed wait" in text


def test_a_rank_slowed_while_the_collectives_overlap_is_named_from_the_time_inside_them(tmp_path):
    """ZeRO-3's gradient reduce-scatter on a side stream (overlap_comm): rank 1 slowed in backward makes the
    others sit 30 ms inside the collective without a blocking call stalling, so step times are equal and
    exposed waits too; only the time inside the collectives (schema 3) says who arrived last."""
    slowed_run(tmp_path, ranks=4, steps=10, slowed=1, overlapped=True)
    report = build_report(tmp_path)
    engine = report["engines"]["main"]
    view = engine["steps"]
    assert {view.step_ms.get(rank, 0) for rank in range(4)} == {53.0}  # equal steps: they cannot name it
    assert {view.exposed_wait_ms.get(rank, 0) for rank in range(4)} == {3.0}  # nor can the exposed waits
    assert engine["straggler_figure"] == "collective_ms" and engine["straggler_ranks"] == [1]
    assert view.straggler == [1] * 10
    assert engine["ranks_summary"][1]["attributed_wait_ms"] == pytest.approx(10 * 3 * 30.0, abs=10 * 3 * 1.0)
    text = render_text(report)
    assert "STRAGGLER: rank 1 (node-0) held the others back in 10 of 10 steps" in text
    assert "carry no time inside collectives" not in text and "in collectives" in text
    # The same records without the time inside collectives (what schema 2 had): no rank is named.
    for rank in range(4):
        path = tmp_path / f"zero_fetch_rank_{rank}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({**row, "schema": 2, "collective_ms": None}) + "\n" for row in rows))
    engine = build_report(tmp_path)["engines"]["main"]
    assert engine["straggler_figure"] == "exposed_wait_ms" and engine["straggler_ranks"] == []


def test_one_rank_without_the_time_inside_collectives_makes_the_engine_fall_back_to_exposed_wait(tmp_path):
    """Figures of two kinds are not compared across ranks: rank 1's schema 2 records make the whole engine
    use exposed wait, and the report says so."""
    write_records(tmp_path, 0, [schema3(record(0, step, collective_ms=2.0), inside_ms=40.0) for step in range(10)])
    write_records(tmp_path, 1, [record(1, step, collective_ms=30.0) for step in range(10)])
    report = build_report(tmp_path)
    engine = report["engines"]["main"]
    assert engine["straggler_figure"] == "exposed_wait_ms" and engine["straggler_ranks"] == [0]
    assert "records carry no time inside collectives (schema 2 or older)" in " ".join(render_text(report).split())


def test_among_many_ranks_only_the_slowed_one_is_named(tmp_path):
    slowed_run(tmp_path, ranks=6, steps=8, slowed=4)
    report = build_report(tmp_path)
    assert flagged(report) == [4]
    assert report["engines"]["main"]["ranks_summary"][4]["attributed_wait_ms"] == pytest.approx(8 * 5 * 30, rel=0.05)


def slow_host_run(directory, ranks, steps, jitter_ms):
    """The upper half of the ranks on node-b, 30 ms slower per step; waits jittering by up to 8 x ``jitter_ms``."""
    for rank in range(ranks):
        slow = rank >= ranks // 2
        write_records(directory, rank, [
            record(rank, step, busy_ms=20.0 + (30.0 if slow else 0.0), world_size=ranks,
                   host="node-b" if slow else "node-a",
                   collective_ms=1.0 + (rank * 5 + step * 3) % 8 * jitter_ms + (0.0 if slow else 30.0))
            for step in range(steps)])


def test_a_slow_host_is_named_when_its_ranks_take_turns_as_step_straggler(tmp_path):
    """A whole node slowed (8 ranks of 16, 30 ms per step): each step's least wait falls on any of its
    ranks, so no rank stands out, but every step's straggler is on that host."""
    slow_host_run(tmp_path, 16, 60, jitter_ms=0.25)
    report = build_report(tmp_path)
    engine = report["engines"]["main"]
    assert engine["straggler_ranks"] == [] and all(8 <= rank for rank in engine["steps"].straggler)
    assert engine["straggler_hosts"] == ["node-b"]
    assert engine["hosts_summary"] == {
        "node-a": {"ranks": list(range(8)), "straggler_steps": 0, "straggler_p_value": 1.0, "straggler": False},
        "node-b": {"ranks": list(range(8, 16)), "straggler_steps": 60, "straggler_p_value": pytest.approx(0.5 ** 60),
                   "straggler": True}}
    text = " ".join(render_text(report).split())
    assert "No straggler rank: no rank was the step straggler more often than chance allows in the 60 steps" in text
    assert ("STRAGGLER HOST: node-b (ranks 8-15) held the others back in 60 of 60 steps: their straggler was one of "
            "its ranks (p = 8.7e-19 by chance, named at <= 0.0125)") in text


def test_a_slow_host_is_named_even_when_some_of_its_ranks_are(tmp_path):
    """A slow node of 4 ranks in 8, 40 steps: its ranks take turns, and with 1/8 the chance each, some come out
    named too; they are not the whole story, so the host is still said."""
    slow_host_run(tmp_path, 8, 40, jitter_ms=0.5)
    report = build_report(tmp_path)
    engine = report["engines"]["main"]
    assert engine["straggler_ranks"] and set(engine["straggler_ranks"]) < {4, 5, 6, 7}
    assert engine["straggler_hosts"] == ["node-b"]
    assert "STRAGGLER HOST: node-b (ranks 4-7) held the others back in 40 of 40 steps" in \
        " ".join(render_text(report).split())


def test_noise_above_the_step_threshold_names_no_host(tmp_path):
    """Two hosts of four ranks, waits jittering 0-6 ms (above the 2 ms floor): each step has a straggler,
    on either host by chance, about half the steps each; that is not a slow host.  (One such run in about 60
    names a host all the same, at the level's word: test_straggler_chance.py measures the rate.)"""
    import random

    jitter = random.Random(0)
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
    assert "No straggler: no rank was the step straggler more often than chance allows in the 10 steps." in \
        " ".join(render_text(report).split())


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


@pytest.mark.parametrize("ranks, straggler_steps, flagged_overall", [
    (2, 8, False),  # p = 56/1024 = 0.055 > 0.025 / 2
    (2, 9, True),  # p = 11/1024 = 0.0107 <= 0.0125: the case the level is chosen for
    (4, 6, False),  # p = 0.0197 > 0.025 / 4
    (4, 7, True),  # p = 0.0035 <= 0.00625
])
def test_flagged_overall_when_the_straggler_more_often_than_chance_allows(tmp_path, ranks, straggler_steps,
                                                                          flagged_overall):
    """Rank 1 arrives last in the first ``straggler_steps`` of 10 steps; rank 0 in the others."""
    for rank in range(ranks):
        write_records(tmp_path, rank, [
            record(rank, step, world_size=ranks,
                   collective_ms=2.0 + (0.0 if rank == (1 if step < straggler_steps else 0) else 30.0))
            for step in range(10)])
    report = build_report(tmp_path)
    summary = report["engines"]["main"]["ranks_summary"][1]
    assert summary["straggler_steps"] == straggler_steps and summary["straggler"] is flagged_overall
    assert report["engines"]["main"]["straggler_test"]["rank_level"] == 0.025 / ranks
    text = " ".join(render_text(report).split())
    if not flagged_overall:
        assert ("No straggler: no rank was the step straggler more often than chance allows in the 10 steps (step "
                f"stragglers: rank 1 in {straggler_steps}, rank 0 in {10 - straggler_steps}).") in text


def test_a_straggler_per_engine(tmp_path):
    slowed_run(tmp_path, ranks=2, steps=8, slowed=1, engine="main")
    slowed_run(tmp_path, ranks=2, steps=8, slowed=0, engine="critic", overlapped=True)
    report = build_report(tmp_path)
    assert flagged(report, "main") == [1] and flagged(report, "critic") == [0]


def test_the_output_states_the_rule_with_its_thresholds(tmp_path, capsys):
    slowed_run(tmp_path, ranks=2, steps=8, slowed=1)
    assert main(["report", str(tmp_path)]) == 0
    assert ("Straggler rule: a step's straggler is the rank with the least time inside the step's collectives "
            "(collective_ms; records without it, schema 2 or older: the least exposed wait) where the spread across "
            "ranks (max - min) is >= max(2 ms, 10% of the step's median step time): it arrived last, and the "
            "others' excess is the wait it caused; a rank is flagged STRAGGLER when it is the step straggler more "
            "often than chance allows: a one-sided exact binomial test of its count against 1/ranks per recorded "
            "train step, p <= 2.5% / ranks (so a run with no slow rank names one in at most 2.5% of runs); a rank "
            "not flagged but the step straggler of more of the steps where a rank held the others back than chance "
            "allows (the same test over those steps only) is listed HELD BACK IN SOME STEPS: slow in part of the run; "
            "with ranks on several hosts, a host is flagged STRAGGLER HOST by the same test against its share of the "
            "ranks, p <= 2.5% / hosts.") in " ".join(capsys.readouterr().out.split())  # as one line: prose is wrapped
    assert main(["report", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    engine = data["engines"]["main"]
    assert engine["ranks_summary"]["1"]["straggler"] is True
    assert engine["ranks_summary"]["1"]["straggler_p_value"] == pytest.approx(1 / 256)
    assert engine["ranks_summary"]["0"]["straggler"] is False
    assert engine["straggler_figure"] == "exposed_wait_ms"
    reach = engine["straggler_test"].pop("reach")
    assert engine["straggler_test"] == {"steps": 8, "steps_to_name": 8, "chance_per_step": 0.5, "rank_level": 0.0125,
                                        "host_level": None}
    assert reach.startswith("a rank is named when it is the step straggler in at least 8 of the 8 tested steps")
    rule = data["straggler_rule"]
    assert (rule["figure"], rule["min_spread_ms"], rule["min_spread_share_of_median_step"], rule["level"]) == (
        ["collective_ms", "exposed_wait_ms"], 2.0, 0.1, 0.025)
    assert rule["rank_level"] == "level / ranks" and rule["host_level"] == "level / hosts"


@pytest.mark.parametrize("ranks, steps, needed", [(2, 10, 9), (2, 7, 7), (2, 6, None), (4, 10, 7), (2, 100, 62)])
def test_the_report_says_how_many_steps_name_a_rank_and_what_it_cannot_see(tmp_path, ranks, steps, needed):
    """The reach is the binomial test's own boundary: ``needed`` straggler steps pass, one fewer does not."""
    from ds_profutils.report.chance import binomial_upper_tail
    from ds_profutils.report.steps import STRAGGLER_LEVEL, steps_to_name

    assert steps_to_name(steps, ranks) == needed
    if needed is not None:
        assert binomial_upper_tail(needed, steps, 1 / ranks) <= STRAGGLER_LEVEL / ranks
        assert binomial_upper_tail(needed - 1, steps, 1 / ranks) > STRAGGLER_LEVEL / ranks
    slowed_run(tmp_path, ranks=ranks, steps=steps, slowed=1)
    report = build_report(tmp_path)
    rule = report["straggler_rule"]
    assert rule["reach"]["main"]["steps_to_name"] == needed == report["engines"]["main"]["straggler_test"]["steps_to_name"]
    assert rule["reach"]["main"]["tested_steps"] == steps and "not flagged" in rule["below_threshold"]
    text = " ".join(render_text(report).split())
    said = (f"a rank is named when it is the step straggler in at least {needed} of the {steps} tested steps of {ranks} "
            "ranks" if needed is not None else f"no rank can be named: {steps} tested steps of {ranks} ranks are too few")
    assert f"Reach of the test: {said}" in text
    assert "a rank slower by less than the per-step threshold (here " in text and "is not flagged" in text


def slowed_from(directory, steps, first_slow):
    """Two ranks; rank 1 80 ms slower from global step ``first_slow`` on, rank 0 waiting that long for it."""
    for rank in (0, 1):
        rows = []
        for step in range(steps):
            slow = 80.0 if step >= first_slow else 0.0
            jitter = 0.5 * ((rank * 7 + step * 3) % 5 - 2) / 2
            rows.append(record(rank, step, busy_ms=20.0 + (slow if rank == 1 else 0.0), world_size=2,
                               collective_ms=2.0 + jitter + (slow if rank == 0 else 0.0)))
        write_records(directory, rank, rows)


def test_a_rank_slowed_from_the_middle_of_the_run_on_is_named_held_back_in_those_steps(tmp_path):
    """Rank 1 80 ms slower from step 20 of 40 on: the straggler of every step where a rank was, half of all steps.
    The test over every step cannot name it (20 of 40 is what chance gives one of 2 ranks, however long the run);
    the test over the steps where a rank held the others back does, with those steps and the cause there."""
    slowed_from(tmp_path, steps=40, first_slow=20)
    report = build_report(tmp_path)
    engine = report["engines"]["main"]
    assert engine["straggler_ranks"] == [] and engine["held_back_ranks"] == [1]
    row = engine["ranks_summary"][1]
    assert (row["straggler_steps"], row["held_steps"]) == (20, 20)
    assert row["straggler_step_numbers"] == list(range(20, 40))
    assert not engine["ranks_summary"][0]["held_back_in_some_steps"]
    text = " ".join(render_text(report).split())
    assert ("HELD BACK IN SOME STEPS: rank 1 (node-a) held the others back in 20 of the 20 steps where a rank did, of "
            "40 (global steps 20-39; p = 9.5e-07 by chance, named at <= 0.0125); their waiting beyond its own in those "
            "steps: 1,600.0 ms; the cause in those steps: compute 20") in text
    (tmp_path / "even").mkdir()
    slowed_run(tmp_path / "even", ranks=2, steps=40, slowed=None)
    assert build_report(tmp_path / "even")["engines"]["main"]["held_back_ranks"] == []


def test_a_held_back_ranks_steps_are_all_said_however_many(tmp_path):
    """Late from step 100 of 200 on: the line says 100-199, not the first forty of them as if that were all."""
    slowed_from(tmp_path, steps=200, first_slow=100)
    report = build_report(tmp_path)
    assert report["engines"]["main"]["held_back_ranks"] == [1]
    assert "(global steps 100-199; p = " in " ".join(render_text(report).split())
