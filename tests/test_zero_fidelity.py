"""Fetch records under the real launcher in the conditions real jobs meet (tests/dist_scripts/zero_fidelity.py):
device clocks through a stand-in accelerator, gradient accumulation, two engines in one process, and a
rank slowed by a sleep."""
import json
from statistics import median

import pytest

from ds_profutils.report import build_report
from launcher import DIST_SCRIPTS, run_deepspeed
from report_testing import read_records_file

TICK_MS = 3.0  # the stand-in device clock moves this much per recorded event


@pytest.fixture(scope="module")
def device_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero_device")
    run_deepspeed(DIST_SCRIPTS / "zero_fidelity.py", ["--out", str(out), "--mode", "device"])
    return out


@pytest.fixture(scope="module")
def straggler_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero_straggler")
    run_deepspeed(DIST_SCRIPTS / "zero_fidelity.py", ["--out", str(out), "--mode", "straggler"])
    return out


def expected(out, rank):
    return json.loads((out / f"expected_rank_{rank}.json").read_text())


@pytest.mark.parametrize("rank", [0, 1])
def test_fetch_waits_are_the_device_clocks_times(device_run, rank):
    """Where use_host_timers() is False, the waits the compute stream sees are timed by events on it."""
    for record in read_records_file(device_run / "records" / f"zero_fetch_rank_{rank}.jsonl"):
        assert record["clock"] == "device"
        for name in ("forward_fetch_wait", "backward_fetch_wait"):
            wait = record["events"][name]
            assert wait["clock"] == "device"
            # start and stop mark adjacent events: exactly one tick each, whatever the host measured
            assert (wait["time_ms"], wait["min_ms"], wait["max_ms"]) == (TICK_MS * wait["count"], TICK_MS, TICK_MS)
            assert wait["host_time_ms"] != wait["time_ms"]
        launches = {name: e for name, e in record["events"].items() if not name.endswith("_fetch_wait")}
        assert "forward_all_gather" in launches and all(e["clock"] == "host" for e in launches.values())
        assert record["step_time_ms"] % TICK_MS == 0 and record["step_time_ms"] > record["exposed_wait_ms"]


@pytest.mark.parametrize("rank", [0, 1])
def test_gradient_accumulation_records_global_and_micro_steps(device_run, rank):
    records = read_records_file(device_run / "records" / f"zero_fetch_rank_{rank}.jsonl")
    assert [(r["global_step"], r["micro_step"]) for r in records] == [(0, 0), (0, 1), (1, 2), (1, 3), (2, 4), (2, 5)]
    assert all(r["schema"] == 2 and r["mode"] == "train" and r["engine"] == "main" for r in records)


@pytest.mark.parametrize("rank", [0, 1])
def test_two_engines_in_one_process_each_keep_their_own_file(device_run, rank):
    found = expected(device_run, rank)
    for engine, file_name in (("main", f"zero_fetch_rank_{rank}.jsonl"), ("critic", f"zero_fetch_critic_rank_{rank}.jsonl")):
        records = read_records_file(device_run / "records" / file_name)
        assert found["paths"][engine].endswith(file_name)
        assert {r["engine"] for r in records} == {engine} and {r["rank"] for r in records} == {rank}
        # Every forward gathers its own whole model (persistence threshold 0), never the other's.
        assert {r["events"]["forward_all_gather"]["numel"] for r in records} == {found["numel"][engine]}
    assert found["numel"]["main"] != found["numel"]["critic"]


def exposed_waits(out, engine, rank):
    return [r["exposed_wait_ms"] for r in read_records_file(out / "records" / f"zero_fetch_{engine}_rank_{rank}.jsonl")]


def test_the_rank_that_waits_for_a_slowed_peer_records_the_wait(straggler_run):
    """Rank 1 sleeps 30 ms in every forward: rank 0 spends that time blocked in the gradient collectives
    and fetches; rank 1, which held it back, waits least."""
    waits = {rank: exposed_waits(straggler_run, "slowed", rank) for rank in (0, 1)}
    excess = [zero - one for zero, one in zip(waits[0], waits[1])]
    assert median(excess) >= 15, excess
    calm = {rank: exposed_waits(straggler_run, "calm", rank) for rank in (0, 1)}
    assert abs(median(zero - one for zero, one in zip(calm[0], calm[1]))) < 10
    records = read_records_file(straggler_run / "records" / "zero_fetch_slowed_rank_0.jsonl")
    for record in records:
        assert record["collective_wait_ms"] == pytest.approx(sum(c["time_ms"] for c in record["collectives"].values()))
        assert record["exposed_wait_ms"] == pytest.approx(record["fetch_wait_ms"] + record["collective_wait_ms"])
    assert any("reduce_scatter_tensor" in record["collectives"] for record in records)  # the gradient reduction


def test_the_report_names_the_slowed_rank_and_no_rank_of_a_calm_run(straggler_run):
    report = build_report(straggler_run / "records")
    slowed, calm = report["engines"]["slowed"], report["engines"]["calm"]
    assert slowed["straggler_ranks"] == [1]  # the rank that slept, never the one that waited for it
    assert slowed["ranks_summary"][1]["straggler"] and not slowed["ranks_summary"][0]["straggler"]
    assert calm["straggler_ranks"] == []
    assert not any(row["straggler"] for row in calm["ranks_summary"].values())
