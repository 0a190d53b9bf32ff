"""The report's HANG section from the ranks' hang files: culprits (not in the collective the others wait in, or
at a lower sequence number there, or without a file), waiting ranks, the step and phase, each rank's state and
stack; read without any step records; a resolved file is no hang."""
import json

import pytest

from ds_profutils.report import build_report, render_text

from test_zero_attach import Engine
from test_step_records import attach_recorder


def stack(*functions):
    return [{"file": "/job/train.py", "line": 10 + index, "function": name} for index, name in enumerate(functions)]


def hang_file(directory, rank, *, inside=None, groups=(), step=6, phase="forward", resolved=False, world=2):
    """A hang file as the watchdog writes it (docs/hangs.md): ``inside`` = (name, group, seq) or None."""
    collective = None if inside is None else {"name": inside[0], "group": list(inside[1]), "seq": inside[2],
                                               "bytes": 4096, "since": 1000.0, "ended": None, "waiting_s": 31.5}
    content = {
        "schema": 1, "rank": rank, "world_size": world, "host": "node-a", "pid": 100 + rank, "time": 1031.5,
        "timeout_s": 5, "since": 1000.0, "stuck_s": 31.5, "writes": 6, "resolved": resolved,
        "resolved_after_s": 40.0 if resolved else None,
        "engines": [{"name": "main", "global_step": step, "phase": phase}],
        "collective": collective, "last_collective": None,
        "groups": [{"group": list(group), "seq": seq, "ended_seq": seq - (inside is not None)}
                   for group, seq in groups],
        "threads": [{"name": "watchdog", "ident": 2, "training": False, "stack": stack("wait")},
                    {"name": "MainThread", "ident": 1, "training": True,
                     "stack": stack("sleep_before_forward", "main", "<module>")}],
        "memory": {"rss_bytes": 1 << 30},
    }
    (directory / f"hang_rank_{rank}.json").write_text(json.dumps(content))


def test_the_rank_outside_the_collective_the_others_wait_in_is_the_culprit_even_without_records(tmp_path):
    world = (0, 1, 2, 3)
    for rank in (0, 2, 3):
        hang_file(tmp_path, rank, inside=("all_reduce", world, 57), groups=[(world, 57)], phase="backward", world=4)
    hang_file(tmp_path, 1, groups=[(world, 56)], world=4)
    report = build_report(tmp_path)
    hang = report["engines"]["main"]["hang"]
    assert hang["culprits"] == [1] and hang["waiting"] == [0, 2, 3] and hang["missing"] == []
    assert hang["global_step"] == 6 and hang["phase"] == "forward"
    assert hang["ranks"][1]["state"] == "outside_collectives" and hang["ranks"][1]["collective"] is None
    assert hang["ranks"][1]["stack"][0] == "/job/train.py:10 sleep_before_forward"
    waiting = hang["ranks"][0]
    assert (waiting["state"], waiting["collective"], waiting["seq"], waiting["waiting_s"]) == (
        "in_collective", "all_reduce", 57, 31.5)
    lines = render_text(report).splitlines()
    assert lines[1] == "HANG: engine main at global step 6, forward: no optimizer step for 32 s (timeout 5 s)"
    assert lines[2] == "  never arrived: rank 1"
    assert "/job/train.py:10 sleep_before_forward" in lines[4]
    assert any(line.startswith("  waiting: rank 0 inside all_reduce (group 0-3, seq 57) for 32 s, backward;") for line in lines)


def test_a_rank_at_a_lower_sequence_number_or_without_a_file_never_arrived(tmp_path):
    world = (0, 1, 2)
    hang_file(tmp_path, 0, inside=("all_reduce", world, 9), groups=[(world, 9)], world=3)
    hang_file(tmp_path, 1, inside=("all_reduce", world, 8), groups=[(world, 8)], world=3)  # one behind
    hang = build_report(tmp_path)["engines"]["main"]["hang"]
    assert hang["culprits"] == [1] and hang["missing"] == [2] and hang["waiting"] == [0]


def test_a_culprit_waiting_in_a_collective_of_another_group_is_named(tmp_path):
    world, pair = (0, 1), (1, 3)
    hang_file(tmp_path, 0, inside=("broadcast", world, 4), groups=[(world, 4)])
    hang_file(tmp_path, 1, inside=("recv", pair, 2), groups=[(world, 3), (pair, 2)])
    hang_file(tmp_path, 3, inside=("send", pair, 2), groups=[(pair, 2)])
    hang = build_report(tmp_path)["engines"]["main"]["hang"]
    assert hang["culprits"] == [1] and hang["waiting"] == [0, 3]


def test_nobody_inside_a_collective_names_nobody_and_shows_the_stacks(tmp_path):
    hang_file(tmp_path, 0, groups=[((0, 1), 3)])
    hang_file(tmp_path, 1, groups=[((0, 1), 3)])
    report = build_report(tmp_path)
    assert report["engines"]["main"]["hang"]["culprits"] == []
    text = render_text(report)
    assert "no rank waits inside a collective" in text and text.count("sleep_before_forward") == 2


def test_nobody_inside_a_collective_but_one_rank_ahead_names_the_ranks_behind(tmp_path):
    """Rank 0 issued a collective rank 1 never issued and waits on its async handle (not marked inside): rank 1,
    behind on the group, is named; the group of rank 0 alone is nobody's wait."""
    hang_file(tmp_path, 0, groups=[((0, 1), 25), ((0,), 4)])
    hang_file(tmp_path, 1, groups=[((0, 1), 24)])
    report = build_report(tmp_path)
    hang = report["engines"]["main"]["hang"]
    assert hang["culprits"] == [1] and hang["waiting"] == [] and hang["missing"] == []
    assert "never arrived: rank 1" in render_text(report)


def test_ranks_inside_different_collectives_at_one_sequence_number_are_named_mismatched(tmp_path):
    """Uneven data: rank 1 left the loop early and waits in a barrier, rank 0 in the next step's gradient all_reduce,
    both the 10th on the group: neither is behind, each waits for the other in a collective it never joins."""
    world = (0, 1)
    hang_file(tmp_path, 0, inside=("all_reduce", world, 10), groups=[(world, 10)], phase="backward")
    hang_file(tmp_path, 1, inside=("barrier", world, 10), groups=[(world, 10)], phase="between steps")
    report = build_report(tmp_path)
    hang = report["engines"]["main"]["hang"]
    assert hang["culprits"] == [] and hang["missing"] == []
    assert hang["mismatched"] == [{"group": [0, 1], "seq": 10, "collectives": {0: "all_reduce", 1: "barrier"},
                                   "p2p": False}]
    text = " ".join(render_text(report).split())  # the lines as wrapped, read as one
    assert "mismatched collectives: group 0-1, seq 10: rank 0 in all_reduce, rank 1 in barrier: the ranks' " \
           "programs issued different collectives there" in text
    assert "no rank waits inside a collective" not in text and "no rank is behind" not in text


@pytest.mark.parametrize("calls, mismatched", [(("send", "recv"), False), (("isend", "recv"), False),
                                               (("send", "send"), True)])
def test_a_pipeline_pair_inside_a_send_and_its_receive_is_matched_and_two_sends_are_not(tmp_path, calls, mismatched):
    """A pipeline's send and the neighbour's receive share the pair's sequence number: the same transfer, which does
    not end; both ranks sending to each other (a schedule deadlock) is a mismatch."""
    pair = (0, 1)
    for rank, call in enumerate(calls):
        hang_file(tmp_path, rank, inside=(call, pair, 12), groups=[(pair, 12)])
    report = build_report(tmp_path)
    hang = report["engines"]["main"]["hang"]
    assert bool(hang["mismatched"]) == mismatched and hang["culprits"] == []
    text = " ".join(render_text(report).split())
    assert ("rank 0 in send, rank 1 in send: both ends of the pair wait on the same side of a transfer: the stages' "
            "schedules do not match there" in text) == mismatched and "uneven data" not in text


def test_ranks_all_inside_the_same_collective_are_not_said_to_wait_for_nobody(tmp_path):
    """Every member inside the same all_reduce, none behind: the collective itself does not end."""
    world = (0, 1)
    for rank in world:
        hang_file(tmp_path, rank, inside=("all_reduce", world, 7), groups=[(world, 7)])
    report = build_report(tmp_path)
    hang = report["engines"]["main"]["hang"]
    assert hang["culprits"] == hang["mismatched"] == [] and hang["waiting"] == [0, 1]
    text = " ".join(render_text(report).split())
    assert "no rank is behind: the ranks waiting are inside the same collective, which does not end" in text
    assert "no rank waits inside a collective for another" not in text


def test_of_two_engines_the_hang_is_the_one_a_rank_is_inside_not_the_one_between_steps(tmp_path):
    """An actor and a critic attached; rank 0 waits in the critic's backward all_reduce for rank 1, asleep between
    steps: one HANG, the critic's (the actor only waits for it), where each engine had the same section before."""
    world = (0, 1)
    hang_file(tmp_path, 0, inside=("all_reduce", world, 28), groups=[(world, 28)])
    hang_file(tmp_path, 1, groups=[(world, 27)])
    for rank, critic_phase in ((0, "backward"), (1, "between steps")):
        path = tmp_path / f"hang_rank_{rank}.json"
        content = json.loads(path.read_text())
        content["engines"] = [{"name": "main", "global_step": 6, "phase": "between steps"},
                              {"name": "critic", "global_step": 6, "phase": critic_phase}]
        path.write_text(json.dumps(content))
    report = build_report(tmp_path)
    assert report["engines"].get("main", {}).get("hang") is None  # (no records here: no section either)
    hang = report["engines"]["critic"]["hang"]
    assert hang["culprits"] == [1] and hang["waiting"] == [0] and hang["ranks"][0]["phase"] == "backward"
    text = render_text(report)
    assert text.count("HANG: engine") == 1 and "HANG: engine critic" in text


def test_every_rank_closed_by_its_program_with_no_step_since_is_said_so_not_called_a_hang(tmp_path):
    """A long evaluation after the last step, or a hang each program stopped waiting for: the report cannot tell, so
    it says both, and still shows where each rank was; one rank not closed (killed while stuck) keeps it a HANG."""
    world = (0, 1)
    hang_file(tmp_path, 0, inside=("all_reduce", world, 9), groups=[(world, 9)], phase="backward")
    hang_file(tmp_path, 1, groups=[(world, 8)])
    for rank in (0, 1):
        path = tmp_path / f"hang_rank_{rank}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "closed_after_s": 40.0}))
    report = build_report(tmp_path)
    hang = report["engines"]["main"]["hang"]
    assert hang["closed"] and hang["culprits"] == [1]
    text = " ".join(render_text(report).split())
    assert "NO STEP BEFORE THE CLOSE: engine main at global step 6, forward: no optimizer step for 32 s or more " \
           "(timeout 5 s), then every rank's program closed it: a long evaluation or save after the last step, or a " \
           "hang the program stopped waiting for" in text
    assert "HANG:" not in text and "never arrived: rank 1" in text
    (tmp_path / "hang_rank_1.json").unlink()  # rank 1 wrote none: the others wait for it, it said nothing
    report = build_report(tmp_path)
    assert not report["engines"]["main"]["hang"]["closed"] and "HANG: engine main" in render_text(report)
    hang_file(tmp_path, 1, groups=[(world, 8)])  # rank 1 killed where it was: no close
    report = build_report(tmp_path)
    assert not report["engines"]["main"]["hang"]["closed"] and "HANG: engine main" in render_text(report)


def test_a_resolved_hang_is_a_slow_step_not_a_hang(tmp_path):
    engine = Engine(stage=2)
    with attach_recorder(engine, tmp_path):
        engine.train_step()
    hang_file(tmp_path, 3, groups=[((0, 1), 3)], resolved=True)
    report = build_report(tmp_path)
    assert report["engines"].get("main", {}).get("hang") is None  # (no records here: no section either)
    assert "HANG" not in render_text(report)


def test_records_and_hang_files_together(tmp_path):
    engine = Engine(stage=2)
    with attach_recorder(engine, tmp_path):
        for _ in range(2):
            engine.train_step()
    hang_file(tmp_path, 3, inside=("all_reduce", (0, 3), 5), groups=[((0, 3), 5)], step=2, world=4)
    report = build_report(tmp_path)
    engine_report = report["engines"]["main"]
    assert engine_report["steps"].global_steps == [0, 1]
    assert engine_report["hang"]["missing"] == [0] and engine_report["hang"]["waiting"] == [3]
    assert render_text(report).splitlines()[1].startswith("HANG")


def test_a_hang_file_that_cannot_be_read_is_named_as_one(tmp_path):
    world = (0, 1)
    hang_file(tmp_path, 0, inside=("all_reduce", world, 9), groups=[(world, 9)])
    (tmp_path / "hang_rank_1.json").write_text('{"schema": 1, "rank"')  # cut by a kill while written
    text = render_text(build_report(tmp_path))
    assert "hang file, rank 1 (hang_rank_1.json): not read" in text and "records of engine None" not in text


def test_hang_files_of_an_earlier_run_with_more_ranks_are_left_out_not_read_as_this_runs(tmp_path):
    """A relaunch with 2 ranks in the output_dir a 4-rank run hung in: ranks 2-3's old files (world size 4) are that
    run's; this run's culprit is rank 1, behind rank 0 on their group, and the old files are listed as left out."""
    old, new = (0, 1, 2, 3), (0, 1)
    for rank in (2, 3):
        hang_file(tmp_path, rank, inside=("all_reduce", old, 57), groups=[(old, 57)], world=4)
        path = tmp_path / f"hang_rank_{rank}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "time": 500.0}))  # written before this run's
    hang_file(tmp_path, 0, inside=("all_reduce", new, 9), groups=[(new, 9)])
    hang_file(tmp_path, 1, groups=[(new, 8)])
    report = build_report(tmp_path)
    hang = report["engines"]["main"]["hang"]
    assert hang["culprits"] == [1] and hang["waiting"] == [0] and sorted(hang["ranks"]) == [0, 1]
    left_out = [entry for entry in report["incomplete"] if entry["kind"] == "hang"]
    assert [entry["rank"] for entry in left_out] == [2, 3]
    assert all("world size 4" in entry["reason"] for entry in left_out)
