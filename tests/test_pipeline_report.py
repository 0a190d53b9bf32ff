"""The report's pipeline reading (report/pipeline.py) on generated records: the stage table, the ideal bubble,
the slowest stage on both sides of its thresholds, the straggler test kept within each stage, and the diff per
stage."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, Sequence

import pytest
from report_testing import record, schema3, write_records

from ds_profutils._stages import SLOW_STAGE_RATIO
from ds_profutils.diff.build import build_diff
from ds_profutils.diff.text import render_diff
from ds_profutils.report import build_report, render_text
from ds_profutils.report.chance import binomial_upper_tail
from ds_profutils.report.pipeline import ideal_bubble_share
from ds_profutils.report.steps import STRAGGLER_LEVEL


def pipeline_run(directory: Path, stage_of: Sequence[int], steps: int, compute: Callable[[int, int], float], *,
                 inside: Callable[[int, int], float] = lambda rank, step: 2.0, micro_batches: int = 8,
                 stage_numel: Callable[[int], int] = lambda stage: 1000,
                 extra: Callable[[int], Dict[str, float]] = lambda rank: {}) -> None:
    """Records of a pipeline: rank r on stage ``stage_of[r]``, whose compute at step s is ``compute(stage, s)``;
    ``inside``: the rank's time inside collectives (a data-parallel gradient all-reduce); ``stage_numel``: the
    parameters of a stage's layers, each rank's ``model_numel`` (what a PipelineEngine's module holds); ``extra``:
    further fields of each of a rank's records."""
    stages = max(stage_of) + 1
    directory.mkdir(exist_ok=True)
    for rank, stage in enumerate(stage_of):
        rows = []
        for step in range(steps):
            work, wait = compute(stage, step), inside(rank, step)
            p2p = 40.0 - work / 2
            base = record(rank, step, busy_ms=work + p2p, fetch_ms=0.0, collective_ms=wait, world_size=len(stage_of))
            rows.append(dict(schema3(base, inside_ms=wait), model_numel=stage_numel(stage), pipe_stage=stage,
                             pipe_stages=stages, data_parallel_rank=0,
                             micro_batches=micro_batches, compute_ms=work, p2p_ms=p2p, bubble_ms=p2p + 1.0,
                             instructions_ms={"ForwardPass": work / 3, "BackwardPass": 2 * work / 3}, **extra(rank)))
        write_records(directory, rank, rows)


def test_stage_table_ideal_bubble_and_a_slow_last_stage(tmp_path: Path) -> None:
    pipeline_run(tmp_path, [0, 1], 12, lambda stage, step: 40.0 if stage else 10.0)
    report = build_report(tmp_path)
    pipeline = report["engines"]["main"]["pipeline"]
    assert set(pipeline["stages"]) == {"0", "1"}
    first, last = pipeline["stages"]["0"], pipeline["stages"]["1"]
    assert first["ranks"] == [0] and last["ranks"] == [1]
    assert (first["compute_ms_median"], last["compute_ms_median"]) == (10.0, 40.0)
    assert (first["p2p_ms_median"], last["p2p_ms_median"]) == (35.0, 20.0)
    assert first["bubble_ms_median"] == 36.0
    assert first["bubble_share_median"] == pytest.approx(36.0 / (45.0 + 2.0))
    assert pipeline["ideal_bubble_share"] == pytest.approx(1 / 9)
    assert pipeline["stage_imbalance"] == pytest.approx(40.0 / 25.0)
    assert pipeline["slowest_stage"] == 1
    assert pipeline["slow_input_stage"] is None and pipeline["gap_stands_out"] == {}
    text = render_text(report)
    assert "Pipeline stages (2 stages, 8 micro batches" in text and "SLOW STAGE: stage 1" in text
    assert "11.1%" in text  # the ideal bubble
    # one rank a stage: nobody to compare a rank with, said so (not "0 tested steps of 2 ranks are too few")
    assert ("Reach of the test: no rank can be named: ranks are compared only within a pipeline stage, and each "
            "stage here has one rank") in " ".join(text.split())
    assert any(line.split()[:4] == ["rank", "host", "stage", "steps"] for line in text.splitlines())


def test_a_slow_data_iterator_or_gap_that_no_stage_compute_shows_is_named(tmp_path: Path) -> None:
    """Stage 0's data iterator takes 40 ms of its 47 ms step, or rank 1 spends 45.7 ms between train_batch() calls:
    each stage waits for it in its receives, so neither compute nor a straggler shows it; the report names it."""
    pipeline_run(tmp_path / "load", [0, 1], 12, lambda stage, step: 10.0,
                 extra=lambda rank: {"load_ms": 40.0 if rank == 0 else 0.1, "gap_ms": 4.5, "iteration_ms": 52.0})
    report = build_report(tmp_path / "load")
    pipeline = report["engines"]["main"]["pipeline"]
    assert pipeline["slowest_stage"] is None and pipeline["gap_stands_out"] == {}
    assert pipeline["slow_input_stage"] == 0 and pipeline["load_share"] == pytest.approx(40.0 / 47.0)
    assert pipeline["stages"]["0"]["load_ms_median"] == 40.0
    assert ("SLOW INPUT: stage 0 loads its micro batches (LoadMicroBatch: the data iterator) for 40.0 ms of its "
            "47.0 ms step (85.1%)") in " ".join(render_text(report).split())
    pipeline_run(tmp_path / "gap", [0, 1], 12, lambda stage, step: 10.0,
                 extra=lambda rank: {"load_ms": 0.1, "gap_ms": 45.7 if rank == 1 else 4.5, "iteration_ms": 90.0})
    report = build_report(tmp_path / "gap")
    pipeline = report["engines"]["main"]["pipeline"]
    assert pipeline["slow_input_stage"] is None and pipeline["gap_stands_out"] == {1: 45.7}
    pipeline_run(tmp_path / "waited", [0, 1], 12, lambda stage, step: 10.0,
                 extra=lambda rank: {"load_ms": 0.1, "gap_ms": 45.7 if rank == 1 else 4.5, "iteration_ms": 90.0,
                                     "gap_collective_ms": 41.0 * (rank == 1), "eval_ms": 0.0, "save_ms": 0.0})
    assert build_report(tmp_path / "waited")["engines"]["main"]["pipeline"]["gap_stands_out"] == {}  # it waited
    pipeline_run(tmp_path / "evaluated", [0, 1], 12, lambda stage, step: 10.0,
                 extra=lambda rank: {"load_ms": 0.1, "gap_ms": 45.7 if rank == 1 else 4.5, "iteration_ms": 90.0,
                                     "gap_collective_ms": 0.0, "eval_ms": 41.0 * (rank == 1), "save_ms": 0.0})
    assert build_report(tmp_path / "evaluated")["engines"]["main"]["pipeline"]["gap_stands_out"] == {}
    assert "SLOW BETWEEN BATCHES: rank 1 spends 45.7 ms between train_batch() calls" in " ".join(
        render_text(report).split())


@pytest.mark.parametrize("ratio, slow_steps, named", [
    (SLOW_STAGE_RATIO + 0.01, 20, True),  # 1.26x the median stage in 20 of 30 steps: 2/3
    (SLOW_STAGE_RATIO - 0.01, 30, False),  # 1.24x in every step: not out of the noise
    (SLOW_STAGE_RATIO + 0.01, 19, False),  # 1.26x in 19 of 30 steps: under 2/3
])
def test_slowest_stage_thresholds(tmp_path: Path, ratio: float, slow_steps: int, named: bool) -> None:
    """Three stages, the median stage's compute 10 ms: stage 2 at ``ratio`` of it in ``slow_steps`` steps."""
    pipeline_run(tmp_path, [0, 1, 2], 30,
                 lambda stage, step: 10.0 * ratio if stage == 2 and step < slow_steps else 10.0 - (stage == 0))
    assert build_report(tmp_path)["engines"]["main"]["pipeline"]["slowest_stage"] == (2 if named else None)


def test_no_pipeline_without_stages(tmp_path: Path) -> None:
    for rank in range(2):
        write_records(tmp_path, rank, [schema3(record(rank, step)) for step in range(4)])
    report = build_report(tmp_path)
    assert report["engines"]["main"]["pipeline"] is None
    assert "Pipeline stages" not in render_text(report)


def test_straggler_test_within_each_stage_only(tmp_path: Path) -> None:
    """Stage 1 (ranks 2, 3) has least time inside collectives of all: across stages it would be the straggler,
    though stages do different work.  Within stage 0, rank 1 arrives last (rank 0 waits 28 ms for it)."""
    inside = {0: 30.0, 1: 2.2, 2: 1.0, 3: 1.3}
    pipeline_run(tmp_path, [0, 0, 1, 1], 16, lambda stage, step: 30.0, inside=lambda rank, step: inside[rank])
    report = build_report(tmp_path)
    engine = report["engines"]["main"]
    # the reach is the rule applied: a stage's 2 ranks (chance 1/2 a step) at the level of the world's 4
    test = engine["straggler_test"]
    needed = test["steps_to_name"]
    assert test["chance_per_step"] == 0.5 and test["rank_level"] == STRAGGLER_LEVEL / 4
    assert binomial_upper_tail(needed, 16, 0.5) <= STRAGGLER_LEVEL / 4 < binomial_upper_tail(needed - 1, 16, 0.5)
    assert (f"at least {needed} of the 16 tested steps of 2 ranks in a pipeline stage"
            in " ".join(render_text(report).split()))
    assert engine["straggler_ranks"] == [1]
    assert engine["ranks_summary"][2]["straggler_steps"] == 0
    assert [engine["ranks_summary"][rank]["pipe_stage"] for rank in range(4)] == [0, 0, 1, 1]


def test_ideal_bubble_share() -> None:
    assert ideal_bubble_share(2, 8) == pytest.approx(1 / 9)
    assert ideal_bubble_share(4, 16) == pytest.approx(3 / 19)
    assert ideal_bubble_share(1, 8) == 0.0
    assert ideal_bubble_share(0, 8) is None


def test_stage_tflops_and_mfu(tmp_path: Path) -> None:
    """Stage 0 computes 2e9 FLOPs per step, stage 1 1e9, each over an iteration of 50 ms: 0.04 and 0.02 TFLOP/s."""
    for rank in range(2):
        rows = [dict(schema3(record(rank, step, busy_ms=45.0, fetch_ms=0.0, collective_ms=5.0)), pipe_stage=rank,
                     pipe_stages=2, micro_batches=8, compute_ms=20.0, p2p_ms=20.0, bubble_ms=25.0,
                     flops=(2 - rank) * 10**9, iteration_ms=50.0, peak_tflops=0.1) for step in range(6)]
        write_records(tmp_path, rank, rows)
    report = build_report(tmp_path)
    stages = report["engines"]["main"]["pipeline"]["stages"]
    assert (stages["0"]["tflops_median"], stages["1"]["tflops_median"]) == (pytest.approx(0.04), pytest.approx(0.02))
    assert (stages["0"]["mfu_median"], stages["1"]["mfu_median"]) == (pytest.approx(0.4), pytest.approx(0.2))
    lines = render_text(report).splitlines()
    at = next(index for index, line in enumerate(lines) if line.startswith("stage  ranks"))
    assert lines[at].split()[-2:] == ["FLOP/s", "MFU"]
    assert [line.split()[-3:] for line in lines[at + 1:at + 3]] == [["40.0", "GFLOP/s", "40.0%"], ["20.0", "GFLOP/s", "20.0%"]]


def test_diff_compares_each_stage_with_itself(tmp_path: Path) -> None:
    """NEW's stage 1 computes 30% longer than BASE's, stage 0 the same: the diff says so per stage."""
    def jitter(stage: int, step: int) -> float:
        return 0.2 * ((step * 7 + stage * 3) % 5 - 2)

    pipeline_run(tmp_path / "base", [0, 1], 40, lambda stage, step: 20.0 + jitter(stage, step))
    pipeline_run(tmp_path / "new", [0, 1], 40, lambda stage, step: (26.0 if stage else 20.0) + jitter(stage, step))
    diff = build_diff(tmp_path / "base", tmp_path / "new")
    stages = diff["engines"]["main"]["stages"]
    assert set(stages) == {"0", "1"}
    assert stages["1"]["compute_ms"]["significant"] and stages["1"]["compute_ms"]["change"] == pytest.approx(6.0)
    assert not stages["0"]["compute_ms"]["significant"]
    text = render_diff(diff)
    assert "stage 1: compute 20.000 -> 26.000 ms (SLOWER" in text


def test_a_rank_that_waits_for_its_pipe_neighbour_is_not_called_slow_compute(tmp_path: Path) -> None:
    """2 stages x 2 data-parallel ranks, rank 3 (stage 1) computing 44 ms a step where its peer computes 3: rank 1
    (stage 0, rank 3's pipe) waits for it in its receives and reaches its stage's all-reduce last.  Both are their
    stage's stragglers; rank 3's cause is compute, rank 1's is not (its own compute is its peer's: its busy time
    less its waits, the sends and receives, would call it slow compute)."""
    figures = {0: (2.3, 4.5, 49.6), 1: (2.4, 46.4, 7.8), 2: (2.9, 4.1, 50.1), 3: (44.1, 4.7, 8.3)}
    for rank, stage in enumerate([0, 0, 1, 1]):
        compute, p2p, inside = figures[rank]
        rows = [dict(schema3(record(rank, step, busy_ms=60.0 - inside, fetch_ms=0.0, collective_ms=inside,
                                    world_size=4), inside_ms=inside), pipe_stage=stage, pipe_stages=2, micro_batches=4,
                     compute_ms=compute, p2p_ms=p2p, bubble_ms=p2p + 1.0) for step in range(16)]
        write_records(tmp_path, rank, rows)
    engine = build_report(tmp_path)["engines"]["main"]
    assert engine["straggler_ranks"] == [1, 3]  # each its stage's: rank 1 reaches stage 0's all-reduce last
    summary = engine["ranks_summary"]
    assert summary[3]["cause"] == "compute" and summary[1]["cause"] == "unknown"  # its compute is its peer's


def test_several_runs_a_side_compare_each_stage_over_all_of_them(tmp_path: Path) -> None:
    """Each side's runs are pooled as for the step time: the same two runs on both sides, in either order, are no
    change of any stage (the first runs alone differ by 30% in stage 1); three runs a side whose stage 1 computes
    30% longer in NEW are, by the test between runs."""
    def jitter(stage: int, step: int, run: int) -> float:
        return 0.2 * ((step * 7 + stage * 3 + run) % 5 - 2) + 0.1 * run

    def runs(side: str, stage_1_ms: float) -> list:
        paths = [tmp_path / f"{side}{run}" for run in range(3)]
        for run, path in enumerate(paths):
            pipeline_run(path, [0, 1], 40, lambda stage, step: (stage_1_ms if stage else 20.0) + jitter(stage, step, run))
        return paths

    base, new = runs("base", 20.0), runs("new", 26.0)
    same = build_diff([base[0], new[0]], [new[0], base[0]])["engines"]["main"]["stages"]
    assert set(same) == {"0", "1"} and same["1"]["compute_ms"]["runs"] == {"base": 2, "new": 2}
    assert not any(same[stage][figure]["significant"] for stage in same for figure in same[stage])
    changed = build_diff(base, new)["engines"]["main"]["stages"]
    assert changed["1"]["compute_ms"]["runs"] == {"base": 3, "new": 3} and changed["1"]["compute_ms"]["significant"]
    assert not changed["0"]["compute_ms"]["significant"]


def test_short_drifting_runs_are_not_passed_off_as_unchanged(tmp_path: Path) -> None:
    """12 steps whose compute drifts step after step (a newcomer's short pipeline runs): NEW's stage 1 is far slower,
    but each run is one drift, about one effective step a side; the step line and the stage line say the test sees
    only very large changes there, not that nothing changed."""
    pipeline_run(tmp_path / "base", [0, 1], 12, lambda stage, step: 10.0 + 5.0 * step)
    pipeline_run(tmp_path / "new", [0, 1], 12, lambda stage, step: (60.0 if stage else 10.0) + 5.0 * step)
    text = " ".join(render_diff(build_diff(tmp_path / "base", tmp_path / "new")).split())
    weak = "no significant change, but with 1.0 and 1.0 effective steps (the steps drift together)"
    assert "ms median (+" in text and f"): {weak}" in text  # the step line
    assert "stage 1: compute " in text and f"ms ({weak}" in text.split("stage 1: compute ")[1][:200]


def test_the_model_is_every_stage_and_repartitioning_it_is_the_same_model(tmp_path: Path) -> None:
    """Each rank's module is its stage's layers: the report's ``model_numel`` adds one rank per stage, so the same
    model in 2 and in 4 stages (with data parallelism) is one size, and the diff gives no different-models warning;
    a model that grew is still told."""
    sizes = [8_320, 8_320, 8_320, 8_320]
    pipeline_run(tmp_path / "two", [0, 0, 1, 1], 12, lambda stage, step: 20.0, stage_numel=lambda stage: 16_640)
    pipeline_run(tmp_path / "four", [0, 1, 2, 3], 12, lambda stage, step: 10.0, stage_numel=sizes.__getitem__)
    pipeline_run(tmp_path / "bigger", [0, 1], 12, lambda stage, step: 20.0, stage_numel=lambda stage: 20_000)
    assert build_report(tmp_path / "two")["engines"]["main"]["model_numel"] == 33_280
    assert build_report(tmp_path / "four")["engines"]["main"]["model_numel"] == 33_280
    assert not build_diff(tmp_path / "two", tmp_path / "four")["warnings"]
    assert "different sizes (model_numel 33,280 -> 40,000)" in build_diff(tmp_path / "two", tmp_path / "bigger")[
        "warnings"][0]


def test_no_stage_diff_for_other_engines(tmp_path: Path) -> None:
    for run in ("base", "new"):
        (tmp_path / run).mkdir()
        for rank in range(2):
            write_records(tmp_path / run, rank, [schema3(record(rank, step)) for step in range(12)])
    assert build_diff(tmp_path / "base", tmp_path / "new")["engines"]["main"]["stages"] is None


def test_causes_and_work_imbalance_within_each_stage_only(tmp_path: Path) -> None:
    """The last stage's ranks do 3x the FLOPs (its layers, the loss): against them, stage 0's straggler (rank 1)
    would do less work at a higher cost per unit, "compute".  Within its stage it does the same work at the same
    pace as its peer: no compute cause, and no work imbalance."""
    inside = {0: 30.0, 1: 2.2, 2: 1.0, 3: 1.3}
    for rank, stage in enumerate([0, 0, 1, 1]):
        rows = [dict(schema3(record(rank, step, busy_ms=60.0, fetch_ms=0.0, collective_ms=inside[rank], world_size=4),
                             inside_ms=inside[rank]), pipe_stage=stage, pipe_stages=2, micro_batches=8, compute_ms=30.0,
                     p2p_ms=20.0, bubble_ms=21.0, flops=(3 if stage else 1) * 10**9, iteration_ms=90.0, gap_ms=2.0)
                for step in range(16)]
        write_records(tmp_path, rank, rows)
    engine = build_report(tmp_path)["engines"]["main"]
    assert engine["straggler_ranks"] == [1]
    straggler = engine["ranks_summary"][1]
    assert straggler["cause"] == "unknown"  # host clocks cannot tell waiting from transfer: nothing else stands out
    assert (straggler["cause_figures"]["work_ratio"], straggler["cause_figures"]["pace_ratio"]) == (1.0, 1.0)
    assert engine["work_imbalance"] == pytest.approx(1.0)


@pytest.mark.parametrize("slow_ms", [30.0, 4.0])  # 4 ms: above its stage's threshold, below the other stage's
def test_a_rank_held_back_in_some_steps_within_its_stage_has_its_steps_and_their_cause(tmp_path: Path,
                                                                                      slow_ms: float) -> None:
    """2 stages x 2 ranks: rank 1 (stage 0) late from step 20 of 40 on, rank 3 (stage 1) 60 ms late in every step.
    Each step's merged straggler is stage 1's (the larger spread); rank 1's line still gives its own steps and their
    cause, from its stage's view and with its stage's threshold."""
    for rank, stage in enumerate([0, 0, 1, 1]):
        rows = []
        for step in range(40):
            jitter = 0.5 * ((rank * 7 + step * 3) % 5 - 2) / 2
            late = slow_ms if rank == 1 and step >= 20 else 60.0 if rank == 3 else 0.0
            peer_late = slow_ms if rank == 0 and step >= 20 else 60.0 if rank == 2 else 0.0
            base = record(rank, step, busy_ms=20.0 + late, fetch_ms=0.0, collective_ms=2.0 + jitter + peer_late,
                          world_size=4)
            rows.append(dict(schema3(base), pipe_stage=stage, pipe_stages=2, micro_batches=4, compute_ms=10.0 + late,
                             p2p_ms=4.0, bubble_ms=5.0))
        write_records(tmp_path, rank, rows)
    engine = build_report(tmp_path)["engines"]["main"]
    assert engine["straggler_ranks"] == [3] and engine["held_back_ranks"] == [1]
    held = engine["ranks_summary"][1]
    assert held["straggler_step_numbers"] == list(range(20, 40)) and held["cause_steps"] == {"compute": 20}


def test_a_pipeline_straggler_is_judged_with_its_own_stages_threshold(tmp_path: Path) -> None:
    """Rank 1 (stage 0) 4 ms slower in every step, rank 3 (stage 1) 60 ms: both named within their stage; rank 1's
    cause is its compute, decided with stage 0's threshold, as its steps' causes are (not unknown, by stage 1's)."""
    for rank, stage in enumerate([0, 0, 1, 1]):
        rows = []
        for step in range(40):
            jitter = 0.5 * ((rank * 7 + step * 3) % 5 - 2) / 2
            late = 4.0 if rank == 1 else 60.0 if rank == 3 else 0.0
            peer_late = 4.0 if rank == 0 else 60.0 if rank == 2 else 0.0
            base = record(rank, step, busy_ms=20.0 + late, fetch_ms=0.0, collective_ms=2.0 + jitter + peer_late,
                          world_size=4)
            rows.append(dict(schema3(base), pipe_stage=stage, pipe_stages=2, micro_batches=4, compute_ms=10.0 + late,
                             p2p_ms=4.0, bubble_ms=5.0))
        write_records(tmp_path, rank, rows)
    summary = build_report(tmp_path)["engines"]["main"]["ranks_summary"]
    assert summary[1]["straggler"] and summary[1]["cause"] == "compute" and summary[1]["cause_steps"] == {"compute": 40}
