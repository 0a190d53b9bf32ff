"""The report's readers on the fields later writers add (resumed runs' segments, the whole iteration, FLOPs and
MFU, disturbed memory, the torch profiler's window), on records written as those writers lay them out; files
without the fields read as before."""
from __future__ import annotations

import json

import pytest

from ds_profutils.cli import main
from ds_profutils.report import build_report, render_text

from report_testing import iteration_record, record, schema3, write_records

MIB = 2**20


def steps_of(report, rank=0, engine="main"):
    view = report["engines"][engine]["steps"]
    index = view.ranks.index(rank)
    return {step: view.step_ms.get(index, position) for position, step in enumerate(view.global_steps)}


@pytest.mark.parametrize("marked", [False, True])
def test_a_resumed_run_takes_each_step_from_its_latest_segment_and_adds_nothing(tmp_path, marked):
    """Steps 0-7 recorded at 25 ms, then a restart from the checkpoint at step 3 records steps 3-7 again at 40 ms
    (with ``segment`` 1 where the writer marks it, else found by the step going back): steps 3-7 are 40 ms, not
    65, and the five superseded records are counted."""
    for rank in (0, 1):
        first = [record(rank, step, busy_ms=22.0, **({"segment": 0} if marked else {})) for step in range(8)]
        second = [record(rank, step, busy_ms=37.0, **({"segment": 1} if marked else {})) for step in range(3, 8)]
        write_records(tmp_path, rank, first + second)
    report = build_report(tmp_path)
    engine = report["engines"]["main"]
    assert steps_of(report) == {**{step: 25.0 for step in range(3)}, **{step: 40.0 for step in range(3, 8)}}
    assert engine["superseded_records"] == 10 and engine["segments"] == 2
    assert engine["collectives"]["reduce_scatter_tensor"]["count"] == 8  # one per step, none twice
    assert engine["events"]["train"]["forward_fetch_wait"]["count"] == 8 * 4
    text = " ".join(render_text(report).split())
    assert "RESUMED: the run went back to earlier steps (2 segments" in text and "10 records of steps" in text


def test_a_restart_at_the_last_recorded_step_is_a_new_segment_only_where_the_records_say_so(tmp_path):
    """The step does not go back (resumed at step 7 after recording 0-7): only the ``segment`` field tells a
    repeated step 7 from its second micro step."""
    rows = [record(0, step, segment=0) for step in range(8)] + [record(0, 7, busy_ms=47.0, segment=1)]
    write_records(tmp_path, 0, rows)
    assert steps_of(build_report(tmp_path))[7] == 50.0


def test_micro_steps_of_one_step_are_still_added_up(tmp_path):
    write_records(tmp_path, 0, [record(0, step, micro_step=2 * step + micro) for step in range(3) for micro in range(2)])
    report = build_report(tmp_path)
    assert steps_of(report) == {0: 46.0, 1: 46.0, 2: 46.0} and report["engines"]["main"]["superseded_records"] == 0


def test_iteration_gap_tflops_and_mfu_per_rank(tmp_path):
    """Two micro steps of 3 TFLOP each per optimizer step; the last carries the iteration (2 x 23 ms + 5 ms gap =
    51 ms): 6e12 / 0.051 s = 117.6 TFLOP/s; against a peak of 200 TFLOP/s, 58.8 % MFU."""
    for rank in (0, 1):
        write_records(tmp_path, rank, [row for step in range(4)
                                       for row in iteration_record(rank, step, micro_steps=2, peak_tflops=200.0)])
    report = build_report(tmp_path)
    row = report["engines"]["main"]["ranks_summary"][0]
    assert row["iteration_ms_median"] == pytest.approx(51.0) and row["gap_ms_median"] == pytest.approx(5.0)
    assert row["tflops_median"] == pytest.approx(6e12 / 0.051 / 1e12)
    assert row["mfu_median"] == pytest.approx(6e12 / 0.051 / 1e12 / 200.0)
    assert row["step_ms_median"] == 46.0  # the step time as before
    text = render_text(report)
    header = next(line for line in text.split("\nRanks (")[1].splitlines() if line.startswith("rank "))
    assert all(name in header.split() for name in ("iteration", "gap", "FLOP/s", "MFU"))
    assert "58.8%" in text and "118 TFLOP/s" in text


def test_the_gaps_eval_and_save_times_per_rank(tmp_path):
    """Each optimizer step's eval_ms and save_ms (on its last micro step's record, null on the others) per rank."""
    rows = []
    for step, (eval_ms, save_ms) in enumerate([(0.0, 0.0), (30.0, 0.0), (40.0, 12.0)]):
        step_rows = iteration_record(0, step, micro_steps=2, gap_ms=60.0)
        for row in step_rows:
            last = row is step_rows[-1]
            row["eval_ms"], row["save_ms"] = (eval_ms, save_ms) if last else (None, None)
        rows += step_rows
    write_records(tmp_path, 0, rows)
    row = build_report(tmp_path)["engines"]["main"]["ranks_summary"][0]
    assert (row["eval_ms_median"], row["save_ms_median"]) == (30.0, 0.0)


def test_without_the_new_fields_the_columns_are_null_and_not_shown(tmp_path):
    write_records(tmp_path, 0, [record(0, step) for step in range(3)])
    report = build_report(tmp_path)
    row = report["engines"]["main"]["ranks_summary"][0]
    assert [row[key] for key in ("iteration_ms_median", "gap_ms_median", "tflops_median", "mfu_median")] == [None] * 4
    assert (row["eval_ms_median"], row["save_ms_median"]) == (None, None)
    assert "FLOP/s" not in render_text(report) and "iteration" not in render_text(report).split("Ranks (")[1][:200]


def test_a_straggler_late_by_its_gap_is_said_to_be_the_input_pipeline_not_compute(tmp_path):
    """Rank 1 spends 80 ms between steps: it arrives late, rank 0 waits 80 ms in the gradient collective; its busy
    time is rank 0's."""
    for rank in (0, 1):
        rows = []
        for step in range(10):
            rows += iteration_record(rank, step, gap_ms=80.0 if rank == 1 else 2.0,
                                     collective_ms=2.0 + (80.0 if rank == 0 else 0.0))
        write_records(tmp_path, rank, rows)
    report = build_report(tmp_path)
    summary = report["engines"]["main"]["ranks_summary"]
    assert summary[1]["straggler"] and summary[1]["late_by_gap"] is True and summary[0]["late_by_gap"] is None
    assert summary[1]["gap_ms_median"] == 80.0 and summary[0]["gap_ms_median"] == 2.0
    text = " ".join(render_text(report).split())
    assert ("cause: input_pipeline (gap 80.0 ms against 2.0 ms; 1.00x the others' work (3,000 against 3,000 gflop per "
            "step); busy 0.006667 against 0.006667 ms per gflop): a slow input pipeline or host work between steps, "
            "not slow compute") in text
    assert text.count("input pipeline") == 1  # said once, with the figures that decided it


def test_a_straggler_whose_gap_is_its_slow_eval_forwards_is_slow_in_compute(tmp_path):
    """Rank 1 is 40 ms slower in every forward, its train forward and the 3 eval forwards between steps (or alone
    evaluates): its gap stands out by its eval time, which is no input pipeline.  The cause weighs the gap without
    eval forwards and saves; the gap shown stays the recorded one."""
    for rank in (0, 1):
        rows = []
        for step in range(10):
            rows += iteration_record(rank, step, busy_ms=60.0 if rank == 1 else 20.0,
                                     gap_ms=125.0 if rank == 1 else 5.0, collective_ms=2.0 + 40.0 * (rank == 0))
            rows[-1].update(eval_ms=120.0 if rank == 1 else 0.0, save_ms=0.0, gap_collective_ms=0.0)
        write_records(tmp_path, rank, rows)
    summary = build_report(tmp_path)["engines"]["main"]["ranks_summary"]
    assert summary[1]["straggler"] and summary[1]["cause"] == "compute" and summary[1]["late_by_gap"] is False
    assert summary[1]["gap_ms_median"] == 125.0 and summary[1]["own_gap_ms_median"] == 5.0


@pytest.mark.parametrize("part", ["eval_ms", "save_ms"])
def test_a_straggler_that_alone_evaluates_between_steps_is_late_by_its_eval_not_its_data_loader(tmp_path, part):
    """Rank 1 alone runs 120 ms of eval forwards (or checkpoint saves) between steps (``if rank == 1: evaluate()``),
    its compute as fast as rank 0's: late by its gap, which is its eval forwards or saves, said so, and no data loader
    advice, nor a word of an input pipeline."""
    for rank in (0, 1):
        rows = []
        for step in range(10):
            rows += iteration_record(rank, step, gap_ms=125.0 if rank == 1 else 5.0,
                                     collective_ms=2.0 + 120.0 * (rank == 0))
            rows[-1].update(eval_ms=0.0, save_ms=0.0, gap_collective_ms=0.0)
            rows[-1][part] = 120.0 if rank == 1 else 0.0
        write_records(tmp_path, rank, rows)
    report = build_report(tmp_path)
    summary = report["engines"]["main"]["ranks_summary"]
    assert summary[1]["straggler"] and summary[1]["cause"] == "input_pipeline"
    assert summary[1]["cause_figures"]["gap_ms"] == 125.0 and summary[1]["cause_figures"]["gap_is_eval"] is True
    text = " ".join(render_text(report).split())
    assert ("cause: input_pipeline (gap 125.0 ms against 5.0 ms, its eval forwards and checkpoint saves between "
            "steps; 1.00x the others' work (3,000 against 3,000 gflop per step); busy 0.006667 against 0.006667 ms "
            "per gflop): host work the others do not do between steps, not its input "
            "pipeline nor slow compute: spread evaluation and saves over the ranks or run them less often") in text
    assert "num_workers" not in text and "a slow input pipeline" not in text


def test_a_straggler_slow_in_compute_is_not_put_on_its_gap(tmp_path):
    for rank in (0, 1):
        rows = []
        for step in range(10):
            rows += iteration_record(rank, step, busy_ms=100.0 if rank == 1 else 20.0,
                                     collective_ms=2.0 + (80.0 if rank == 0 else 0.0))
        write_records(tmp_path, rank, rows)
    summary = build_report(tmp_path)["engines"]["main"]["ranks_summary"]
    assert summary[1]["straggler"] and summary[1]["late_by_gap"] is False


def memory_rows(rank, peaks, disturbed=(), active=()):
    rows = []
    for step, peak in enumerate(peaks):
        row = schema3(record(rank, step), peak_bytes=peak)
        if step in disturbed:
            row["memory"]["disturbed"] = True
        if step in active:
            row["profiler_active"] = True
        rows.append(row)
    return rows


def test_disturbed_peaks_are_marked_and_left_out_of_highest_imbalance_and_jumps(tmp_path):
    """Rank 0's peaks reset inside the step (memory_breakdown) read low in every step, and once, falsely, high:
    none of them is the rank's peak, the imbalance or a jump."""
    write_records(tmp_path, 0, memory_rows(0, [100 * MIB] * 3 + [10 * MIB, 900 * MIB, 10 * MIB], disturbed={3, 4, 5}))
    write_records(tmp_path, 1, memory_rows(1, [200 * MIB] * 6))
    report = build_report(tmp_path)
    memory = report["engines"]["main"]["memory"]
    assert memory["ranks"][0]["peak_allocated_bytes"] == 100 * MIB and memory["ranks"][0]["disturbed_steps"] == 3
    assert memory["ranks"][0]["disturbed_peak_allocated_bytes"] == 900 * MIB
    assert memory["highest_rank"] == 1 and memory["imbalance"] == pytest.approx(2.0)
    assert memory["jump_count"] == 0 and memory["disturbed_steps"] == 3
    text = " ".join(render_text(report).split())
    assert "DISTURBED: 3 steps (rank 0) had their peaks reset between ds_profutils' boundaries" in text
    assert "left out of the peaks, the highest rank, the imbalance and the jumps" in text


@pytest.mark.parametrize("source", ["records", "trace"])
def test_a_jump_in_the_profilers_window_or_the_step_after_is_the_profilers(tmp_path, source):
    """The Trainer demo: profiled steps 3-4, rank 0's peak up from step 5 on (the profiler's buffers); rank 1's
    jump at step 8 is not the profiler's."""
    from report_testing import write_trace

    active = {3, 4} if source == "records" else set()
    write_records(tmp_path, 0, memory_rows(0, [500 * MIB] * 5 + [600 * MIB] * 5, active=active))
    write_records(tmp_path, 1, memory_rows(1, [500 * MIB] * 8 + [600 * MIB] * 2, active=active))
    if source == "trace":
        for rank in (0, 1):
            write_trace(tmp_path / f"trace_rank_{rank}.json", {3: 30.0, 4: 30.0}, rank=rank)
    report = build_report(tmp_path)
    jumps = report["engines"]["main"]["memory"]["jumps"]
    assert [(jump["rank"], jump["global_step"], jump["during_profiler"]) for jump in jumps] == [(0, 5, True),
                                                                                               (1, 8, False)]
    text = " ".join(render_text(report).split())
    assert "rank 0 at step 5: 600.00 MiB (500.00 MiB before), during the torch profiler's window" in text
    assert "rank 1 at step 8: 600.00 MiB (500.00 MiB before);" in text or "rank 1 at step 8: 600.00 MiB (500.00 MiB before)." in text


def test_json_carries_the_new_figures(tmp_path, capsys):
    write_records(tmp_path, 0, [row for step in range(3) for row in iteration_record(0, step)])
    assert main(["report", str(tmp_path), "--json"]) == 0
    engine = json.loads(capsys.readouterr().out)["engines"]["main"]
    assert engine["superseded_records"] == 0 and engine["segments"] == 1
    assert engine["ranks_summary"]["0"]["iteration_ms_median"] == 28.0
    assert engine["steps"]["iteration_ms"] == [[28.0, 28.0, 28.0]] and len(engine["steps"]["tflops"][0]) == 3


def test_the_step_views_gap_is_the_recorded_gap_and_the_own_gap_is_apart(tmp_path):
    """The frameworks' collectives between steps (gap_collective_ms) are part of the gap: the view's (and so the
    diff's) gap is the recorded one; the rank's own gap, which the causes read, is kept beside it."""
    for rank in range(2):
        rows = []
        for step in range(4):
            rows += iteration_record(rank, step, gap_ms=100.0)
            rows[-1]["gap_collective_ms"] = 80.0 if rank == 0 else 1.0
        write_records(tmp_path, rank, rows)
    view = build_report(tmp_path)["engines"]["main"]["steps"]
    assert list(view.gap_ms.rank_row(0)) == [100.0] * 4
    assert list(view.own_gap_ms.rank_row(0)) == [20.0] * 4 and list(view.own_gap_ms.rank_row(1)) == [99.0] * 4


def test_a_rank_saving_every_fourth_step_is_held_back_in_those_steps_for_its_saves_with_no_data_loader_advice(tmp_path):
    """Rank 0 alone saves a checkpoint (100 ms) every fourth step, the others wait: held back in some steps, whose
    cause is its saves (eval_or_save), not its input pipeline; no data loader advice."""
    for rank in (0, 1):
        rows = []
        for step in range(40):
            saves = rank == 0 and step % 4 == 3
            waits = rank == 1 and step % 4 == 3
            rows += iteration_record(rank, step, gap_ms=105.0 if saves else 5.0, collective_ms=2.0 + 100.0 * waits)
            rows[-1].update(eval_ms=0.0, save_ms=100.0 if saves else 0.0, gap_collective_ms=0.0)
        write_records(tmp_path, rank, rows)
    report = build_report(tmp_path)
    engine = report["engines"]["main"]
    assert engine["held_back_ranks"] == [0] and engine["ranks_summary"][0]["cause_steps"] == {"eval_or_save": 10}
    assert not [found for found in engine["advice"] if found["rule"] == "input_pipeline"]
    assert "the cause in those steps: eval_or_save 10" in " ".join(render_text(report).split())


def test_a_run_of_eval_records_only_is_reported_without_train_figures(tmp_path):
    """An evaluation-only job (``engine.eval()`` and forwards): the report reads it, with no straggler, work or cause,
    where it raised KeyError."""
    for rank in (0, 1):
        write_records(tmp_path, rank, [record(rank, step, mode="eval") for step in range(10)])
    report = build_report(tmp_path)
    engine = report["engines"]["main"]
    assert engine["records"] == {"eval": 20} and engine["straggler_ranks"] == []
    assert engine["ranks_summary"][0]["cause"] is None and engine["ranks_summary"][0]["work_median"] is None
    assert "No train steps recorded." in render_text(report)
