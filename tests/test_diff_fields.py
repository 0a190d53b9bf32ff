"""``ds-profutils diff`` on the fields later writers add: the model's size (a WARNING first where it differs) and
the whole iteration (what a user's iteration lost, the step against the gap between steps, TFLOP/s and MFU)."""
import json
import random
import re
from pathlib import Path

import pytest

from ds_profutils.diff.build import build_diff
from ds_profutils.diff.text import render_diff

from report_testing import iteration_record, write_records
from test_diff import write_run


def iteration_run(directory: Path, *, gap_ms: float, model_numel: int = 1_000_000, steps: int = 30, seed: int = 0):
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for rank in (0, 1):
        write_records(directory, rank, [row for step in range(steps) for row in iteration_record(
            rank, step, busy_ms=20.0 + rng.uniform(0, 1), gap_ms=gap_ms + rng.uniform(0, 1), model_numel=model_numel,
            peak_tflops=100.0)])
    return directory


def test_models_of_different_sizes_are_a_warning_at_the_top_and_a_setting(tmp_path):
    """A 2-layer and a 3-layer model: the diff says first that it compares two different jobs."""
    base = iteration_run(tmp_path / "base", gap_ms=5.0, model_numel=2_100_000)
    new = iteration_run(tmp_path / "new", gap_ms=5.0, model_numel=3_150_000, seed=1)
    diff = build_diff(base, new)
    assert {"setting": "model_numel", "base": 2_100_000, "new": 3_150_000} in diff["engines"]["main"]["settings"]
    assert diff["warnings"] == ["engine main: the runs trained models of different sizes (model_numel 2,100,000 -> "
                                "3,150,000): this compares two different jobs"]
    lines = render_diff(diff).splitlines()
    assert lines[1].startswith("WARNING: engine main: the runs trained models of different sizes")
    same = build_diff(base, iteration_run(tmp_path / "same", gap_ms=5.0, model_numel=2_100_000, seed=2))
    assert same["warnings"] == [] and "WARNING" not in render_diff(same)
    assert not any(s["setting"] == "model_numel" for s in same["engines"]["main"]["settings"])


def test_records_without_model_numel_give_no_warning(tmp_path):
    diff = build_diff(write_run(tmp_path / "base"), write_run(tmp_path / "new", seed=1))
    assert diff["warnings"] == [] and diff["engines"]["main"]["iteration"] == {}


def test_the_headline_says_what_the_iteration_lost_when_the_time_went_between_steps(tmp_path):
    """NEW spends 100 ms more between steps (a callback sleeping): the step does not move, the iteration does."""
    diff = build_diff(iteration_run(tmp_path / "base", gap_ms=5.0), iteration_run(tmp_path / "new", gap_ms=105.0, seed=1))
    engine = diff["engines"]["main"]
    iteration = engine["iteration"]
    assert not engine["step_ms"]["significant"]
    assert iteration["iteration_ms"]["significant"] and iteration["iteration_ms"]["change"] == pytest.approx(100.0, abs=1.5)
    assert iteration["gap_ms"]["significant"] and iteration["gap_ms"]["change"] == pytest.approx(100.0, abs=1.5)
    assert iteration["tflops"]["significant"] and iteration["tflops"]["change"] < 0
    assert iteration["mfu"]["new"] == pytest.approx(iteration["tflops"]["new"] / 100.0)
    text = " ".join(render_diff(diff).split())
    assert "Iteration (end of one optimizer step to the end of the next: what each step cost the user" in text
    assert re.search(r"ms median \(\+\d+\.\d+ ms, \+\d+\.\d%; p = [^)]+\): SLOWER, beyond within-run noise; the step "
                     r"[+-]\d+\.\d+ ms and the gap between steps \(outside forward, backward and step; largest over "
                     r"ranks\) \+\d+\.\d+ ms \(SLOWER, beyond within-run noise\); TFLOP/s per rank, mean over ranks "
                     r"\d\S* [TGM]FLOP/s -> \d\S* [TGM]FLOP/s \(LOWER, beyond within-run noise\); MFU", text)
    assert "0.00 ->" not in text and "-> 0.00" not in text


def test_a_resumed_run_is_compared_on_its_latest_records_and_says_so(tmp_path):
    """NEW restarted from step 10 after recording 0-19: steps 10-19 recorded twice; the diff compares 20 steps of
    single step times (no doubled step), as BASE's, and says how many records it left out."""
    from report_testing import record

    base = write_run(tmp_path / "base", steps=20)
    new = write_run(tmp_path / "new", steps=20, seed=1)
    for rank in (0, 1):  # the restarted process appends steps 10-19 again
        with open(new / f"zero_fetch_rank_{rank}.jsonl", "a") as out:
            out.writelines(json.dumps(record(rank, step, busy_ms=20.5, collective_ms=2.5)) + "\n" for step in range(10, 20))
    diff = build_diff(base, new)
    engine = diff["engines"]["main"]
    assert diff["new"]["superseded"] == 20 and diff["base"]["superseded"] == 0
    assert engine["steps"]["new"] == 20 and not engine["step_ms"]["significant"]
    assert engine["step_ms"]["new"] == pytest.approx(24.0, abs=1.0)  # one run's step, not two added
    assert "NEW: resumed: 20 records of steps recorded again later superseded" in " ".join(render_diff(diff).split())
