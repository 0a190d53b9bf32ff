"""The report summarises what it cannot read: files of one kind (empty files of ranks beyond the world, say) are one
line with a count and the first few named, and a directory with nothing readable says what it found."""
import pytest

from ds_profutils.cli import main
from ds_profutils.report import ReportError, build_report
from ds_profutils.report.text import render_text

from report_testing import record, write_records
from test_diff import write_run


def test_two_ranks_beside_2000_empty_files_of_ranks_beyond_the_world_print_at_most_80_lines(tmp_path, capsys):
    write_run(tmp_path, ranks=2, steps=10)
    for rank in range(2, 2002):
        (tmp_path / f"zero_fetch_rank_{rank}.jsonl").touch()
    report = build_report(tmp_path)
    engine = report["engines"]["main"]
    assert engine["world_size"] == 2 and engine["ranks"] == [0, 1]
    assert len(report["incomplete"]) == 2000
    assert main(["report", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert len(text.splitlines()) <= 80, len(text.splitlines())
    flat = " ".join(text.split())
    assert ("records of engine main: 2,000 files of ranks 2-2001 (empty, rank beyond world_size 2: ignored; "
            "zero_fetch_rank_2.jsonl, zero_fetch_rank_3.jsonl, zero_fetch_rank_4.jsonl, ...)") in flat


def test_a_few_incomplete_files_are_still_named_one_per_line(tmp_path):
    write_run(tmp_path, ranks=4, steps=10)
    (tmp_path / "zero_fetch_rank_3.jsonl").write_text("")
    text = render_text(build_report(tmp_path))
    assert "  records of engine main, rank 3 (zero_fetch_rank_3.jsonl): no complete record" in text


def test_nothing_readable_names_what_it_found(tmp_path):
    for rank in range(5):
        (tmp_path / f"zero_fetch_rank_{rank}.jsonl").touch()
    with pytest.raises(ReportError) as raised:
        build_report(tmp_path)
    message = str(raised.value)
    assert message.endswith("nothing readable (5 record files without a complete record (zero_fetch_rank_0.jsonl, "
                            "zero_fetch_rank_1.jsonl, zero_fetch_rank_2.jsonl, ... 2 more))")


def test_a_step_metrics_job_gets_no_fetch_wait_columns(tmp_path):
    """ZeRO-0/1/2 with ``step_metrics``: no fetch events, so no column of zeros about fetches; a ZeRO-3 job's
    records (fetch events) keep them."""
    stage2, stage3 = tmp_path / "stage2", tmp_path / "stage3"
    for directory, events in ((stage2, {}), (stage3, None)):
        directory.mkdir()
        for rank in (0, 1):
            rows = []
            for step in range(5):
                row = record(rank, step, fetch_ms=0.0)
                if events is not None:
                    row["events"] = events
                rows.append(row)
            write_records(directory, rank, rows)
    for directory, fetched in ((stage2, False), (stage3, True)):
        text = render_text(build_report(directory))
        headers = [line for line in text.splitlines() if line.startswith(("rank    host", "step  rank"))]
        assert len(headers) == 2 and all(("fetch wait" in line) == fetched for line in headers), headers
        assert ("exposed wait = fetch wait + blocking collectives" in " ".join(text.split())) == fetched


def test_a_step_metrics_job_is_not_spoken_of_as_zero3(tmp_path):
    """No live-parameter figures (ZeRO-0/1/2): the memory section does not speak of ZeRO-3's live parameters."""
    for rank in (0, 1):
        rows = [dict(record(rank, step, schema=3, collective_ms=2.0,
                            memory={"source": "rss", "peak_allocated_bytes": 2**28, "peak_reserved_bytes": 2**28,
                                    "phases": {"forward": 2**27, "backward": 2**28, "step": 2**27}}), events={})
                for step in range(5)]
        write_records(tmp_path, rank, rows)
    text = " ".join(render_text(build_report(tmp_path)).split())
    assert "Memory (train steps" in text and "ZeRO-3" not in text
