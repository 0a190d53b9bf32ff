"""``ds-profutils report``: records and traces read back into per-engine tables, and the bad cases."""
import json
import sys

import pytest

import ds_profutils.report.run_files as run_files_module
import ds_profutils.report.traces as trace_summary
from ds_profutils.cli import main
from ds_profutils.report import ReportError, build_report, render_text, report_json

from report_testing import record, records_file, write_records, write_trace


def test_tables_across_ranks(tmp_path):
    write_records(tmp_path, 0, [record(0, step, fetch_ms=1.0) for step in range(5)])
    write_records(tmp_path, 1, [record(1, step, fetch_ms=2.0, host="node-b") for step in range(5)])
    report = build_report(tmp_path)
    engine = report["engines"]["main"]
    assert engine["ranks"] == [0, 1] and engine["world_size"] == 2 and report["incomplete"] == []
    gather = engine["events"]["train"]["forward_all_gather"]
    assert (gather["count"], gather["numel"], gather["bytes"], gather["numel_unit"]) == (15, 8000, 32000, "full")
    assert gather["time_ms"] == {"min": 7.5, "median": 10.0, "max": 12.5, "max_rank": 1}
    assert engine["collectives"]["reduce_scatter_tensor"]["count"] == 5
    assert report["hosts"] == {"node-a": [0], "node-b": [1]}
    row = engine["ranks_summary"][1]
    assert (row["host"], row["steps"], row["step_ms_median"], row["fetch_wait_ms_median"]) == ("node-b", 5, 24.0, 2.0)
    assert (row["collective_wait_ms_median"], row["exposed_wait_ms_median"], row["busy_ms_median"]) == (2.0, 4.0, 20.0)
    assert row["exposed_wait_share"] == pytest.approx(4 / 24)
    text = render_text(report)
    assert "forward_all_gather" in text and "reduce_scatter_tensor" in text and "MISSING" not in text
    assert "hosts (2): node-a (rank 0); node-b (rank 1)" in text


def test_mean_split_of_a_step_adds_up_where_medians_do_not(tmp_path):
    """The plot stacks busy + fetch wait + other waits per rank: means add up to the mean step, medians need not."""
    parts = [(20.0, 1.0, 2.0), (2.0, 30.0, 40.0), (30.0, 2.0, 1.0)]  # (busy, fetch, collective) per step
    write_records(tmp_path, 0, [record(0, step, busy_ms=b, fetch_ms=f, collective_ms=c)
                                for step, (b, f, c) in enumerate(parts)])
    row = build_report(tmp_path)["engines"]["main"]["ranks_summary"][0]
    assert row["busy_ms_median"] + row["fetch_wait_ms_median"] + row["collective_wait_ms_median"] != \
        pytest.approx(row["step_ms_median"])
    assert (row["step_ms_mean"], row["fetch_wait_ms_mean"], row["collective_wait_ms_mean"]) == \
        pytest.approx((128 / 3, 33 / 3, 43 / 3))
    assert row["busy_ms_mean"] + row["fetch_wait_ms_mean"] + row["collective_wait_ms_mean"] == \
        pytest.approx(row["step_ms_mean"])


def test_gradient_accumulation_records_add_up_to_their_global_step(tmp_path):
    """Two micro steps per optimizer step: two records with one global_step make one step of the view."""
    write_records(tmp_path, 0, [record(0, step // 2, micro_step=step, fetch_ms=1.0) for step in range(6)])
    write_records(tmp_path, 1, [record(1, step // 2, micro_step=step, fetch_ms=3.0) for step in range(6)])
    report = build_report(tmp_path)
    view = report["engines"]["main"]["steps"]
    assert view.global_steps == [0, 1, 2]
    assert [view.step_ms.get(0, i) for i in range(3)] == [46.0, 46.0, 46.0]
    assert [view.fetch_wait_ms.get(1, i) for i in range(3)] == [6.0, 6.0, 6.0]
    assert [view.busy_ms.get(1, i) for i in range(3)] == [40.0, 40.0, 40.0]
    assert report["engines"]["main"]["ranks_summary"][0]["records"] == {"train": 6}


def test_joined_step_view_has_the_traces_step_time_where_the_trace_numbers_steps_globally(tmp_path):
    write_records(tmp_path, 0, [record(0, step) for step in range(4)])
    write_records(tmp_path, 1, [record(1, step) for step in range(4)])
    write_trace(tmp_path / "trace_rank_0.json", {2: 21.5, 3: 22.5}, rank=0)  # profiled steps 2 and 3 only
    write_trace(tmp_path / "trace_rank_1.json", {2: 30.0}, rank=1, step_numbering="call")
    report = build_report(tmp_path)
    view = report["engines"]["main"]["steps"]
    assert [view.trace_step_ms.get(0, i) for i in range(4)] == [None, None, 21.5, 22.5]
    assert [view.trace_step_ms.get(1, i) for i in range(4)] == [None] * 4  # counted per call: not joined
    assert report["trace_steps_joined_to"] == "main"
    text = render_text(report)
    step_two_rank_zero = next(line for line in text.splitlines() if line.split()[:2] == ["2", "0"])
    assert step_two_rank_zero.split()[2:8] == ["23.000", "1.000", "2.000", "3.000", "20.000", "21.500"]


def test_engines_are_reported_apart(tmp_path):
    for rank in (0, 1):
        write_records(tmp_path, rank, [record(rank, step) for step in range(3)])
        write_records(tmp_path, rank, [record(rank, step, engine="critic", fetch_ms=5.0) for step in range(2)],
                      engine="critic")
    report = build_report(tmp_path)
    assert list(report["engines"]) == ["main", "critic"]
    assert report["engines"]["critic"]["steps"].global_steps == [0, 1]
    assert report["engines"]["critic"]["ranks_summary"][0]["fetch_wait_ms_median"] == 5.0
    assert report["engines"]["main"]["ranks_summary"][0]["fetch_wait_ms_median"] == 1.0
    text = render_text(report)
    assert text.index("== engine main:") < text.index("== engine critic:")


def test_missing_and_incomplete_files_are_named_by_rank(tmp_path):
    write_records(tmp_path, 0, [record(0, step, world_size=4) for step in range(3)],
                  tail='{"schema": 2, "engine": "main", "global_step": 3, "events": {"forw')
    write_records(tmp_path, 2, [record(2, 0, world_size=4)])
    records_file(tmp_path, 3).write_text("")  # attach ran, no step finished
    write_trace(tmp_path / "trace_rank_0.json", {0: 1.0}, rank=0, world_size=4, profiled_ranks=[0, 1])
    (tmp_path / "trace_rank_1.json").write_text('{"traceEvents": [{"ph": "X", "name": "a", "dur": 1},')
    report = build_report(tmp_path)
    found = {(entry["kind"], entry["rank"]): entry["reason"] for entry in report["incomplete"]}
    assert found == {
        ("records", 0): "ends in a torn line (the job stopped mid-write?); the complete records before it are read",
        ("records", 1): "no file",
        ("records", 2): "ends at step 0; the other ranks' go on to step 2",
        ("records", 3): "no complete record",
        ("trace", 1): "incomplete: the trace ends inside \"traceEvents\" (truncated?); its 1 events up to the cut are read",
    }
    assert report["engines"]["main"]["ranks_summary"][0]["steps"] == 3  # the records before the torn line count
    text = render_text(report)
    assert "MISSING OR INCOMPLETE:" in text
    assert "  records of engine main, rank 1: no file" in text
    assert "  records of engine main, rank 0 (zero_fetch_rank_0.jsonl): ends in a torn line" in text
    assert "  trace, rank 1 (trace_rank_1.json): incomplete: the trace ends" in text
    assert report["traces"][1]["events"] == 1


def test_files_an_earlier_run_left_in_a_reused_output_dir_are_left_out_and_named(tmp_path):
    """An earlier 4-rank run in the same output_dir; this run has 2 ranks, so ranks 2 and 3's files stay."""
    import os

    for rank in (2, 3):  # a day earlier by the times inside (copies change mtimes; these are kept newest)
        write_records(tmp_path, rank, [record(rank, step, world_size=4, collective_ms=0.0 if rank == 3 else 40.0,
                                              time=1_789_900_000.0 + step) for step in range(5)])
    write_trace(tmp_path / "trace_rank_3.json", {0: 9.0}, rank=3, world_size=4)  # no base time: its mtime
    os.utime(tmp_path / "trace_rank_3.json", (1_700_000_000, 1_700_000_000))
    for rank in (0, 1):
        write_records(tmp_path, rank, [record(rank, step) for step in range(5)])
    write_trace(tmp_path / "trace_rank_0.json", {0: 20.0}, rank=0)
    for rank in (2, 3):
        os.utime(records_file(tmp_path, rank), None)  # the earlier run's records copied last
    report = build_report(tmp_path)
    engine = report["engines"]["main"]
    assert engine["world_size"] == 2 and engine["ranks"] == [0, 1] and engine["straggler_ranks"] == []
    assert set(report["traces"]) == {0}
    left_out = "left out: an earlier run's file (world size 4; this run's is 2)"
    assert [(e["kind"], e["rank"], e["reason"]) for e in report["incomplete"]] == [
        ("records", 2, left_out), ("records", 3, left_out), ("trace", 1, "no file"), ("trace", 3, left_out)]
    text = render_text(report)
    assert "records of engine main, rank 3 (zero_fetch_rank_3.jsonl): " + left_out in text


def test_a_rank_whose_files_stop_before_the_others_is_named(tmp_path):
    """Rank 1 killed first (the launcher walks the ranks one by one), or its last cycle's write given up."""
    write_records(tmp_path, 0, [record(0, step) for step in range(10)])
    write_records(tmp_path, 1, [record(1, step) for step in range(3)])
    write_trace(tmp_path / "trace_rank_0.json", {3: 10.0, 4: 10.0, 6: 10.0, 7: 10.0}, rank=0)
    write_trace(tmp_path / "trace_rank_1.json", {3: 10.0, 4: 10.0}, rank=1)
    report = build_report(tmp_path)
    assert [(e["kind"], e["rank"], e["file"], e["reason"]) for e in report["incomplete"]] == [
        ("records", 1, "zero_fetch_rank_1.jsonl", "ends at step 2; the other ranks' go on to step 9"),
        ("trace", 1, "trace_rank_1.json", "ends at step 4; the other ranks' go on to step 7")]
    assert "records of engine main, rank 1 (zero_fetch_rank_1.jsonl): ends at step 2" in render_text(report)


def test_an_expected_trace_that_is_absent_is_missing(tmp_path):
    write_trace(tmp_path / "trace_rank_0.json", {0: 1.0}, rank=0, world_size=3, profiled_ranks=None)
    assert [(e["kind"], e["rank"], e["reason"]) for e in build_report(tmp_path)["incomplete"]] == [
        ("trace", 1, "no file"), ("trace", 2, "no file")]


def test_bad_lines_are_counted_and_skipped(tmp_path):
    bad_value = record(1, 1)
    bad_value["events"]["forward_all_gather"]["time_ms"] = "slow"
    write_records(tmp_path, 0, [record(0, 0), record(0, 1)])
    write_records(tmp_path, 1, [record(1, 0)], tail="".join(f"{line}\n" for line in (
        "not json", json.dumps({"schema": 2, "global_step": 9}), json.dumps(bad_value))))
    report = build_report(tmp_path)
    assert report["problems"] == [{"engine": "main", "rank": 1, "file": "zero_fetch_rank_1.jsonl", "count": 3,
                                   "first": ["line 2: not JSON, skipped", "line 3: not a fetch record, skipped",
                                             "line 4: not a fetch record, skipped"]}]
    # The bad record changed nothing: one step, and its events counted once.
    engine = report["engines"]["main"]
    assert engine["ranks_summary"][1]["steps"] == 1
    assert engine["events"]["train"]["forward_all_gather"]["per_rank"][1]["count"] == 3


def test_ranks_left_out_by_the_runs_ranks_setting_are_not_missing(tmp_path):
    write_records(tmp_path, 0, [record(0, step, world_size=4, recording_ranks=[0, 2]) for step in range(2)])
    assert [(e["rank"], e["reason"]) for e in build_report(tmp_path)["incomplete"]] == [(2, "no file")]
    write_records(tmp_path, 2, [record(2, step, world_size=4, recording_ranks=[0, 2]) for step in range(2)])
    assert build_report(tmp_path)["incomplete"] == []


def test_eval_records_get_their_own_table_and_stay_out_of_steps(tmp_path):
    write_records(tmp_path, 0, [record(0, 0), record(0, 1, mode="eval", fetch_ms=5.0), record(0, 1)])
    engine = build_report(tmp_path)["engines"]["main"]
    assert list(engine["events"]) == ["train", "eval"]
    assert engine["events"]["eval"]["forward_fetch_wait"]["time_ms"]["max"] == 2.5
    assert engine["steps"].global_steps == [0, 1]
    assert engine["records"] == {"train": 2, "eval": 1}


def test_records_of_an_older_ds_profutils_are_read_best_effort(tmp_path):
    old = record(0, 0)
    for key in ("schema", "engine", "micro_step", "fetch_wait_ms", "collective_wait_ms", "exposed_wait_ms",
                "collectives", "clock"):
        del old[key]
    old["step"] = 0
    write_records(tmp_path, 0, [old])
    report = build_report(tmp_path)
    engine = report["engines"]["main"]
    assert engine["old_format_records"] == 1 and engine["ranks_summary"][0]["fetch_wait_ms_median"] == 1.0
    assert "1 records of an older ds_profutils" in render_text(report)


def test_clocks_and_the_comms_logger_are_reported(tmp_path):
    write_records(tmp_path, 0, [record(0, 0, clock="device"), record(0, 1, clock="host-fallback", comms_logger=True)])
    report = build_report(tmp_path)
    assert report["engines"]["main"]["clocks"] == {"device": 1, "host-fallback": 1}
    text = " ".join(render_text(report).split())  # prose is wrapped
    assert "clock: device (1 record), host-fallback (1 record)" in text
    assert "WARNING: DeepSpeed's comms logger was on in 1 records" in text


def test_step_table_shows_the_widest_spread_steps_when_long(tmp_path):
    write_records(tmp_path, 0, [record(0, step, collective_ms=9.0 if step in (7, 30) else 2.0) for step in range(40)])
    write_records(tmp_path, 1, [record(1, step) for step in range(40)])
    text = render_text(build_report(tmp_path), max_steps=2)
    assert "(2 of 40 steps: the largest spread of exposed wait)" in text
    step_rows = [line for line in text.split("Steps (")[1].split("\n\n")[0].splitlines() if line[:1].isdigit()]
    assert sorted({int(line.split()[0]) for line in step_rows}) == [7, 30]


def test_empty_or_absent_directory_is_a_clear_message(tmp_path, capsys):
    with pytest.raises(ReportError, match="no step records"):
        build_report(tmp_path)
    assert main(["report", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "\"step_metrics\" (or, on ZeRO-3, \"partitioned_param_profiler\")" in captured.err and captured.out == ""
    assert main(["report", str(tmp_path / "nope")]) == 1
    assert "no such directory" in capsys.readouterr().err
    # The parent of runs' output_dirs: the runs are named.
    for run in ("zero3_run", "traces_run", "empty"):
        (tmp_path / run).mkdir()
    write_records(tmp_path / "zero3_run", 0, [record(0, 0)])
    write_trace(tmp_path / "traces_run" / "trace_rank_0.json", {0: 1.0}, rank=0)
    with pytest.raises(ReportError, match="its subdirectories traces_run, zero3_run hold runs: name one of them"):
        build_report(tmp_path)


def test_ranks_limit_decides_between_a_row_per_rank_and_one_across_ranks(tmp_path):
    for rank in range(3):
        write_records(tmp_path, rank, [record(rank, step, world_size=3) for step in range(2)])
    report = build_report(tmp_path)
    assert "Steps (per global step and rank, ms)" in render_text(report, max_ranks=3)
    assert "Steps (across ranks, ms)" in render_text(report, max_ranks=2)


def test_prose_is_wrapped_but_never_between_a_number_and_its_unit():
    from ds_profutils.report.tables import wrap as _wrap

    words = "their waiting beyond its own in those steps:" + " word" * 12
    assert len(words + " 96.6") <= 110 < len(words + " 96.6 ms")  # plain wrapping would split "96.6 ms"
    assert _wrap(words + " 96.6 ms, and 1.5 ms more") == [words, "  96.6 ms, and 1.5 ms more"]


def test_json_output_is_the_report_alone_and_complete(tmp_path, capsys):
    write_records(tmp_path, 0, [record(0, step) for step in range(3)])
    write_records(tmp_path, 1, [record(1, step) for step in range(2)])
    assert main(["report", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    engine = data["engines"]["main"]
    assert engine["events"]["train"]["forward_fetch_wait"]["per_rank"]["0"]["count"] == 12
    steps = engine["steps"]
    assert steps["ranks"] == [0, 1] and steps["global_steps"] == [0, 1, 2]
    assert steps["busy_ms"] == [[20.0, 20.0, 20.0], [20.0, 20.0, None]]  # rank 1 has no step 2
    assert set(steps) >= {"step_ms", "fetch_wait_ms", "collective_wait_ms", "exposed_wait_ms", "trace_step_ms",
                          "straggler", "spread_ms", "threshold_ms"}
    assert json.loads(report_json(build_report(tmp_path))) == data


def write_plain_trace(path, steps=3, header_first=True):
    write_trace(path, {step + 5: float(step + 1) for step in range(steps)}, rank=1, header_first=header_first)


@pytest.mark.parametrize("header_first", [True, False])
def test_trace_summary_streams_events_across_chunks(tmp_path, monkeypatch, header_first):
    monkeypatch.setattr(trace_summary, "_CHUNK", 64)  # every event straddles a chunk boundary
    write_plain_trace(tmp_path / "trace_rank_1.json", header_first=header_first)
    summary = trace_summary.summarize_trace(tmp_path / "trace_rank_1.json")
    assert (summary["rank"], summary["host"], summary["step_numbering"], summary["events"]) == (1, "node-0", "global", 15)
    assert summary["steps"] == [{"step": 5, "ms": 1.0}, {"step": 6, "ms": 2.0}, {"step": 7, "ms": 3.0}]
    assert summary["step_ms"] == {"median": 2.0, "max": 3.0}
    assert summary["top_ops"][0] == {"name": "aten::mm", "cat": "cpu_op", "count": 3, "total_ms": 0.75}


def test_a_pretty_printed_trace_reads_as_the_compact_one(tmp_path):
    """torch writes its per-cycle traces one key per line; ds_profutils' run trace one event per line."""
    write_plain_trace(tmp_path / "compact.json")
    (tmp_path / "pretty.json").write_text(json.dumps(json.loads((tmp_path / "compact.json").read_text()), indent=2))
    compact, pretty = (trace_summary.summarize_trace(tmp_path / name) for name in ("compact.json", "pretty.json"))
    assert {**pretty, "file": None} == {**compact, "file": None} and compact["events"] == 15


def test_ranges_of_one_step_number_add_up(tmp_path):
    """With gradient accumulation, step_profiler(engine) closes a range per micro step under one N."""
    path = tmp_path / "trace_rank_0.json"
    path.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#4", "ts": 0, "dur": 1000.0},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#4", "ts": 2000, "dur": 1500.0}]}))
    assert trace_summary.summarize_trace(path)["steps"] == [{"step": 4, "ms": 2.5}]


def test_traces_alone_are_enough_to_report(tmp_path):
    write_plain_trace(tmp_path / "trace_rank_0.json")
    report = build_report(tmp_path)
    assert report["engines"] == {}
    text = render_text(report)
    assert "Trace of rank 0" in text and "aten::mm" in text


def test_plot_needs_matplotlib_and_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    write_records(tmp_path, 0, [record(0, 0)])
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["report", str(tmp_path), "--plot", str(tmp_path / "fetch.png")]) == 1
    assert "pip install 'ds-profutils[plot]'" in capsys.readouterr().err


def test_large_runs_read_ranks_in_parallel_with_the_same_result(tmp_path, monkeypatch):
    for rank in range(3):
        write_records(tmp_path, rank, [record(rank, step, fetch_ms=1.0 + rank, world_size=3) for step in range(20)])
    sequential = report_json(build_report(tmp_path))
    monkeypatch.setattr(run_files_module, "_PARALLEL_BYTES", 0)
    monkeypatch.setattr(run_files_module.os, "cpu_count", lambda: 2)
    assert report_json(build_report(tmp_path)) == sequential
