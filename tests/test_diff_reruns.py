"""``ds-profutils diff`` across reruns (several run directories per side) and by rank: the step time is the step
the job took (per step the largest over ranks), and a change on one rank reads whole on that rank."""
import json
import random
import re
from pathlib import Path

import pytest

from ds_profutils.cli import main
from ds_profutils.diff.build import build_diff
from ds_profutils.diff.text import render_diff
from ds_profutils.report import ReportError

from report_testing import iteration_record, write_records
from test_diff import write_run


def ranked_run(directory: Path, *, busy_ms=(20.0, 40.0), gap_ms=(5.0, 5.0), steps: int = 30, seed: int = 0,
               flops: float = 3e9, **extra) -> Path:
    """Two ranks whose busy time and gap between steps differ per rank (no waiting between them); ``extra``: more
    fields of every record (``model_numel``, say)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for rank in (0, 1):
        write_records(directory, rank, [row for step in range(steps) for row in iteration_record(
            rank, step, busy_ms=busy_ms[rank] + rng.uniform(0, 1), gap_ms=gap_ms[rank] + rng.uniform(0, 1),
            flops=flops, **extra)])
    return directory


def test_the_step_time_is_the_largest_over_ranks_and_the_mean_only_where_labelled(tmp_path):
    """Rank 1 is 20 ms busier than rank 0 in both runs: the step the job took is rank 1's (~40 ms), not the
    ~30 ms no rank had; the mean over ranks is kept beside the parts, labelled."""
    diff = build_diff(ranked_run(tmp_path / "base"), ranked_run(tmp_path / "new", seed=1))
    engine = diff["engines"]["main"]
    ranks = engine["ranks"]
    assert engine["step_ms"]["base"] == pytest.approx(ranks[1]["base"]["step_ms"], abs=1.0)
    assert engine["step_ms"]["base"] - engine["step_ms_mean_over_ranks"]["base"] == pytest.approx(10.0, abs=1.0)
    assert set(ranks[1]["base"]) >= {"step_ms", "iteration_ms", "gap_ms", "busy_ms"}
    text = " ".join(render_diff(diff).split())
    assert (f"Step time (per step the largest over ranks: the step the job took): {engine['step_ms']['base']:.3f} "
            in text)
    assert f"step, mean over ranks {engine['step_ms_mean_over_ranks']['base']:.3f}" in text


def test_a_gap_change_on_one_rank_reads_whole_on_that_rank(tmp_path):
    """NEW's rank 1 spends 50 ms more between steps (its data loader): the gap, largest over ranks, is +50 ms,
    and the Where line and the Ranks table put +50 on rank 1 (the mean over two ranks would say +25)."""
    diff = build_diff(ranked_run(tmp_path / "base", busy_ms=(20.0, 20.0)),
                      ranked_run(tmp_path / "new", busy_ms=(20.0, 20.0), gap_ms=(5.0, 55.0), seed=1))
    engine = diff["engines"]["main"]
    gap = engine["iteration"]["gap_ms"]
    assert gap["significant"] and gap["change"] == pytest.approx(50.0, abs=1.5)
    assert engine["where"]["gap_ms"][0]["rank"] == 1
    assert engine["where"]["gap_ms"][0]["change"] == pytest.approx(50.0, abs=1.5)
    assert engine["ranks"][1]["change"]["gap_ms"] == pytest.approx(50.0, abs=1.5)
    assert engine["ranks"][0]["change"]["gap_ms"] == pytest.approx(0.0, abs=1.5)
    text = " ".join(render_diff(diff).split())
    assert re.search(r"gap: rank 1 \+(49|50|51)\.\d+", text)
    assert "gap change" in text and "+25." not in text


def test_tflops_in_the_diff_are_in_a_readable_unit(tmp_path):
    """A CPU job's 0.0001 TFLOP/s is 100 GFLOP/s, not 0.00."""
    diff = build_diff(ranked_run(tmp_path / "base", flops=3e9), ranked_run(tmp_path / "new", flops=1.5e9, seed=1))
    text = " ".join(render_diff(diff).split())
    assert re.search(r"TFLOP/s per rank, mean over ranks \d+(\.\d+)? GFLOP/s -> \d+(\.\d+)? GFLOP/s \(LOWER", text)


def test_several_runs_per_side_by_commas_or_a_file_are_tested_between_runs(tmp_path, capsys):
    base = [write_run(tmp_path / f"base{i}", seed=i) for i in range(3)]
    new = [write_run(tmp_path / f"new{i}", busy_ms=24.0, seed=10 + i) for i in range(3)]
    listing = tmp_path / "new.txt"
    listing.write_text("# NEW's reruns\n" + "\n".join(map(str, new)) + "\n\n")
    assert main(["diff", ", ".join(map(str, base)), f"@{listing}", "--json"]) == 0  # spaces as typed after commas
    diff = json.loads(capsys.readouterr().out)
    assert [notes["directory"] for notes in diff["base"]] == list(map(str, base))
    assert [notes["directory"] for notes in diff["new"]] == list(map(str, new))
    engine = diff["engines"]["main"]
    assert engine["runs"] == {"base": 3, "new": 3} and engine["steps"] == {"base": 90, "new": 90}
    step_ms = engine["step_ms"]
    assert step_ms["method"] == "between runs" and step_ms["alpha"] == 0.05 and step_ms["runs"] == {"base": 3, "new": 3}
    assert step_ms["significant"] and step_ms["change"] == pytest.approx(4.0, abs=1.0)
    assert len(engine["series"]["base"]) == 3
    assert diff["test"]["sees"] == "beyond the spread between reruns"
    assert main(["diff", ",".join(map(str, base)), f"@{listing}"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "SLOWER, beyond the spread between reruns" in text and "in 3 runs" in text
    assert text.startswith(f"ds-profutils diff: BASE 3 runs ({', '.join(map(str, base))})")


def test_one_run_per_side_says_what_it_cannot_see(tmp_path):
    diff = build_diff(write_run(tmp_path / "base"), write_run(tmp_path / "new", busy_ms=24.0, seed=1))
    assert diff["engines"]["main"]["step_ms"]["method"] == "within runs"
    text = " ".join(render_diff(diff).split())
    assert ("SLOWER, beyond within-run noise (one run per side: this sees changes beyond within-run noise; offsets "
            "between nodes or reruns need several runs per side)") in text


def test_a_list_of_runs_that_names_none_or_cannot_be_read_is_a_clear_error(tmp_path, capsys):
    base = write_run(tmp_path / "base")
    (tmp_path / "empty.txt").write_text("# nothing\n")
    assert main(["diff", str(base), f"@{tmp_path / 'empty.txt'}"]) == 1
    assert "names no directory" in capsys.readouterr().err
    assert main(["diff", str(base), f"@{tmp_path / 'missing.txt'}"]) == 1
    assert "cannot read the list of runs" in capsys.readouterr().err
    with pytest.raises(ReportError):
        build_diff([base, tmp_path / "missing"], [base])


def test_runs_without_fetch_events_get_no_fetch_wait_row_or_column(tmp_path):
    """Step-metrics jobs (ZeRO-0/1/2) record no fetches: no fetch wait row in the parts, no column in the ranks."""
    text = render_diff(build_diff(ranked_run(tmp_path / "base", gap_ms=(5.0, 5.0)),
                                  ranked_run(tmp_path / "new", seed=1)))
    assert "fetch wait" in text  # iteration_record's records are fetch records
    for directory in ("base2", "new2"):
        ranked_run(tmp_path / directory)
        for path in (tmp_path / directory).iterdir():
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            path.write_text("".join(json.dumps(dict(row, events={})) + "\n" for row in rows))
    text = render_diff(build_diff(tmp_path / "base2", tmp_path / "new2"))
    assert "fetch wait" not in text and "collective wait change" in text and "gap change" in text


@pytest.mark.parametrize("order", ["rerun first", "other model first"])
def test_a_side_whose_runs_are_no_reruns_of_one_configuration_is_said_whatever_their_order(tmp_path, order):
    """A side pools its runs as reruns of one configuration: a run of another model (or world size) among them is
    named, on the side that has it, whichever run comes first."""
    rerun, other = (ranked_run(tmp_path / name, seed=seed, model_numel=numel)
                    for name, seed, numel in (("rerun", 1, 1_000_000), ("other", 2, 999_999)))
    base_runs = [rerun, other] if order == "rerun first" else [other, rerun]
    diff = build_diff(base_runs, [ranked_run(tmp_path / f"new{seed}", seed=seed, model_numel=1_000_000)
                                  for seed in (3, 4)])
    (warning, ) = [warning for warning in diff["warnings"] if "no rerun" in warning]
    first, second = (str(run) for run in base_runs)
    assert warning.startswith(f"BASE: {second} is no rerun of {first} (engine main: model_numel ")
    assert "WARNING: BASE: " in render_diff(diff)


def test_an_engine_some_runs_of_a_side_lack_is_named_with_those_runs_not_as_on_one_side_only(tmp_path):
    """A rerun of BASE recorded another engine only (a critic, say): BASE's main is not in every run, so it is not
    compared, and NEW's main is no engine of NEW alone."""
    runs = [ranked_run(tmp_path / f"base{index}", seed=index) for index in range(2)]
    other = tmp_path / "critic_only"
    other.mkdir()
    for rank in (0, 1):
        write_records(other, rank, [row for step in range(30) for row in iteration_record(rank, step)], engine="critic")
    diff = build_diff([*runs, other], [ranked_run(tmp_path / f"new{index}", seed=5 + index) for index in range(2)])
    assert diff["unmatched"] == {"base": [], "new": []} and diff["engines"] == {}
    assert diff["partial"] == {"base": {"main": [str(other)], "critic": [str(runs[0]), str(runs[1])]}, "new": {}}
    text = " ".join(render_diff(diff).split())
    assert f"Not compared: engine main, missing from BASE's run {other}" in text and "Only in NEW" not in text
