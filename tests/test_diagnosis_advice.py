"""Advice rules (ds_profutils.diagnosis.advice) on records written here: each fires past its threshold and stays
silent short of it, and a job where nothing stands out gets no advice."""
from typing import Any, Dict

import pytest

from ds_profutils.diagnosis.advice import (EXPOSED_REDUCE_SHARE, FETCH_WAIT_SHARE, LIVE_AT_LIMIT, MANY_REDUCES,
                                           MANY_SMALL_GATHERS, SMALL_GATHER_FACTOR, WAITED_SHARE)
from ds_profutils.report import build_report, render_text

from report_testing import event, record, schema3, write_records

Z = "zero_optimization."
STEPS = 10
MODEL = 1_000_000


def config(**values: Any) -> Dict[str, Any]:
    defaults = {"stage": 3, "overlap_comm": True, "reduce_bucket_size": 500_000_000,
                "allgather_bucket_size": 500_000_000, "stage3_prefetch_bucket_size": 50_000_000,
                "stage3_param_persistence_threshold": 100_000, "stage3_max_live_parameters": 1_000_000_000,
                "stage3_max_reuse_distance": 1_000_000_000}
    return {Z + key: value for key, value in {**defaults, **values}.items()}


def run(tmp_path, *, ds_config=None, fetch_ms=1.0, busy_ms=100.0, collective_ms=2.0, prefetches=1,
        prefetch_numel=MODEL, on_demand=0, in_flight=0, gathers=2, gather_numel=MODEL, live=5000,
        invalidations=0, reduces=1, reduce_op="reduce_scatter_tensor", all_reduces=0):
    """Two ranks, STEPS steps of schema 3 records with these per-step figures (``busy_ms`` and ``collective_ms`` a
    pair: each rank's); the report's engine."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    for rank in (0, 1):
        rows = []
        rank_busy_ms = busy_ms[rank] if isinstance(busy_ms, tuple) else busy_ms
        rank_collective_ms = collective_ms[rank] if isinstance(collective_ms, tuple) else collective_ms
        for step in range(STEPS):
            row = schema3(record(rank, step, busy_ms=rank_busy_ms, fetch_ms=fetch_ms, collective_ms=rank_collective_ms,
                                 model_numel=MODEL), hits=prefetch_numel * prefetches, waited=on_demand,
                          live_params=live, invalidations=invalidations, peak_bytes=2**30)
            row["prefetch"]["in_flight_waited"] = in_flight
            row["events"]["forward_prefetch_submit"] = event(prefetches, prefetch_numel * prefetches, 0.1, "full")
            row["events"]["forward_all_gather"] = event(gathers, gather_numel * gathers, 0.5, "full")
            row["collectives"] = {reduce_op: {"count": reduces, "time_ms": rank_collective_ms,
                                              "exposed_ms": rank_collective_ms,
                                              "stream": "compute", "async": 0, "clock": "host"}}
            if all_reduces:  # e.g. the gradient norm's, beside the buckets' reductions
                row["collectives"]["all_reduce"] = {"count": all_reduces, "time_ms": 0.1, "exposed_ms": 0.1,
                                                    "stream": "compute", "async": 0, "clock": "host"}
            if step == 0:
                row["ds_config"] = config() if ds_config is None else ds_config
            rows.append(row)
        write_records(tmp_path, rank, rows)
    return build_report(tmp_path)["engines"]["main"]


def rules(engine):
    return {found["rule"]: found for found in engine["advice"]}


def test_a_job_where_nothing_stands_out_gets_no_advice(tmp_path):
    engine = run(tmp_path)
    assert engine["advice"] == [] and engine["config"][Z + "stage"] == 3
    assert "What to change: nothing stands out." in render_text(build_report(tmp_path))


def test_records_without_config_values_give_no_key_advice(tmp_path):
    firing = dict(prefetches=7, prefetch_numel=1000, in_flight=int(WAITED_SHARE * 7 * 1000) + 100)
    assert "prefetch_bucket" in rules(run(tmp_path / "with", ds_config=config(stage3_prefetch_bucket_size=100),
                                          **firing))  # these figures advise where the value is known
    assert run(tmp_path / "without", ds_config={}, **firing)["advice"] == []


def test_prefetch_bucket_raised_when_the_prefetch_stops_at_a_bucket_and_is_waited_in_flight(tmp_path):
    small = config(stage3_prefetch_bucket_size=100)
    late = int(WAITED_SHARE * 7 * 1000) + 100  # just past the share of the 7 x 1000 elements prefetched
    found = rules(run(tmp_path / "a", ds_config=small, prefetches=7, prefetch_numel=1000, in_flight=late))
    advice = found["prefetch_bucket"]
    assert advice["key"] == Z + "stage3_prefetch_bucket_size" and advice["now"] == 100
    assert advice["direction"] == "raise" and advice["suggest"] == 50_000_000
    assert advice["expected"] == {"figure": "events.forward_all_gather.count", "direction": "lower"}
    # short of the waited share; a bucket that does not stop the prefetch; fetch waits that cost nothing
    assert "prefetch_bucket" not in rules(run(tmp_path / "b", ds_config=small, prefetches=7, prefetch_numel=1000,
                                               in_flight=late - 300))
    assert "prefetch_bucket" not in rules(run(tmp_path / "c", prefetches=7, prefetch_numel=1000, in_flight=late))
    step = 100.0 + 1.0 + 2.0
    assert "prefetch_bucket" not in rules(run(tmp_path / "d", ds_config=small, prefetches=7, prefetch_numel=1000,
                                               in_flight=late, fetch_ms=FETCH_WAIT_SHARE * step * 0.9))


def test_on_demand_gathers_count_as_late_for_the_prefetch_rule(tmp_path):
    small = config(stage3_prefetch_bucket_size=100)
    assert "prefetch_bucket" in rules(run(tmp_path, ds_config=small, prefetches=7, prefetch_numel=1000,
                                          on_demand=2000))


def test_persistence_threshold_raised_for_many_small_gathers(tmp_path):
    small = 100_000 * SMALL_GATHER_FACTOR
    advice = rules(run(tmp_path / "a", gathers=MANY_SMALL_GATHERS, gather_numel=small))["persistence_threshold"]
    assert advice["key"] == Z + "stage3_param_persistence_threshold" and advice["suggest"] == 2 * small
    assert "persistence_threshold" not in rules(run(tmp_path / "b", gathers=MANY_SMALL_GATHERS - 1,
                                                    gather_numel=small))
    assert "persistence_threshold" not in rules(run(tmp_path / "c", gathers=MANY_SMALL_GATHERS,
                                                    gather_numel=small + 1))


def test_live_parameters_raised_at_the_limit_with_refetches_or_invalidations(tmp_path):
    limit = 10_000
    at = config(stage3_max_live_parameters=limit)
    live = int(LIVE_AT_LIMIT * limit)
    advice = rules(run(tmp_path / "a", ds_config=at, live=live, gathers=3))["live_parameters"]  # 3x the model
    assert advice["key"] == Z + "stage3_max_live_parameters" and advice["suggest"] == 2 * limit
    assert "stage3_max_reuse_distance" in advice["why"] and "3.0x the model gathered per step" in advice["why"]
    assert "the records hold no device capacity: check the memory peak has room" in advice["why"]
    invalidated = rules(run(tmp_path / "b", ds_config=at, live=live, invalidations=2))["live_parameters"]
    assert f"{2 * 2 * STEPS} trace-cache invalidations" in invalidated["why"]  # 2 a step, on both ranks
    assert "live_parameters" not in rules(run(tmp_path / "c", ds_config=at, live=live - 1, gathers=3))
    assert "live_parameters" not in rules(run(tmp_path / "d", ds_config=at, live=live, gathers=2))


def test_overlap_comm_set_when_gradient_collectives_stall_the_step_with_it_off(tmp_path):
    off = config(stage=2, overlap_comm=False)
    waited = 20.0  # of a step of 100 + 1 + 20 ms: past the share
    advice = rules(run(tmp_path / "a", ds_config=off, collective_ms=waited))["overlap_comm"]
    assert advice["key"] == Z + "overlap_comm" and advice["now"] is False and advice["suggest"] is True
    assert advice["expected"] == {"figure": "collective_wait_ms", "direction": "lower"}
    short = EXPOSED_REDUCE_SHARE * 101.0 * 0.9
    assert "overlap_comm" not in rules(run(tmp_path / "b", ds_config=off, collective_ms=short))
    assert "overlap_comm" not in rules(run(tmp_path / "c", ds_config=config(stage=2), collective_ms=waited))
    # the rank that waited least is held to its own step, not to the ranks' median: rank 1, late from its gap (its
    # data loading), waits 2 ms of its 23 ms step (past the share); rank 0 waits 40 ms for it (the median step, 42
    # ms, would hide the share)
    late = rules(run(tmp_path / "d", ds_config=off, busy_ms=20.0, collective_ms=(40.0, 2.0)))
    assert "2.0 ms of 23.0 ms on the rank that waited least" in late["overlap_comm"]["why"]


def test_reduce_bucket_raised_when_it_splits_the_gradients_into_many_messages(tmp_path):
    small = config(stage=2, reduce_bucket_size=MODEL // MANY_REDUCES)
    advice = rules(run(tmp_path / "a", ds_config=small, reduces=MANY_REDUCES))["bucket_sizes"]
    assert advice["key"] == Z + "reduce_bucket_size" and advice["suggest"] == MODEL
    assert advice["expected"] == {"figure": "collectives.reduce_scatter_tensor.count", "direction": "lower"}
    assert "bucket_sizes" not in rules(run(tmp_path / "b", ds_config=small, reduces=MANY_REDUCES - 1))
    large = config(stage=2, reduce_bucket_size=MODEL // MANY_REDUCES + 1)
    assert "bucket_sizes" not in rules(run(tmp_path / "c", ds_config=large, reduces=MANY_REDUCES))
    mixed = rules(run(tmp_path / "d", ds_config=small, reduces=MANY_REDUCES, all_reduces=1))["bucket_sizes"]
    assert mixed["why"].startswith(f"{MANY_REDUCES} reduce_scatter_tensor, 1 all_reduce per step:"), mixed["why"]
    many = config(stage=2, reduce_bucket_size=MODEL // 1120)  # thousands of calls a step read as counts, not 1.12e+03
    crowded = rules(run(tmp_path / "e", ds_config=many, reduces=1120, all_reduces=1))["bucket_sizes"]
    assert crowded["why"].startswith("1,120 reduce_scatter_tensor, 1 all_reduce per step:"), crowded["why"]
    assert mixed["expected"]["figure"] == "collectives.reduce_scatter_tensor.count"


def test_the_text_names_the_key_the_value_and_the_expected_figure(tmp_path):
    run(tmp_path, ds_config=config(stage3_prefetch_bucket_size=100), prefetches=7, prefetch_numel=1000,
        in_flight=7000)
    text = " ".join(render_text(build_report(tmp_path)).split())
    assert ("What to change: - raise zero_optimization.stage3_prefetch_bucket_size (now 100, try 50000000)"
            in text) and "expect events.forward_all_gather.count to go lower" in text


def test_the_diff_checks_that_following_the_advice_did_what_it_said(tmp_path):
    from ds_profutils.diff.build import build_diff
    from ds_profutils.diff.text import render_diff

    small = config(stage3_prefetch_bucket_size=100)
    run(tmp_path / "base", ds_config=small, prefetches=7, prefetch_numel=1000, in_flight=7000, gathers=7)
    run(tmp_path / "followed", prefetches=1, prefetch_numel=7000, gathers=1)
    run(tmp_path / "worse", ds_config=config(stage3_prefetch_bucket_size=200), prefetches=7, prefetch_numel=1000,
        gathers=8)
    run(tmp_path / "unchanged", ds_config=small, prefetches=7, prefetch_numel=1000, gathers=1)
    diff = build_diff(tmp_path / "base", tmp_path / "followed")
    assert diff["engines"]["main"]["advice_checked"] == [
        {"key": Z + "stage3_prefetch_bucket_size", "base": 100, "new": 50_000_000,
         "figure": "events.forward_all_gather.count", "expected": "lower", "change_pct": -100.0 * 6 / 7,
         "significant": True, "as_expected": True}]
    assert "the change did what the advice said" in " ".join(render_diff(diff).split())
    worse = build_diff(tmp_path / "base", tmp_path / "worse")
    assert [found["as_expected"] for found in worse["engines"]["main"]["advice_checked"]] == [False]
    assert "the change did NOT do what the advice said: it moved the other way" in " ".join(render_diff(worse).split())
    assert build_diff(tmp_path / "base", tmp_path / "unchanged")["engines"]["main"]["advice_checked"] == []


@pytest.mark.parametrize("change_pct, significant, says", [
    (-32.7, False, "the change moved it the expected way, within the diff's noise: not shown to help"),
    (5.0, False, "the change did not move it beyond the diff's noise"),
    (5.0, True, "the change did NOT do what the advice said: it moved the other way"),
    (None, True, "collective_wait_ms from 0 (expected lower): the change cannot be checked"),  # no share of 0
])
def test_a_move_the_diffs_test_cannot_tell_from_noise_is_said_to_show_nothing(change_pct, significant, says):
    from ds_profutils.diagnosis.checked import checked_lines

    (line, ) = checked_lines([{"key": Z + "overlap_comm", "base": False, "new": True, "figure": "collective_wait_ms",
                               "expected": "lower", "change_pct": change_pct, "significant": significant,
                               "as_expected": False}])
    assert says in line
