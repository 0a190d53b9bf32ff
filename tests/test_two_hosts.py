"""Two hosts on one machine: each node of the job in its own namespaces (its own hostname, pids that repeat
across nodes), 2 ranks each, writing into one shared directory.  Every rank's trace and records are its own
and name the right host and global rank; a capture of every rank, asked for before the job starts and taken at
its first interval (step 4, after the profiler's window), has a manifest naming each rank's host."""
import json

import pytest

from ds_profutils.report import build_report
from ds_profutils.report.captures import capture_lines, read_captures
from ds_profutils.report.captures.command import write_request
from launcher import DIST_SCRIPTS, namespaces_permitted, run_two_nodes
from profiler_testing import profiler_steps, read_trace
from report_testing import read_records_file

RANKS = range(4)


@pytest.fixture(scope="module")
def two_node_job(tmp_path_factory):
    why_not = namespaces_permitted()
    if why_not:
        pytest.skip(why_not)
    out = tmp_path_factory.mktemp("two_hosts")
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "profiler": {"output_dir": str(out / "profile"), "skip_first": 0, "wait": 1, "warmup": 1, "active": 2},
        "partitioned_param_profiler": {"enabled": True, "output_dir": str(out / "profile")},
        # the exchange after steps 3 and 7 (no step records of step_metrics' own): the capture at 4, its `done` at 7
        "step_metrics": {"enabled": False, "monitor_interval": 4},
        "trace_capture": {"enabled": True, "output_dir": str(out / "captures")},
    }
    (out / "ds_config.json").write_text(json.dumps(config))
    (out / "captures").mkdir()
    write_request(out / "captures", 1, "all")
    run_two_nodes(DIST_SCRIPTS / "two_hosts.py", ["--out", str(out), "--deepspeed_config", str(out / "ds_config.json")],
                  out)
    return out


def host_of(rank):
    return f"node-{rank // 2}"


def test_each_rank_knows_its_host_and_pids_repeat_across_hosts(two_node_job):
    identities = [json.loads((two_node_job / f"identity_rank_{rank}.json").read_text()) for rank in RANKS]
    assert [(i["rank"], i["host"], i["local_rank"]) for i in identities] == [(r, host_of(r), r % 2) for r in RANKS]
    # What makes shared directories dangerous: the same pid on both hosts.
    assert {i["pid"] for i in identities[:2]} & {i["pid"] for i in identities[2:]}


@pytest.mark.parametrize("rank", RANKS)
def test_records_of_every_rank_are_distinct_and_name_host_and_rank(two_node_job, rank):
    records = read_records_file(two_node_job / "profile" / f"zero_fetch_rank_{rank}.jsonl")
    assert len(records) == 8
    assert {(r["rank"], r["world_size"], r["local_rank"], r["host"]) for r in records} == {(rank, 4, rank % 2,
                                                                                           host_of(rank))}


@pytest.mark.parametrize("rank", RANKS)
def test_traces_of_every_rank_are_distinct_and_name_host_and_rank(two_node_job, rank):
    trace = read_trace(two_node_job / "profile" / f"trace_rank_{rank}.json")
    assert trace["distributedInfo"]["rank"] == rank and trace["distributedInfo"]["world_size"] == 4
    assert (trace["ds_profutils"]["host"], trace["ds_profutils"]["rank"]) == (host_of(rank), rank)
    assert profiler_steps(trace) == [2, 3]


def test_nothing_is_left_under_a_temporary_or_probe_name(two_node_job):
    leftovers = [path.name for folder in ("profile", "captures") for path in (two_node_job / folder).rglob(".*")]
    assert leftovers == []


def test_a_capture_of_every_rank_names_each_ranks_host_in_its_manifest_and_the_report(two_node_job):
    folders = sorted(path.name for path in (two_node_job / "captures").glob("capture_*") if path.is_dir())
    assert folders == ["capture_4"]
    folder = two_node_job / "captures" / "capture_4"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert (manifest["reason"], manifest["ranks"], manifest["done"]) == ("request", list(RANKS), True)
    assert manifest["hosts"] == {str(rank): host_of(rank) for rank in RANKS}
    for rank in RANKS:
        trace = read_trace(folder / f"trace_rank_{rank}.json")
        assert (trace["distributedInfo"]["rank"], profiler_steps(trace)) == (rank, [4])
    assert ("    traces on hosts: node-0 ranks [0, 1]; node-1 ranks [2, 3] (each host writes its ranks' traces into "
            "its own capture_4/)") in capture_lines(read_captures(two_node_job / "captures"))


def test_the_report_shows_both_hosts_and_joins_every_ranks_trace(two_node_job):
    report = build_report(two_node_job / "profile")
    assert report["hosts"] == {"node-0": [0, 1], "node-1": [2, 3]}
    assert report["engines"]["main"]["ranks"] == list(RANKS) and report["incomplete"] == []
    assert {rank: row["host"] for rank, row in report["engines"]["main"]["ranks_summary"].items()} == {
        rank: host_of(rank) for rank in RANKS}
    assert sorted(report["traces"]) == list(RANKS)
