"""Fetch records under the real launcher in the conditions real jobs meet (tests/dist_scripts/zero_fidelity.py):
device clocks through a stand-in accelerator, gradient accumulation, two engines in one process, and a
rank slowed by a sleep."""
import json
from statistics import median

import pytest

from ds_profutils.report import build_report
from launcher import DIST_SCRIPTS, run_deepspeed
from report_testing import read_records_file

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


@pytest.fixture(scope="module")
def interleaved_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero_interleaved")
    run_deepspeed(DIST_SCRIPTS / "zero_fidelity.py", ["--out", str(out), "--mode", "interleaved"])
    return out


def expected(out, rank):
    return json.loads((out / f"expected_rank_{rank}.json").read_text())


def records_of(out, rank):
    return {engine: read_records_file(out / "records" / name) for engine, name in
            (("main", f"zero_fetch_rank_{rank}.jsonl"), ("critic", f"zero_fetch_critic_rank_{rank}.jsonl"))}


@pytest.mark.parametrize("rank", [0, 1])
def test_every_figure_is_the_device_time_of_the_stream_it_ran_on(device_run, rank):
    """On a real ZeRO-3 engine with the stream-clock stand-in: step times, fetch waits and every collective
    are what the device model says (an event on the wrong stream, or a host time, would differ)."""
    found = expected(device_run, rank)
    durations = found["durations_ms"]
    for engine, records in records_of(device_run, rank).items():
        for record in records:
            model = found["records"][f"{engine}/{record['micro_step']}"]
            assert record["clock"] == "device"
            assert record["step_time_ms"] == pytest.approx(model["end_ms"] - model["start_ms"])
            assert record["fetch_wait_ms"] == pytest.approx(model["stall_ms"])  # the compute stream's stalls
            for name in ("forward_fetch_wait", "backward_fetch_wait"):
                assert record["events"][name]["clock"] == "device"
            launches = {name: e for name, e in record["events"].items() if not name.endswith("_fetch_wait")}
            assert "forward_all_gather" in launches and all(e["clock"] == "host" for e in launches.values())
            side = record["collectives"].pop("all_reduce@side-stream")
            assert (side["count"], side["time_ms"], side["exposed_ms"]) == (model["side_reduces"],
                                                                            model["side_reduces"] * 5.0, 0.0)
            for op, entry in record["collectives"].items():  # the compute stream's
                # each call its own duration, an async one's however late it was waited for
                assert entry["time_ms"] == pytest.approx(entry["count"] * durations[op]), op
                blocking_ms = (entry["count"] - entry["async"]) * durations[op]
                assert entry["exposed_ms"] == pytest.approx(blocking_ms) and entry["clock"] == "device"
            assert record["collectives"]["all_gather_into_tensor"]["async"] > 0  # ZeRO-3's parameter gathers
            # overlapping collectives count once on the step's axis (prefetches beside each other and the rest)
            entries = [side, *record["collectives"].values()]
            assert max(entry["time_ms"] for entry in entries) <= record["collective_ms"]
            assert record["collective_ms"] <= sum(entry["time_ms"] for entry in entries)


@pytest.mark.parametrize("rank", [0, 1])
def test_gradient_accumulation_records_global_and_micro_steps(device_run, rank):
    records = read_records_file(device_run / "records" / f"zero_fetch_rank_{rank}.jsonl")
    assert [(r["global_step"], r["micro_step"]) for r in records] == [(0, 0), (0, 1), (1, 2), (1, 3), (2, 4), (2, 5)]
    assert all(r["schema"] == 3 and r["mode"] == "train" and r["engine"] == "main" for r in records)


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
    """Rank 1 sleeps 60 ms in every forward: rank 0 spends that time blocked in the gradient collectives
    and fetches; rank 1, which held it back, waits least."""
    waits = {rank: exposed_waits(straggler_run, "slowed", rank) for rank in (0, 1)}
    excess = [zero - one for zero, one in zip(waits[0], waits[1])]
    assert median(excess) >= 15, excess
    calm = {rank: exposed_waits(straggler_run, "calm", rank) for rank in (0, 1)}
    assert abs(median(zero - one for zero, one in zip(calm[0], calm[1]))) < 10
    records = read_records_file(straggler_run / "records" / "zero_fetch_slowed_rank_0.jsonl")
    for record in records:
        assert record["collective_ms"] == pytest.approx(sum(c["time_ms"] for c in record["collectives"].values()))
        assert record["collective_wait_ms"] == pytest.approx(sum(c["exposed_ms"] for c in record["collectives"].values()))
        assert record["exposed_wait_ms"] == pytest.approx(record["fetch_wait_ms"] + record["collective_wait_ms"])
    assert any("reduce_scatter_tensor" in record["collectives"] for record in records)  # the gradient reduction


def test_time_inside_collectives_shows_who_arrived_last_when_slowed_in_backward_only(straggler_run):
    """Rank 1 sleeps in backward only: the gradient collectives make both ranks' steps equally long, but
    rank 0 spends that time inside them, waiting for rank 1."""
    inside = {rank: [r["collective_ms"] for r in read_records_file(
        straggler_run / "records" / f"zero_fetch_slowed-backward_rank_{rank}.jsonl")] for rank in (0, 1)}
    assert median(zero - one for zero, one in zip(inside[0], inside[1])) >= 15


@pytest.mark.parametrize("engine", ["slowed", "slowed-backward"])
def test_the_report_names_the_slowed_rank_and_no_rank_of_a_calm_run(straggler_run, engine):
    report = build_report(straggler_run / "records")
    slowed, calm = report["engines"][engine], report["engines"]["calm"]
    assert slowed["straggler_ranks"] == [1]  # the rank that slept, never the one that waited for it
    assert slowed["ranks_summary"][1]["straggler"] and not slowed["ranks_summary"][0]["straggler"]
    assert calm["straggler_ranks"] == []
    assert not any(row["straggler"] for row in calm["ranks_summary"].values())


@pytest.mark.parametrize("rank", [0, 1])
def test_interleaved_engines_each_keep_their_own_collectives(interleaved_run, rank):
    """Actor and critic steps interleaved (both forwards, both backwards, both steps): each engine's records
    hold the collectives of a run of that engine alone, step by step -- never the other engine's."""
    def counts(name):
        records = read_records_file(interleaved_run / "records" / f"zero_fetch_{name}_rank_{rank}.jsonl")
        return [{op: entry["count"] for op, entry in record["collectives"].items()} for record in records]

    for engine in ("actor", "critic"):
        alone = counts(f"{engine}-alone")
        assert len(alone) == expected(interleaved_run, rank)["steps"] and all(alone), engine
        assert counts(engine) == alone, engine
