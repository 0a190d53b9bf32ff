"""Memory in the report (schema 3 records): per rank the step peaks, ZeRO-3's live parameters against their
limit, trace-cache invalidations and prefetch hits; the rank with the highest peak, the imbalance, and the
steps where a rank's peak jumped."""
import json

import pytest

import ds_profutils.report.memory as memory_module
from ds_profutils.cli import main
from ds_profutils.report import build_report, render_text

from report_testing import memory_run, record, schema3, write_records

MIB = 2**20
BASE = 1024 * MIB


def one_line(text):
    return " ".join(text.split())  # prose is wrapped


def extra_tensor_from_step_3(rank, step):
    """The issue's job: rank 1 keeps an extra 256 MB tensor alive from global step 3 on."""
    return BASE + rank * 4 * MIB + (256 * MIB if rank == 1 and step >= 3 else 0) + (step % 2) * MIB


@pytest.mark.parametrize("steps", [6, 40])
def test_a_tensor_kept_alive_from_step_3_is_the_highest_peak_an_imbalance_and_one_jump(tmp_path, steps):
    """However long the run: over the whole run's median, a rise lasting most of it would be no jump at all."""
    memory_run(tmp_path, 2, steps, extra_tensor_from_step_3)
    report = build_report(tmp_path)
    memory = report["engines"]["main"]["memory"]
    assert memory["highest_rank"] == 1 and memory["lowest_rank"] == 0
    assert memory["imbalance"] == pytest.approx((BASE + 4 * MIB + 256 * MIB + MIB) / (BASE + MIB))
    assert memory["jump_count"] == 1
    assert memory["jumps"] == [{"rank": 1, "global_step": 3, "peak_allocated_bytes": BASE + 4 * MIB + 256 * MIB + MIB,
                                "baseline_bytes": BASE + 4 * MIB, "during_profiler": False}]
    row = memory["ranks"][1]
    assert (row["peak_allocated_bytes"], row["peak_step"], row["peak_phase"]) == (BASE + 261 * MIB, 3, "backward")
    assert row["peak_reserved_bytes"] == (BASE + 261 * MIB) * 5 // 4 and row["jumps"] == 1
    assert memory["ranks"][0]["jumps"] == 0
    text = one_line(render_text(report))
    assert ("Highest peak: rank 1 (node-0), 1.25 GiB at step 3 (backward); imbalance 1.25x (highest over lowest "
            "peak: rank 0, 1.00 GiB).") in text
    assert ("JUMPS (a jump is a train step whose peak allocated bytes are more than 10% over the median of the "
            "rank's earlier steps, once it has 3 of them; once per rise): rank 1 at step 3: 1.25 GiB (1.00 GiB "
            "before).") in text


def test_the_memory_table_per_rank_with_live_parameters_against_their_limit(tmp_path):
    for rank in range(2):
        write_records(tmp_path, rank, [
            schema3(record(rank, step), peak_bytes=BASE + step * MIB + rank * 100 * MIB, live_params=3000 + 500 * rank,
                    max_live=10_000, invalidations=1 if step == 2 else 0, hits=6 + rank, waited=2 - rank)
            for step in range(5)])
    report = build_report(tmp_path)
    ranks = report["engines"]["main"]["memory"]["ranks"]
    assert ranks[0] == {
        "source": "allocator", "peak_allocated_bytes": BASE + 4 * MIB, "peak_step": 4, "peak_phase": "backward",
        "median_peak_allocated_bytes": BASE + 2 * MIB, "peak_reserved_bytes": (BASE + 4 * MIB) * 5 // 4,
        "median_peak_reserved_bytes": (BASE + 2 * MIB) * 5 // 4, "live_params_max": 3000, "max_live_parameters": 10_000,
        "live_params_share": 0.3, "trace_cache_invalidations": 1, "prefetch_hits": 30, "prefetch_waited": 10,
        "prefetch_hit_rate": 0.75, "jumps": 0, "disturbed_steps": 0, "disturbed_peak_allocated_bytes": None}
    assert (ranks[1]["live_params_share"], ranks[1]["prefetch_hit_rate"]) == (0.35, 35 / 40)
    text = render_text(report)
    table = text.split("\nMemory (")[1].split("\n")
    header = next(line for line in table if line.startswith("rank"))
    for column in ("host", "peak allocated", "at step", "phase", "median peak", "peak reserved", "median reserved", "live params max",
                   "limit", "of limit", "trace-cache invalidations", "prefetch hits", "jumps"):
        assert column in header
    row_zero = next(line for line in table if line.startswith("0 "))
    assert "1.00 GiB" in row_zero and "30.0%" in row_zero and "75.0%" in row_zero and "backward" in row_zero
    assert "No jumps (a jump is a train step" in one_line(text)
    assert "memory from the accelerator's allocator: 10 records" in one_line(text)


def test_gradient_accumulation_takes_the_largest_peak_of_a_step(tmp_path):
    rows = [schema3(record(0, micro // 2, micro_step=micro), peak_bytes=BASE + (micro % 2) * 8 * MIB,
                    live_params=1000 + micro) for micro in range(8)]
    write_records(tmp_path, 0, rows)
    engine = build_report(tmp_path)["engines"]["main"]
    view = engine["steps"]
    assert [view.peak_allocated_bytes.get(0, index) for index in range(4)] == [BASE + 8 * MIB] * 4
    assert engine["memory"]["ranks"][0]["live_params_max"] == 1007
    assert engine["memory"]["ranks"][0]["median_peak_allocated_bytes"] == BASE + 8 * MIB


def test_a_cpu_run_says_its_figures_are_the_process_rss(tmp_path):
    memory_run(tmp_path, 2, 4, lambda rank, step: BASE, source="rss")
    report = build_report(tmp_path)
    assert report["engines"]["main"]["memory"]["sources"] == {"rss": 8}
    assert report["engines"]["main"]["memory"]["ranks"][0]["source"] == "rss"
    assert ("memory from RSS, the process's resident set size (a CPU run: DeepSpeed's CPU accelerator reports it, "
            "sampled at phase boundaries; it counts everything the process holds, not only tensors): 8 records") in \
        one_line(render_text(report))


def test_records_without_memory_figures_say_so_in_one_line(tmp_path):
    write_records(tmp_path, 0, [record(0, step) for step in range(3)])
    report = build_report(tmp_path)
    assert report["engines"]["main"]["memory"] is None
    lines = [line for line in render_text(report).splitlines()[1:] if "memory" in line.lower()]
    assert lines == ["Memory: the records carry no memory figures (schema 2 or older, or memory figures were off)."]


def test_schema_3_without_memory_figures_still_shows_live_parameters_and_the_cache(tmp_path):
    """Memory figures switched off: no peaks, but ZeRO-3's counts are there."""
    write_records(tmp_path, 0, [schema3(record(0, step), live_params=2000, invalidations=2) for step in range(3)])
    report = build_report(tmp_path)
    memory = report["engines"]["main"]["memory"]
    assert memory["highest_rank"] is None and memory["ranks"][0]["peak_allocated_bytes"] is None
    assert (memory["ranks"][0]["live_params_max"], memory["ranks"][0]["trace_cache_invalidations"]) == (2000, 6)
    text = render_text(report)
    header = next(line for line in text.split("\nMemory (")[1].splitlines() if line.startswith("rank"))
    assert "live params max" in header and "peak allocated" not in header and "Highest peak" not in text


def test_jumps_are_judged_from_the_fourth_step_once_per_rise_and_skip_steps_without_figures(tmp_path):
    """Steps 0-2 make the baseline (the first steps allocate the optimizer's state: step 1 is no jump); a rise
    held over steps 5-7 is one jump; step 9 rises again after a fall; step 8 has no memory figures."""
    peaks = [BASE // 2, BASE, BASE, BASE, BASE, 2 * BASE, 2 * BASE, 2 * BASE, None, BASE, 2 * BASE, BASE * 21 // 20]
    write_records(tmp_path, 0, [schema3(record(0, step), peak_bytes=peak) for step, peak in enumerate(peaks)])
    memory = build_report(tmp_path)["engines"]["main"]["memory"]
    assert [(jump["global_step"], jump["baseline_bytes"]) for jump in memory["jumps"]] == [(5, BASE), (10, BASE)]
    assert memory["jump_count"] == 2 and memory["ranks"][0]["jumps"] == 2


def test_memory_json_has_the_issues_keys(tmp_path, capsys):
    memory_run(tmp_path, 2, 6, extra_tensor_from_step_3)
    assert main(["report", str(tmp_path), "--json"]) == 0
    engine = json.loads(capsys.readouterr().out)["engines"]["main"]
    memory = engine["memory"]
    assert memory["ranks"]["1"]["peak_allocated_bytes"] == BASE + 261 * MIB
    assert memory["ranks"]["1"]["live_params_max"] == 5000
    assert memory["highest_rank"] == 1 and memory["imbalance"] > 1
    assert memory["jumps"] == [{"rank": 1, "global_step": 3, "peak_allocated_bytes": BASE + 261 * MIB,
                                "baseline_bytes": BASE + 4 * MIB, "during_profiler": False}]
    assert memory["jump_rule"]["over_baseline_share"] == 0.1 and memory["jump_rule"]["baseline_steps"] == 3
    assert engine["steps"]["peak_allocated_bytes"][1][3] == BASE + 261 * MIB


def test_the_jump_list_keeps_the_largest_rises_and_counts_them_all(tmp_path, monkeypatch):
    """Peaks that swing by more than 10% step after step jump every other step: the list is bounded."""
    monkeypatch.setattr(memory_module, "JUMPS_KEPT", 3)
    memory_run(tmp_path, 2, 20, lambda rank, step: BASE + (step % 2) * (step + rank) * 64 * MIB)
    memory = build_report(tmp_path)["engines"]["main"]["memory"]
    assert memory["jump_count"] == 18 and len(memory["jumps"]) == 3  # steps 3, 5, ... 19 of either rank
    assert [(jump["rank"], jump["global_step"]) for jump in memory["jumps"]] == [(1, 17), (0, 19), (1, 19)]
    assert "; ... 15 more (--json)." in one_line(render_text(build_report(tmp_path)))


def test_with_many_ranks_the_table_shows_the_highest_peaks_and_the_lowest(tmp_path):
    memory_run(tmp_path, 12, 4, lambda rank, step: BASE + rank * MIB)
    text = render_text(build_report(tmp_path), max_ranks=4)
    table = text.split("\nMemory (")[1].split("\n\n")[0]
    assert "4 of 12 ranks shown: the highest peaks, then the lowest" in one_line(table)
    assert [line.split()[0] for line in table.splitlines() if line[:1].isdigit()] == ["11", "10", "9", "0"]


def test_the_plot_has_a_memory_panel_with_the_jumps(tmp_path):
    pytest.importorskip("matplotlib")
    from ds_profutils.report.plot import build_figure

    memory_run(tmp_path, 2, 6, extra_tensor_from_step_3)
    figure = build_figure(build_report(tmp_path))
    titles = [axes.get_title(loc="left") for axes in figure.axes]
    memory = next(title for title in titles if "peak allocated" in title)
    assert memory == "engine main: peak allocated per rank and step; highest: rank 1 (<), 1.25x the lowest; jumps: 1"
    panel = next(axes for axes in figure.axes if axes.get_title(loc="left") == memory)
    jumps, highest = panel.collections
    assert jumps.get_offsets().tolist() == [[3.0, 1.0]]  # step 3, rank 1
    assert highest.get_offsets().tolist() == [[5.5, 1.0]]  # rank 1's row, at the right edge
    write_records(tmp_path, 0, [record(0, step) for step in range(3)])
    write_records(tmp_path, 1, [record(1, step) for step in range(3)])
    assert not any("peak allocated" in axes.get_title(loc="left") for axes in build_figure(build_report(tmp_path)).axes)


def test_a_record_with_a_bad_memory_figure_is_skipped_whole(tmp_path):
    bad = schema3(record(0, 1), peak_bytes=BASE)
    bad["memory"]["peak_reserved_bytes"] = "lots"
    write_records(tmp_path, 0, [schema3(record(0, 0), peak_bytes=BASE, live_params=10), bad])
    report = build_report(tmp_path)
    assert report["problems"][0]["first"] == ["line 2: not a fetch record, skipped"]
    engine = report["engines"]["main"]
    assert engine["steps"].global_steps == [0] and engine["memory"]["ranks"][0]["prefetch_hits"] == 6
