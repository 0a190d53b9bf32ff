"""The cause of a straggler's lateness: each rule of ds_profutils.diagnosis.causes on both sides of its threshold,
then the report's per-rank work figures and causes on records written here."""
import pytest

from ds_profutils.diagnosis.causes import (CAUSE_CODES, COMPUTE_EXCESS_SHARE, MORE_WORK_RATIO, SAME_PACE_RATIO, Figures,
                                           decide_cause, GAP_OVER_BUSY, late_by_gap)
from ds_profutils.report import build_report, render_text

from report_testing import iteration_record, write_records

THRESHOLD = 10.0
OTHER = Figures(busy_ms=50.0, gap_ms=2.0, work=100.0, exposed_wait_ms=1.0)


def cause(own, device_clock=False):
    return decide_cause(own, [OTHER, OTHER], THRESHOLD, device_clock)[0]


def test_a_gap_that_stands_out_by_the_threshold_is_the_input_pipeline():
    assert cause(Figures(50.0, 2.0 + THRESHOLD, 100.0)) == "input_pipeline"
    assert cause(Figures(50.0, 2.0 + THRESHOLD - 0.1, 100.0)) == "unknown"
    # the gap stands out and so does its busy time: the gap where its excess is GAP_OVER_BUSY times the busy's
    gap_excess = 78.0
    busy_below, busy_above = gap_excess / GAP_OVER_BUSY - 0.1, gap_excess / GAP_OVER_BUSY + 0.1
    assert late_by_gap(Figures(50.0 + busy_below, 2.0 + gap_excess, 100.0), [OTHER], THRESHOLD)
    assert not late_by_gap(Figures(50.0 + busy_above, 2.0 + gap_excess, 100.0), [OTHER], THRESHOLD)
    assert cause(Figures(50.0 + busy_above, 2.0 + gap_excess, 100.0)) == "compute"  # its busy per unit decides
    assert not late_by_gap(Figures(50.0 + THRESHOLD, 2.0 + THRESHOLD, 100.0), [OTHER], THRESHOLD)


def test_more_work_at_the_same_pace_is_more_work_and_below_the_ratio_is_not():
    work = 100.0 * MORE_WORK_RATIO
    assert cause(Figures(50.0 * MORE_WORK_RATIO, 2.0, work)) == "more_work"
    below = 100.0 * (MORE_WORK_RATIO - 0.01)
    assert cause(Figures(50.0 * (MORE_WORK_RATIO - 0.01), 2.0, below)) == "unknown"


def test_more_work_at_a_slower_pace_is_compute():
    work = 200.0
    at_limit = 0.5 * work * SAME_PACE_RATIO  # busy per unit exactly SAME_PACE_RATIO times the others'
    assert cause(Figures(at_limit, 2.0, work)) == "more_work"
    assert cause(Figures(at_limit * 1.01, 2.0, work)) == "compute"


def test_busy_per_unit_above_the_pace_ratio_is_compute_and_at_it_is_not():
    assert cause(Figures(50.0 * SAME_PACE_RATIO * 1.01, 2.0, 100.0)) == "compute"
    assert cause(Figures(50.0 * SAME_PACE_RATIO, 2.0, 100.0)) == "unknown"


def test_a_slower_pace_is_compute_only_where_it_adds_half_the_threshold_to_the_busy_time():
    """A pipeline rank's busy time is its compute, a small part of its step: 13% slower on 2.2 ms adds 0.3 ms, far
    from what made it late (its wait for its pipe neighbour); the same pace ratio on a larger compute is compute."""
    peer = Figures(busy_ms=2.2, gap_ms=1.0, work=5.0)
    assert decide_cause(Figures(2.2 * 1.13, 1.0, 5.0), [peer], THRESHOLD)[0] == "unknown"
    at_share = 2.2 + COMPUTE_EXCESS_SHARE * THRESHOLD
    assert decide_cause(Figures(at_share, 1.0, 5.0), [peer], THRESHOLD)[0] == "compute"
    assert decide_cause(Figures(at_share - 0.1, 1.0, 5.0), [peer], THRESHOLD)[0] == "unknown"


def test_without_work_the_busy_time_per_step_decides():
    other = Figures(50.0, 2.0)
    assert decide_cause(Figures(60.0, 2.0), [other], THRESHOLD)[0] == "compute"
    verdict, figures = decide_cause(Figures(54.0, 2.0), [other], THRESHOLD)
    assert verdict == "unknown" and figures["busy_ms_per_unit"] is None and figures["pace_ratio"] == 54.0 / 50.0


def test_others_without_busy_time_decide_nothing_and_raise_nothing():
    idle = Figures(busy_ms=0.0, gap_ms=2.0, work=100.0)
    assert decide_cause(Figures(50.0, 2.0, 200.0), [idle], THRESHOLD)[0] == "unknown"


def test_communication_only_on_device_clocks():
    stalled = Figures(50.0, 2.0, 100.0, exposed_wait_ms=1.0 + THRESHOLD)
    assert cause(stalled, device_clock=True) == "communication"
    assert cause(stalled, device_clock=False) == "unknown"
    assert cause(Figures(50.0, 2.0, 100.0, exposed_wait_ms=THRESHOLD), device_clock=True) == "unknown"


def test_the_live_codes_are_documented_ones():
    assert CAUSE_CODES == {None: 0, "more_work": 1, "input_pipeline": 2, "compute": 3, "communication": 4,
                           "unknown": 5, "eval_or_save": 6}


def two_ranks(tmp_path, steps=12, **rank_one):
    """Rank 0 busy 20 ms on 512 tokens; rank 1 as ``rank_one`` says (busy_ms, tokens, flops, gap_ms); the others'
    wait in the gradient collective is what rank 1 is late by."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    for rank in (0, 1):
        rows = []
        for step in range(steps):
            own = rank_one if rank == 1 else {}
            late = rank_one.get("busy_ms", 20.0) - 20.0 + rank_one.get("gap_ms", 2.0) - 2.0
            rows += iteration_record(rank, step, busy_ms=own.get("busy_ms", 20.0), gap_ms=own.get("gap_ms", 2.0),
                                     flops=own.get("flops", 3e12), tokens=own.get("tokens", 512),
                                     collective_ms=2.0 + (late if rank == 0 else 0.0))
        write_records(tmp_path, rank, rows)
    return build_report(tmp_path)


def test_the_report_gives_work_per_rank_and_more_work_as_the_cause(tmp_path):
    report = two_ranks(tmp_path, busy_ms=40.0, tokens=1024, flops=6e12)
    engine = report["engines"]["main"]
    slow, fast = engine["ranks_summary"][1], engine["ranks_summary"][0]
    assert engine["work_unit"] == "gflop" and slow["work_unit"] == "gflop"
    assert slow["work_median"] == 6000.0 and fast["work_median"] == 3000.0
    assert slow["tokens_median"] == 2 * fast["tokens_median"] == 1024
    assert engine["work_imbalance"] == 2.0
    assert slow["busy_ms_per_unit_median"] == pytest.approx(fast["busy_ms_per_unit_median"], rel=0.05)
    assert slow["cause"] == "more_work" and fast["cause"] is None and fast["cause_figures"] is None
    assert slow["cause_figures"]["work_ratio"] == 2.0 and slow["cause_steps"] == {"more_work": 12}
    assert slow["late_by_gap"] is False
    text = " ".join(render_text(report).split())
    assert "cause: more_work" in text and "2.00x the others' work" in text
    assert "its straggler steps:" not in text  # every one of them for more work


def test_the_straggler_line_counts_the_causes_of_its_steps_where_they_differ(tmp_path):
    """Rank 1 gets twice the work in 10 steps and is slow at even work in 4: named for more work, and the text
    says the 4."""
    for rank in (0, 1):
        rows = []
        for step in range(14):
            more = step < 10
            own = (40.0, 6e12 if more else 3e12) if rank == 1 else (20.0, 3e12)
            rows += iteration_record(rank, step, busy_ms=own[0], flops=own[1], gap_ms=2.0,
                                     collective_ms=2.0 + (20.0 if rank == 0 else 0.0))
        write_records(tmp_path, rank, rows)
    report = build_report(tmp_path)
    slow = report["engines"]["main"]["ranks_summary"][1]
    assert slow["cause"] == "more_work" and slow["cause_steps"] == {"more_work": 10, "compute": 4}
    assert "its straggler steps: more_work 10, compute 4" in " ".join(render_text(report).split())


def test_the_report_gives_compute_input_pipeline_and_no_cause_for_an_even_run(tmp_path):
    compute = two_ranks(tmp_path / "compute", busy_ms=80.0)["engines"]["main"]["ranks_summary"][1]
    assert compute["cause"] == "compute" and compute["cause_figures"]["pace_ratio"] > 3
    gap = two_ranks(tmp_path / "gap", gap_ms=80.0)["engines"]["main"]["ranks_summary"][1]
    assert gap["cause"] == "input_pipeline" and gap["late_by_gap"] is True
    even = two_ranks(tmp_path / "even")["engines"]["main"]
    assert even["straggler_ranks"] == [] and all(row["cause"] is None for row in even["ranks_summary"].values())


def test_work_falls_back_to_tokens_then_samples(tmp_path):
    engine = two_ranks(tmp_path / "tokens", busy_ms=40.0, tokens=1024, flops=None)["engines"]["main"]
    assert engine["work_unit"] == "token" and engine["ranks_summary"][1]["cause"] == "more_work"
    engine = two_ranks(tmp_path / "samples", busy_ms=40.0, tokens=None, flops=None)["engines"]["main"]
    assert engine["work_unit"] == "sample" and engine["ranks_summary"][1]["cause"] == "compute"


def test_ranks_taking_turns_at_the_long_batches_give_the_per_step_imbalance_and_the_batching_advice(tmp_path):
    """Variable-length batches on every rank: in each of 24 steps one rank draws 5x the work of the other, each rank
    in turn, and the other waits.  The ranks' medians are equal and neither rank is named; the step's imbalance is
    5x, the causes of the steps say more work, and the advice is the batching one."""
    for rank in (0, 1):
        rows = []
        for step in range(24):
            long = step % 2 == rank  # rank 0 in even steps, rank 1 in odd ones
            rows += iteration_record(rank, step, busy_ms=100.0 if long else 20.0, gap_ms=2.0,
                                     flops=15e12 if long else 3e12, collective_ms=2.0 + (0.0 if long else 80.0))
        write_records(tmp_path, rank, rows)
    report = build_report(tmp_path)
    engine = report["engines"]["main"]
    assert engine["straggler_ranks"] == [] and engine["held_back_ranks"] == []
    assert engine["work_imbalance"] == pytest.approx(5.0)
    assert [engine["ranks_summary"][rank]["cause_steps"] for rank in (0, 1)] == [{"more_work": 12}] * 2
    advice = [found for found in engine["advice"] if found["rule"] == "more_work"]
    assert len(advice) == 1 and advice[0]["topic"] == "batching"
    assert advice[0]["why"] == ("in 24 of the 24 steps where a rank held the others back it had more work at their pace, "
                                "the ranks in turn; a step's most work is 5.00x its least (median over the steps)")
    even = two_ranks(tmp_path / "even")["engines"]["main"]
    assert even["work_imbalance"] == 1.0 and not [found for found in even["advice"] if found["rule"] == "more_work"]


def test_a_rank_whose_loader_workers_take_turns_is_held_back_in_every_other_step_with_the_loader_advice(tmp_path):
    """Two DataLoader workers on rank 1 deliver its batches in pairs: every other step it waits 60 ms for the next
    pair between steps, the others wait for it.  Half the steps: not flagged, held back in those, loader advice."""
    for rank in (0, 1):
        rows = []
        for step in range(30):
            waits = step % 2 == 1
            rows += iteration_record(rank, step, busy_ms=20.0, flops=3e12, gap_ms=62.0 if rank == 1 and waits else 2.0,
                                     collective_ms=2.0 + (60.0 if rank == 0 and waits else 0.0))
        write_records(tmp_path, rank, rows)
    engine = build_report(tmp_path)["engines"]["main"]
    assert engine["straggler_ranks"] == [] and engine["held_back_ranks"] == [1]
    assert engine["ranks_summary"][1]["cause_steps"] == {"input_pipeline": 15}
    loader = [found for found in engine["advice"] if found["rule"] == "input_pipeline"]
    assert len(loader) == 1 and loader[0]["topic"] == "data_loader"
    assert loader[0]["why"] == "rank 1 held the others back in 15 steps, 15 of them by its gap between steps"
    assert "more DataLoader workers (num_workers)" in loader[0]["suggest"]
