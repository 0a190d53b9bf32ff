"""``ds-profutils timeline``: the ranks' traces in one Chrome/Perfetto trace, one process per rank, each trace
placed by its own clock base and other hosts aligned on the end of a collective every rank recorded.

The real traces come from 2 ranks under the deepspeed launcher (``@profiler``, gloo); a copy of rank 1's
trace, claimed by another host whose clock runs 5 s ahead, is the clock offset the merge must undo."""
import json
import shutil

import pytest

from ds_profutils.cli import main
from ds_profutils.timeline.merge import align, scan_trace


OFFSET_NS = 5_000_000_000  # the other host's clock runs 5 s ahead


@pytest.fixture(scope="module")
def traces(profiled_job):
    """The run traces of the 2-rank job shared with the profiler's launcher tests (2 cycles each)."""
    return profiled_job[0]


def load(path):
    with open(path) as source:
        return json.load(source)


def gloo_ends(events, pid):
    """End (ts + dur) of each gloo collective of one process, by name and occurrence in start order."""
    spans = {}
    for event in events:
        if event.get("pid") == pid and event.get("ph") == "X" and event["name"].startswith("gloo:"):
            spans.setdefault(event["name"], []).append((event["ts"], event["ts"] + event["dur"]))
    return {(name, index): end for name, found in spans.items() for index, (_, end) in enumerate(sorted(found))}


def test_two_ranks_of_one_host_keep_their_clocks(traces, tmp_path, capsys):
    assert main(["timeline", str(traces), "-o", str(tmp_path / "timeline.json")]) == 0
    assert "2 ranks, one process per rank" in capsys.readouterr().out
    merged = load(tmp_path / "timeline.json")
    originals = {rank: load(traces / f"trace_rank_{rank}.json") for rank in (0, 1)}
    base = min(trace["baseTimeNanoseconds"] for trace in originals.values())
    assert merged["baseTimeNanoseconds"] == base
    for rank, original in originals.items():
        shift = (original["baseTimeNanoseconds"] - base) / 1000  # each file's base applied, nothing else
        host = original["ds_profutils"]["host"]
        assert merged["ds_profutils"]["timeline"]["ranks"][str(rank)]["shift_us"] == shift
        names = [e["args"]["name"] for e in merged["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"
                 and e["pid"] == rank]
        assert names == [f"rank {rank} ({host})"]
        steps = lambda events, pid=None: sorted(e["ts"] for e in events if e["name"].startswith("ProfilerStep#")  # noqa: E731
                                                and (pid is None or e["pid"] == pid))
        assert steps(merged["traceEvents"], rank) == [ts + shift for ts in steps(original["traceEvents"])]


def test_another_hosts_clock_offset_is_undone_on_a_collectives_end(traces, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    for rank in (0, 1):
        shutil.copy(traces / f"trace_rank_{rank}.json", run)
    copy = load(traces / "trace_rank_1.json")
    copy["ds_profutils"].update(host="other-host", rank=2)
    copy["baseTimeNanoseconds"] += OFFSET_NS  # same events, a clock 5 s ahead
    (run / "trace_rank_2.json").write_text(json.dumps(copy))

    assert main(["timeline", str(run), "-o", str(tmp_path / "timeline.json")]) == 0
    out = capsys.readouterr().out
    assert "hosts aligned on the end of gloo:" in out and "other-host: shifted -" in out
    merged = load(tmp_path / "timeline.json")
    events = merged["traceEvents"]
    aligned = merged["ds_profutils"]["timeline"]["hosts_aligned_on"]
    assert aligned["host_offset_us"]["other-host"] == pytest.approx(-OFFSET_NS / 1000, abs=50_000)
    key = (aligned["name"], aligned["occurrence"])
    ends = {rank: gloo_ends(events, rank) for rank in (0, 1, 2)}
    assert ends[2][key] == pytest.approx(ends[0][key], abs=1e-3)  # the chosen collective ends together
    # Rank 2 is rank 1 shifted by the same amount everywhere: the 5 s are gone, up to how far apart
    # ranks 0 and 1 finished that collective (same host, so their clocks were kept).
    gap = ends[2][key] - ends[1][key]
    assert gap == pytest.approx(ends[0][key] - ends[1][key], abs=1e-3) and abs(gap) < 50_000
    assert all(ends[2][k] - ends[1][k] == pytest.approx(gap, abs=1e-2) for k in ends[1])
    # Every other collective the hosts share also ends within a few ms on both clocks.
    assert all(abs(ends[2][k] - ends[0][k]) < 50_000 for k in ends[0])
    hosts = {rank: load(traces / f"trace_rank_{rank}.json")["ds_profutils"]["host"] for rank in (0, 1)}
    assert {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"} == {
        f"rank 0 ({hosts[0]})", f"rank 1 ({hosts[1]})", "rank 2 (other-host)"}


def test_the_output_is_a_chrome_trace_perfetto_opens(traces, tmp_path):
    assert main(["timeline", str(traces), "-o", str(tmp_path / "timeline.json")]) == 0
    merged = load(tmp_path / "timeline.json")
    events = merged["traceEvents"]
    assert isinstance(events, list) and events
    assert all(isinstance(e["pid"], int) and isinstance(e["tid"], int) and e["ph"] for e in events)
    assert all(isinstance(e["ts"], float) for e in events if e["ph"] != "M")
    processes = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert processes == {e["pid"] for e in events} == {0, 1}
    named = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in events if e["ph"] != "M"} <= named
    # Flow arrows (id) stay within their rank: the ranks' ids do not collide.
    flow_ids = {}
    for e in events:
        if e["ph"] in ("s", "f"):
            flow_ids.setdefault(e["id"], set()).add(e["pid"])
    assert all(len(pids) == 1 for pids in flow_ids.values())


def synthetic_trace(path, rank, host, base_ns, collective_end_us, events=(), truncated=False, world_size=2):
    trace_events = [{"ph": "M", "name": "process_name", "pid": 7, "tid": 0, "args": {"name": "python"}},
                    {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "pid": 7, "tid": 7,
                     "ts": collective_end_us - 10.0, "dur": 10.0},
                    {"ph": "s", "id": 1, "pid": 7, "tid": 7, "ts": 1.0, "name": "flow"}, *events]
    text = json.dumps({"baseTimeNanoseconds": base_ns, "ds_profutils": {"host": host, "rank": rank,
                                                                         "world_size": world_size},
                       "traceEvents": trace_events})
    path.write_text(text[:text.rindex("]") - 5] if truncated else text)


def test_alignment_without_a_launcher(tmp_path, capsys):
    """Two hosts, one of them 2 s ahead; a truncated trace keeps its events up to the cut."""
    synthetic_trace(tmp_path / "trace_rank_0.json", 0, "a", 10**18, collective_end_us=1000.0)
    synthetic_trace(tmp_path / "trace_rank_1.json", 1, "b", 10**18 + 2 * 10**9, collective_end_us=1000.0,
                    events=[{"ph": "X", "name": "work", "pid": 7, "tid": 7, "ts": 500.0, "dur": 1.0}] * 3,
                    truncated=True)
    scans = [scan_trace(tmp_path / f"trace_rank_{rank}.json", rank) for rank in (0, 1)]
    assert scans[1].error is not None and scans[1].base_ns == 10**18 + 2 * 10**9
    alignment = align(scans)
    assert alignment.shift_us == {0: 0.0, 1: 0.0}  # 2 s by the bases, -2 s by the collective
    assert alignment.collective == ("gloo:all_reduce", 0)
    assert main(["timeline", str(tmp_path), "-o", str(tmp_path / "out.json")]) == 0
    assert "rank 1: trace_rank_1.json ends early" in capsys.readouterr().err
    merged = load(tmp_path / "out.json")
    assert [e["id"] for e in merged["traceEvents"] if e["ph"] == "s"] == [1, 3]  # rank 1's ids shifted past rank 0's
    assert merged["ds_profutils"]["timeline"]["ranks"]["1"]["complete"] is False
    assert sum(e["name"] == "work" and e["pid"] == 1 for e in merged["traceEvents"]) == 2  # the third was cut


def test_an_earlier_runs_trace_in_a_reused_output_dir_is_left_out(tmp_path, capsys):
    for rank in (0, 1):
        synthetic_trace(tmp_path / f"trace_rank_{rank}.json", rank, "a", 10**18, collective_end_us=1000.0)
    # a day earlier by its clock base, though written (copied) last
    synthetic_trace(tmp_path / "trace_rank_3.json", 3, "a", 10**18 - 86400 * 10**9, collective_end_us=1000.0,
                    world_size=4)
    assert main(["timeline", str(tmp_path), "-o", str(tmp_path / "out.json")]) == 0
    assert "rank 3: trace_rank_3.json: left out: an earlier run's file (world size 4; this run's is 2)" in \
        capsys.readouterr().err
    assert set(load(tmp_path / "out.json")["ds_profutils"]["timeline"]["ranks"]) == {"0", "1"}


def test_no_trace_is_a_clear_message(tmp_path, capsys):
    assert main(["timeline", str(tmp_path), "-o", str(tmp_path / "out.json")]) == 1
    assert "no trace to merge" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


def test_an_output_that_is_one_of_the_traces_is_refused_and_the_trace_kept(traces, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(traces, run, ignore=shutil.ignore_patterns("rank_*"))
    kept = (run / "trace_rank_0.json").read_bytes()
    assert main(["timeline", str(run), "-o", str(run / "trace_rank_0.json")]) == 1
    assert "trace_rank_0.json is one of the traces it merges; name another file with -o" in capsys.readouterr().err
    assert (run / "trace_rank_0.json").read_bytes() == kept
