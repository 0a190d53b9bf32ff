"""``ds-profutils report``: merged tables from synthetic per-rank records and traces, and the bad cases."""
import json
import sys

import pytest

import ds_profutils.report.records as records
import ds_profutils.report.traces as trace_summary
from ds_profutils.cli import main
from ds_profutils.report import ReportError, build_report, render_text


def event(count, numel, time_ms, unit="shard", element_size=4):
    return {
        "count": count,
        "numel": numel,
        "numel_unit": unit,
        "bytes": numel * element_size,
        "time_ms": time_ms,
        "min_ms": time_ms / count,
        "max_ms": time_ms / count,
        "p50_ms": time_ms / count,
        "p95_ms": time_ms / count,
    }


def record(rank, step, wait_ms, *, mode="train", world_size=2, step_ms=10.0, host="node-a"):
    return {
        "step": step,
        "global_step": step,
        "mode": mode,
        "time": 0.0,
        "rank": rank,
        "world_size": world_size,
        "host": host,
        "dtype": "float32",
        "step_time_ms": step_ms,
        "events": {
            "forward_fetch_wait": event(4, 800, wait_ms / 2),
            "backward_fetch_wait": event(4, 800, wait_ms / 2),
            "forward_all_gather": event(3, 1600, 1.5 + rank, unit="full"),
        },
    }


def write_rank(directory, rank, records, tail=""):
    lines = "".join(json.dumps(r) + "\n" for r in records)
    (directory / f"zero_fetch_rank_{rank}.jsonl").write_text(lines + tail)


def test_tables_across_ranks(tmp_path):
    write_rank(tmp_path, 0, [record(0, step, 1.0) for step in range(5)])
    write_rank(tmp_path, 1, [record(1, step, 2.0, host="node-b") for step in range(5)])
    report = build_report(tmp_path)
    assert report["ranks"] == [0, 1] and report["missing_ranks"] == [] and report["world_size"] == 2
    gather = report["events"]["train"]["forward_all_gather"]
    assert (gather["count"], gather["numel"], gather["bytes"], gather["numel_unit"]) == (15, 8000, 32000, "full")
    assert gather["time_ms"] == {"min": 7.5, "median": 10.0, "max": 12.5, "slowest_rank": 1}
    assert report["ranks_summary"][1]["hosts"] == ["node-b"]
    assert report["ranks_summary"][0]["fetch_wait_share"] == pytest.approx(0.1)
    assert [row["step"] for row in report["steps"]] == list(range(5))
    assert report["steps"][0]["fetch_wait_spread"] == {"min": 1.0, "median": 1.5, "max": 2.0, "slowest_rank": 1}
    assert report["steps"][0]["fetch_wait_share_max"] == pytest.approx(0.2)
    assert not any(row["straggler"] for row in report["ranks_summary"].values())
    text = render_text(report)
    assert "forward_all_gather" in text and "STRAGGLER" not in text and "MISSING" not in text


def test_straggler_is_a_rank_whose_median_wait_is_over_1_5x_the_median_of_all(tmp_path):
    for rank, wait in ((0, 1.0), (1, 1.1), (2, 1.7)):
        write_rank(tmp_path, rank, [record(rank, step, wait, world_size=3) for step in range(3)])
    report = build_report(tmp_path)
    assert [rank for rank, row in report["ranks_summary"].items() if row["straggler"]] == [2]
    assert "STRAGGLER" in render_text(report)


def test_truncated_last_line_and_bad_lines_are_reported_and_skipped(tmp_path):
    records = [record(0, step, 1.0) for step in range(3)]
    write_rank(tmp_path, 0, records, tail='{"step": 3, "global_step": 3, "events": {"forw')
    bad_value = record(1, 1, 1.0)
    bad_value["events"]["forward_all_gather"]["time_ms"] = "slow"
    write_rank(tmp_path, 1, records[:1], tail="".join(f"{line}\n" for line in ("not json", json.dumps({"step": 9}),
                                                                              json.dumps(bad_value))))
    report = build_report(tmp_path)
    assert report["ranks_summary"][0]["records"] == {"train": 3}
    assert report["problems"][0]["first"] == ["line 4: incomplete last line (job stopped mid-write?), skipped"]
    assert report["problems"][1]["first"] == [
        "line 2: not JSON, skipped", "line 3: not a fetch record, skipped", "line 4: not a fetch record, skipped"
    ]
    # The bad record changed nothing: one step, and its events counted once.
    assert [row["step"] for row in report["steps"]] == [0, 1, 2]
    assert report["steps"][0]["fetch_wait_ms"] == {0: 1.0, 1: 1.0}
    assert report["events"]["train"]["forward_all_gather"]["per_rank"][1]["count"] == 3
    assert "incomplete last line" in render_text(report)


def test_missing_ranks_from_the_world_size_in_the_records(tmp_path):
    write_rank(tmp_path, 0, [record(0, 0, 1.0, world_size=4)])
    write_rank(tmp_path, 2, [record(2, 0, 1.0, world_size=4)])
    (tmp_path / "zero_fetch_rank_3.jsonl").write_text("")  # attach ran, no step finished
    report = build_report(tmp_path)
    assert report["ranks"] == [0, 2]
    assert report["missing_ranks"] == [1, 3]
    assert "MISSING ranks (no file or no complete record): 1, 3" in render_text(report)


def test_ranks_left_out_by_the_runs_ranks_setting_are_not_missing(tmp_path):
    records = [dict(record(0, step, 1.0, world_size=4), recording_ranks=[0, 2]) for step in range(2)]
    write_rank(tmp_path, 0, records)
    report = build_report(tmp_path)
    assert report["missing_ranks"] == [2] and "MISSING ranks (no file or no complete record): 2" in render_text(report)
    write_rank(tmp_path, 2, [dict(record(2, 0, 1.0, world_size=4), recording_ranks=[0, 2])])
    assert build_report(tmp_path)["missing_ranks"] == []


def test_two_forwards_before_one_step_make_one_step(tmp_path):
    """A model called twice per step writes two records with the same step; the report adds them up."""
    write_rank(tmp_path, 0, [record(0, 0, 1.0), record(0, 0, 9.0, step_ms=5.0), record(0, 1, 2.0)])
    write_rank(tmp_path, 1, [record(1, 0, 3.0), record(1, 1, 2.0)])
    report = build_report(tmp_path)
    assert [row["step"] for row in report["steps"]] == [0, 1]
    assert report["steps"][0]["fetch_wait_ms"] == {0: 10.0, 1: 3.0}
    assert report["steps"][0]["step_ms"] == {0: 15.0, 1: 10.0}
    summary = report["ranks_summary"][0]
    assert summary["steps"] == 2 and summary["records"] == {"train": 3}
    assert summary["fetch_wait_ms_median"] == 6.0  # median of the steps' 10.0 and 2.0


def test_empty_or_absent_directory_is_a_clear_message(tmp_path, capsys):
    with pytest.raises(ReportError, match="no ZeRO-3 fetch records"):
        build_report(tmp_path)
    assert main(["report", str(tmp_path)]) == 1
    assert "partitioned_param_profiler" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "nope")]) == 1
    assert "no such directory" in capsys.readouterr().err


def test_eval_records_get_their_own_table_and_stay_out_of_steps(tmp_path):
    write_rank(tmp_path, 0, [record(0, 0, 1.0), record(0, 1, 5.0, mode="eval"), record(0, 1, 1.0)])
    report = build_report(tmp_path)
    assert list(report["events"]) == ["train", "eval"]
    assert report["events"]["eval"]["forward_fetch_wait"]["count"] == 4
    assert [row["step"] for row in report["steps"]] == [0, 1]
    assert report["ranks_summary"][0]["records"] == {"train": 2, "eval": 1}


def test_step_table_shows_the_slowest_steps_when_long(tmp_path):
    write_rank(tmp_path, 0, [record(0, step, 9.0 if step in (7, 30) else 1.0) for step in range(40)])
    text = render_text(build_report(tmp_path), max_steps=2)
    assert "(2 of 40 steps: the largest fetch-wait)" in text
    step_rows = text.split("Steps (")[1].splitlines()[2:]
    assert [int(line.split()[0]) for line in step_rows] == [7, 30]


def test_json_output(tmp_path, capsys):
    write_rank(tmp_path, 0, [record(0, 0, 1.0)])
    assert main(["report", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["events"]["train"]["forward_fetch_wait"]["per_rank"]["0"]["count"] == 4
    assert data["missing_ranks"] == [1]


def write_trace(path, steps=3, header_first=True):
    events = []
    for step in range(steps):
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step + 5}", "ts": step * 100,
                       "dur": 1000.0 * (step + 1)})
        # On a GPU torch draws the step on the device timeline too; it is not another step.
        events.append({"ph": "X", "cat": "gpu_user_annotation", "name": f"ProfilerStep#{step + 5}",
                       "ts": step * 100 + 10, "dur": 7.0})
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": step * 100, "dur": 250.0})
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": step * 100, "dur": 50.0})
        events.append({"ph": "i", "name": "instant", "ts": step})
    info = '"distributedInfo": {"rank": 1, "world_size": 2}'
    body = '"traceEvents": [\n' + ",\n".join(json.dumps(e) for e in events) + "\n]"
    path.write_text("{" + (f"{info}, {body}" if header_first else f"{body}, {info}") + "}\n")


@pytest.mark.parametrize("header_first", [True, False])
def test_trace_summary_streams_events_across_chunks(tmp_path, monkeypatch, header_first):
    monkeypatch.setattr(trace_summary, "_CHUNK", 64)  # every event straddles a chunk boundary
    write_trace(tmp_path / "trace_rank_1.json", header_first=header_first)
    summary = trace_summary.summarize_trace(tmp_path / "trace_rank_1.json")
    assert summary["rank"] == 1 and summary["events"] == 15
    assert summary["steps"] == [{"step": 5, "ms": 1.0}, {"step": 6, "ms": 2.0}, {"step": 7, "ms": 3.0}]
    assert summary["step_ms"] == {"median": 2.0, "max": 3.0}
    assert summary["top_ops"][0] == {"name": "aten::mm", "cat": "cpu_op", "count": 3, "total_ms": 0.75}


def test_report_summarises_traces_and_reports_a_truncated_one(tmp_path):
    write_rank(tmp_path, 0, [record(0, 0, 1.0)])
    write_trace(tmp_path / "trace_rank_0.json")
    (tmp_path / "trace_rank_1.json").write_text('{"traceEvents": [{"ph": "X", "name": "a", "dur": 1},')
    report = build_report(tmp_path)
    assert report["traces"][0]["step_ms"]["max"] == 3.0
    assert "truncated" in report["problems"][1]["first"][0]
    text = render_text(report)
    assert "Trace of rank 0" in text and "aten::mm" in text


def test_traces_alone_are_enough_to_report(tmp_path):
    write_trace(tmp_path / "trace_rank_0.json")
    report = build_report(tmp_path)
    assert report["world_size"] is None and report["steps"] == []
    assert "Trace of rank 0" in render_text(report)


def test_plot_needs_matplotlib_and_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    write_rank(tmp_path, 0, [record(0, 0, 1.0)])
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["report", str(tmp_path), "--plot", str(tmp_path / "fetch.png")]) == 1
    assert "pip install 'ds-profutils[plot]'" in capsys.readouterr().err


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    write_rank(tmp_path, 0, [record(0, step, 1.0) for step in range(4)])
    write_rank(tmp_path, 1, [record(1, step, 2.0) for step in range(4)])
    assert main(["report", str(tmp_path), "--plot", str(tmp_path / "fetch.png")]) == 0
    assert (tmp_path / "fetch.png").read_bytes()[:4] == b"\x89PNG"


def test_large_runs_read_ranks_in_parallel_with_the_same_result(tmp_path, monkeypatch):
    for rank in range(3):
        write_rank(tmp_path, rank, [record(rank, step, 1.0 + rank, world_size=3) for step in range(20)])
    sequential = build_report(tmp_path)
    monkeypatch.setattr(records, "_PARALLEL_BYTES", 0)
    monkeypatch.setattr(records.os, "cpu_count", lambda: 2)
    assert build_report(tmp_path) == sequential
