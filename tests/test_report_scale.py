"""The report of 1024 ranks stays readable (summaries and the worst ranks, not 1024 rows) while its JSON
holds every rank and step; the plot is drawn at 2 ranks and at 1024, with its memory panel for schema 3
records (look at them: ``--basetemp``)."""
import json

import pytest

from ds_profutils.cli import main
from ds_profutils.report import build_report, render_text

from report_testing import memory_run, slowed_run

RANKS, STEPS, SLOWED = 1024, 12, 700
HUNGRY, JUMP_STEP = 300, 6  # the rank whose peak jumps, and when


@pytest.fixture(scope="module")
def big_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ranks_1024")
    slowed_run(directory, RANKS, STEPS, SLOWED)
    return directory


def test_text_of_1024_ranks_is_a_summary_and_the_worst_ranks(big_run):
    text = render_text(build_report(big_run))
    lines = text.splitlines()
    assert len(lines) < 80, text
    assert max(len(line) for line in lines) < 160
    assert f"STRAGGLER: rank {SLOWED} (node-{SLOWED // 2}) held the others back in {STEPS} of {STEPS} steps" in text
    caption, table = text.split("\nRanks (")[1].split("\n\n")[0].split("\nrank ")
    assert "8 of 1024 ranks shown: those that held the others back most" in " ".join(caption.split())
    ranks = table.splitlines()
    assert ranks[1].split()[0] == str(SLOWED) and ranks[1].endswith("STRAGGLER")  # ranks[0]: the header
    assert [row.split()[0] + " " + row.split()[1] for row in ranks[-3:]] == ["min of", "median of", "max of"]
    assert "hosts (512): node-0 (ranks 0-1);" in text and "... 506 more ..." in text
    assert "8 of 1024 ranks shown" in text
    steps = text.split("\nSteps (across ranks, ms)")[1].split("\n\n")[0].splitlines()
    assert len(steps) == 2 + STEPS and all(row.endswith(f"rank {SLOWED}") for row in steps[2:])


def test_json_of_1024_ranks_is_complete(big_run, capsys):
    assert main(["report", str(big_run), "--json"]) == 0
    engine = json.loads(capsys.readouterr().out)["engines"]["main"]
    assert len(engine["ranks_summary"]) == RANKS
    steps = engine["steps"]
    assert steps["ranks"] == list(range(RANKS)) and steps["global_steps"] == list(range(STEPS))
    for column in ("step_ms", "fetch_wait_ms", "collective_wait_ms", "exposed_wait_ms", "busy_ms"):
        assert len(steps[column]) == RANKS and all(len(row) == STEPS and None not in row for row in steps[column])
    assert steps["straggler"] == [SLOWED] * STEPS


def hungry_peak(rank, step):
    return 2**30 + (rank % 7) * 2**20 + (2**28 if rank == HUNGRY and step >= JUMP_STEP else 0)


@pytest.fixture(scope="module")
def big_memory_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("memory_1024")
    memory_run(directory, RANKS, STEPS, hungry_peak)
    return directory


def test_memory_of_1024_ranks_is_a_summary_in_text_and_complete_in_json(big_memory_run, capsys):
    text = render_text(build_report(big_memory_run))
    assert len(text.splitlines()) < 90
    memory = text.split("\nMemory (")[1].split("\n\n")[0]
    rows = [line.split()[0] for line in memory.splitlines() if line[:1].isdigit()]
    assert rows == [str(HUNGRY), "6", "13", "20", "27", "34", "41", "0"]  # the highest peaks, then the lowest
    assert f"Highest peak: rank {HUNGRY} (node-{HUNGRY // 2})" in memory
    assert f"rank {HUNGRY} at step {JUMP_STEP}: 1.26 GiB (1.01 GiB before)" in " ".join(memory.split())
    assert main(["report", str(big_memory_run), "--json"]) == 0
    engine = json.loads(capsys.readouterr().out)["engines"]["main"]
    assert len(engine["memory"]["ranks"]) == RANKS and engine["memory"]["highest_rank"] == HUNGRY
    assert [(jump["rank"], jump["global_step"]) for jump in engine["memory"]["jumps"]] == [(HUNGRY, JUMP_STEP)]
    assert len(engine["steps"]["peak_allocated_bytes"]) == RANKS


@pytest.mark.parametrize("ranks", [2, RANKS])
def test_plot_at_2_and_1024_ranks(ranks, big_run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    directory = big_run
    if ranks == 2:
        directory = tmp_path / "two"
        directory.mkdir()
        slowed_run(directory, 2, 40, 1)
    for metric in ("exposed_wait_ms", "busy_ms"):
        png = tmp_path / f"report_{ranks}_{metric}.png"
        assert main(["report", str(directory), "--plot", str(png), "--plot-metric", metric]) == 0
        assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 20_000
        assert f"plot written to {png}" in capsys.readouterr().err


def test_plot_with_memory_at_1024_ranks(big_memory_run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "report_1024_memory.png"
    assert main(["report", str(big_memory_run), "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 20_000
