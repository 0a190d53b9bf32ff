"""``ds-profutils diff BASE NEW`` on generated runs: a change beyond noise is found and put where it happened,
noise is not called a change, and the output says what the test and the warm-up rule were."""
import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ds_profutils.cli import main
from ds_profutils.report import ReportError
from ds_profutils.diff.build import build_diff
from ds_profutils.diff.stats import compare, unchanged_words, warmup_steps
from ds_profutils.diff.student import t_two_sided_p
from ds_profutils.diff.text import render_diff

from report_testing import event, record, write_records, write_trace

MIB = 2**20


def schema3(rank: int, step: int, peak: int, *, source: str = "allocator", collective_ms: float = 2.0,
            **extra) -> dict:
    """A schema-3 record (/work/wt/SPEC_RECORDS.md) with a memory peak, as on CPU/gloo: time inside the
    collectives equals the blocking collective wait."""
    row = record(rank, step, schema=3, collective_ms=collective_ms, live_params_max=1600, max_live_parameters=10**9,
                 trace_cache_invalidations=0, prefetch={"hits": 2, "waited": 1},
                 memory={"source": source, "peak_allocated_bytes": peak, "peak_reserved_bytes": peak + MIB,
                         "phases": {"forward": peak // 2, "backward": peak, "step": peak // 2}}, **extra)
    row["collective_ms"] = collective_ms  # record() takes it as the blocking collective wait
    return row


def write_run(directory: Path, *, ranks: int = 2, steps: int = 30, busy_ms: float = 20.0, slowed=None,
              slow_ms: float = 0.0, jitter_ms: float = 1.0, seed: int = 0, engine: str = "main",
              memory_bytes=None, **extra) -> Path:
    """A run of ``steps`` steps per rank; ``slowed`` spends ``slow_ms`` more outside the collectives, so the
    other ranks wait that long in the gradient collective.  ``memory_bytes(rank, step)``: schema-3 records
    with that memory peak (else schema 2)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for rank in range(ranks):
        rows = []
        for step in range(steps):
            fields = dict(extra, engine=engine, world_size=ranks,
                          busy_ms=busy_ms + rng.uniform(0, jitter_ms) + (slow_ms if rank == slowed else 0.0),
                          collective_ms=2.0 + rng.uniform(0, jitter_ms)
                          + (slow_ms if slowed is not None and rank != slowed else 0.0))
            rows.append(record(rank, step, **fields) if memory_bytes is None
                        else schema3(rank, step, memory_bytes(rank, step), **fields))
        write_records(directory, rank, rows, engine=engine)
    return directory


# --------------------------------------------------------------------------------------------------
# the test and the warm-up rule
# --------------------------------------------------------------------------------------------------


def test_the_t_tail_matches_closed_forms_and_reference_values():
    """df 1 is Cauchy (p = 1 - 2 atan(t) / pi), df 2 has p = 1 - t / sqrt(t^2 + 2); scipy 1.17.1's
    ``2 * t.sf(2.0, 5)`` and the normal limit."""
    for value in (0.5, 1.0, 3.0, 30.0):
        assert t_two_sided_p(value, 1.0) == pytest.approx(1 - 2 * math.atan(value) / math.pi, rel=1e-10)
        assert t_two_sided_p(value, 2.0) == pytest.approx(1 - value / math.sqrt(value ** 2 + 2), rel=1e-10)
    assert t_two_sided_p(2.0, 5.0) == pytest.approx(0.10193947882985835, rel=1e-10)
    assert t_two_sided_p(1.959963984540054, 1e7) == pytest.approx(0.05, rel=1e-5)
    assert t_two_sided_p(0.0, 7.5) == 1.0


def test_a_few_steps_after_warm_up_are_needed_to_call_a_change():
    """A run's correlation needs 3 steps to be estimated: a run of 2 steps after warm-up is never tested; 3 steps
    alternating (no drift), every NEW step 10 ms slower, are a change, also beside thousands."""
    assert compare([20.0, 21.0], [30.0, 31.0])["p_value"] is None
    assert compare([20.0 + i % 2 for i in range(3)], [30.0 + i % 2 for i in range(3)])["significant"]
    assert compare([20.0, 21.0], [30.0 + i % 7 for i in range(5000)])["p_value"] is None
    assert compare([20.0, 21.0, 20.0], [30.0 + i % 7 for i in range(5000)])["significant"]


def test_a_steady_trend_within_each_run_is_taken_for_drift_not_for_independent_steps():
    """BASE 20, 21, ... 27 and NEW 30, 31, ... 37: each run is one slow drift, a single independent look, too
    few to call a change, which Mann-Whitney's U (p = 0.0008, steps taken for independent) did."""
    found = compare([20.0 + i for i in range(8)], [30.0 + i for i in range(8)])
    assert not found["significant"] and found["effective_steps"] == {"base": 1.0, "new": 1.0}
    # and the verdict says the test could see only very large changes there, not that nothing changed
    assert unchanged_words(found) == ("no significant change, but with 1.0 and 1.0 effective steps (the steps drift "
                                      "together) the test sees only very large changes: record longer runs")
    steady = compare([20.0 + i % 2 for i in range(8)], [20.0 + (i + 1) % 2 for i in range(8)])
    assert not steady["significant"] and unchanged_words(steady) == "no significant change"


@pytest.mark.parametrize("steps, left_out", [(0, 0), (2, 2), (5, 2), (20, 2), (21, 3), (30, 3), (100, 10), (1000, 100)])
def test_warm_up_is_the_first_2_steps_or_10_percent_whichever_is_more(steps, left_out):
    assert warmup_steps(steps) == left_out


def test_noise_is_called_a_change_in_fewer_than_1_in_100_pairs_of_unchanged_runs():
    """1000 pairs of runs of one job (30 steps, step times jittering +-10 %, a slow step now and then)."""
    rng = random.Random(11)

    def run():
        return [25.0 * rng.uniform(0.9, 1.1) + (40.0 if rng.random() < 0.05 else 0.0) for _ in range(27)]

    called = sum(compare(run(), run())["significant"] for _ in range(1000))
    assert called < 10


def test_a_5_percent_slower_run_is_found_and_a_1_percent_shift_is_not_called_a_change():
    rng = random.Random(5)
    base = [25.0 * rng.uniform(0.97, 1.03) for _ in range(200)]
    slower = [25.0 * 1.05 * rng.uniform(0.97, 1.03) for _ in range(200)]
    found = compare(base, slower)
    assert found["significant"] and found["p_value"] < 1e-6 and found["ratio"] == pytest.approx(1.05, abs=0.01)
    shifted = [value * 1.01 for value in base]  # the test alone finds it (200 steps); below 2 % it is not a change
    small = compare(base, shifted)
    assert small["p_value"] < 0.01 and not small["significant"]


# --------------------------------------------------------------------------------------------------
# a slowed rank: the change, where it went, the straggler before and after
# --------------------------------------------------------------------------------------------------


def test_a_slowed_rank_is_a_slower_step_put_on_the_others_waits_and_named_straggler_only_in_new(tmp_path):
    base = write_run(tmp_path / "base")
    new = write_run(tmp_path / "new", slowed=1, slow_ms=20.0, seed=1)
    diff = build_diff(base, new)
    engine = diff["engines"]["main"]
    assert engine["step_ms"]["significant"] and engine["step_ms"]["change"] == pytest.approx(20.0, abs=1.5)
    assert engine["step_ms"]["ratio"] > 1.5
    # The means of the parts add up to the step's mean over ranks: half the ranks got busier, the other half waited.
    parts, step_mean = engine["parts"], engine["step_ms_mean_over_ranks"]
    assert sum(parts[part]["mean"]["new"] - parts[part]["mean"]["base"] for part in parts) == pytest.approx(
        step_mean["mean"]["new"] - step_mean["mean"]["base"])
    assert parts["collective_wait_ms"]["significant"] and parts["busy_ms"]["significant"]
    assert not parts["fetch_wait_ms"]["significant"]
    assert [moved["rank"] for moved in engine["where"]["collective_wait_ms"]][:1] == [0]
    assert [moved["rank"] for moved in engine["where"]["busy_ms"]][:1] == [1]
    assert engine["ranks"][0]["change"]["collective_wait_ms"] == pytest.approx(20.0, abs=1.5)
    assert engine["ranks"][1]["change"]["busy_ms"] == pytest.approx(20.0, abs=1.5)
    assert engine["straggler"]["base"] == [] and engine["straggler"]["new"] == [1]
    text = render_diff(diff)
    flat = " ".join(text.split())
    assert "SLOWER, beyond within-run noise" in flat
    assert "Straggler (the report's verdict): BASE none; NEW rank 1 (the step straggler in 30 of 30 steps)" in flat
    assert re.search(r"busy: rank 1 \+(19|20)\.\d+; collective wait: rank 0 \+(19|20)\.\d+", flat)


def test_two_runs_of_the_unchanged_job_show_no_significant_change(tmp_path):
    diff = build_diff(write_run(tmp_path / "a", seed=2), write_run(tmp_path / "b", seed=3))
    engine = diff["engines"]["main"]
    assert not engine["step_ms"]["significant"]
    assert not any(part["significant"] for part in engine["parts"].values()) and engine["where"] == {}
    assert engine["straggler"] == {"base": [], "new": [], "hosts": {"base": [], "new": []},
                                   "straggler_steps": {"base": {}, "new": {}}, "runs": {"base": [[]], "new": [[]]}}
    assert "no significant change" in render_diff(diff)


def test_warm_up_steps_are_left_out_of_every_figure(tmp_path):
    """NEW's first 3 of 30 steps are 10x slower (compiling, allocating): its figures after warm-up are BASE's."""
    base = write_run(tmp_path / "base", seed=4)
    new = write_run(tmp_path / "new", seed=4)
    for rank in (0, 1):
        path = new / f"zero_fetch_rank_{rank}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for row in rows[:3]:
            row["step_time_ms"] *= 10
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    engine = build_diff(base, new)["engines"]["main"]
    assert engine["warmup_steps"] == {"base": 3, "new": 3}
    assert engine["step_ms"]["steps"] == {"base": 27, "new": 27}
    assert engine["step_ms"]["mean"]["new"] == pytest.approx(engine["step_ms"]["mean"]["base"])
    assert engine["series"]["new"]["step_ms"][0] > 200  # kept in the series (the plot shades it)


# --------------------------------------------------------------------------------------------------
# memory, events, settings, operators
# --------------------------------------------------------------------------------------------------


def test_a_higher_memory_peak_is_its_own_change_on_the_rank_it_grew(tmp_path):
    base = write_run(tmp_path / "base", memory_bytes=lambda rank, step: 800 * MIB + step * 1024)
    new = write_run(tmp_path / "new", seed=1,
                    memory_bytes=lambda rank, step: (1000 if rank == 1 else 800) * MIB + step * 1024)
    engine = build_diff(base, new)["engines"]["main"]
    memory = engine["parts"]["peak_allocated_bytes"]
    assert memory["significant"] and memory["base"] == pytest.approx(800 * MIB, rel=1e-4)
    assert memory["new"] == pytest.approx(1000 * MIB, rel=1e-4)  # per step the highest rank's peak
    assert not engine["step_ms"]["significant"]
    assert engine["where"]["peak_allocated_bytes"][0] == {"rank": 1, "change": pytest.approx(200 * MIB)}
    text = render_diff(build_diff(base, new))
    assert "memory peak MiB (highest rank)" in text
    assert "memory peak MiB (highest rank): rank 1 +200.000" in " ".join(text.split())


def test_memory_peak_of_a_step_is_the_highest_of_its_micro_steps(tmp_path):
    """Gradient accumulation: two records per global step; the step's peak is the larger, not the sum."""
    for run, grown in (("base", 0), ("new", 100 * MIB)):
        (tmp_path / run).mkdir()
        for rank in (0, 1):
            rows = []
            for step in range(20):
                for micro, peak in enumerate((500 * MIB, 600 * MIB + grown)):
                    rows.append(schema3(rank, step, peak, source="rss", micro_step=2 * step + micro))
            write_records(tmp_path / run, rank, rows)
    memory = build_diff(tmp_path / "base", tmp_path / "new")["engines"]["main"]["parts"]["peak_allocated_bytes"]
    assert (memory["base"], memory["new"]) == (600 * MIB, 700 * MIB)


def test_records_without_memory_say_so_and_compare_the_rest(tmp_path):
    base = write_run(tmp_path / "base")
    new = write_run(tmp_path / "new", memory_bytes=lambda rank, step: 100 * MIB)
    engine = build_diff(base, new)["engines"]["main"]
    assert "peak_allocated_bytes" not in engine["parts"] and engine["memory"] == {"base": False, "new": True}
    assert "No memory peak: the records of BASE carry no memory figures." in render_diff(build_diff(base, new))


def test_a_bigger_prefetch_bucket_shows_as_fewer_larger_gathers_first_in_the_events(tmp_path):
    def events(gathers):
        return {"forward_fetch_wait": event(4, 800, 1.0), "backward_fetch_wait": event(4, 800, 1.0),
                "forward_all_gather": event(gathers, 1600, 1.0, unit="full")}

    base = write_run(tmp_path / "base", events=events(4))
    new = write_run(tmp_path / "new", events=events(1), seed=1)
    engine = build_diff(base, new)["engines"]["main"]
    first, row = next(iter(engine["events"].items()))
    assert first == "forward_all_gather" and row["size_change"] == pytest.approx(3.0)
    assert (row["base"]["count"], row["new"]["count"]) == (4, 1)
    assert (row["base"]["numel_per_event"], row["new"]["numel_per_event"]) == (400, 1600)
    assert all(other["size_change"] == 0 for name, other in engine["events"].items() if name != first)
    table = render_diff(build_diff(base, new)).split("Fetch events per train step")[1].splitlines()
    first_row = next(line.split() for line in table if line.startswith("forward_all_gather"))
    assert first_row[:8] == ["forward_all_gather", "full", "4", "1", "400", "1,600", "6,400", "6,400"]


def test_settings_that_differ_are_listed(tmp_path):
    base = write_run(tmp_path / "base", ranks=2, memory_bytes=lambda rank, step: MIB)
    new = write_run(tmp_path / "new", ranks=4, memory_bytes=lambda rank, step: MIB, dtype="bfloat16")
    for directory, version, pid in ((base, "12.4", 4242), (new, "12.8", 4343)):
        write_trace(directory / "trace_rank_0.json", {step: 20.0 for step in range(3)})
        text = (directory / "trace_rank_0.json").read_text().replace('"pid": 1,',
                                                                     f'"pid": {pid}, "run_id": "r{pid}",', 1)
        (directory / "trace_rank_0.json").write_text(text.replace('{"distributedInfo"', '{"cuda_runtime_version": '
                                                                  f'"{version}", "distributedInfo"', 1))
    diff = build_diff(base, new)
    differing = {row["setting"]: (row["base"], row["new"]) for row in diff["engines"]["main"]["settings"]}
    assert differing == {"world size": (2, 4), "ranks with records": (2, 4), "dtype": ("float32", "bfloat16")}
    # The process of each trace, and the run its files belong to, differ too: not settings.
    assert diff["trace_settings"] == [{"setting": "cuda_runtime_version", "base": "12.4", "new": "12.8"}]
    text = " ".join(render_diff(diff).split())
    assert "Settings that differ: world size 2 -> 4; ranks with records 2 -> 4; dtype float32 -> bfloat16" in text
    assert "Trace settings that differ: cuda_runtime_version 12.4 -> 12.8" in text


def nested_trace(path: Path, addmm_us: float, *, steps: int = 2, reverse: bool = False) -> None:
    """``aten::linear`` holding ``aten::addmm`` (and a sibling ``aten::relu``) each step, on one thread."""
    events = []
    for step in range(steps):
        start = step * 1000.0
        events += [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "ts": start, "dur": 900.0,
                    "pid": 1, "tid": 1},
                   {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "ts": start + 10, "dur": addmm_us + 20,
                    "pid": 1, "tid": 1},
                   {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "ts": start + 20, "dur": addmm_us,
                    "pid": 1, "tid": 1},
                   {"ph": "X", "cat": "cpu_op", "name": "aten::relu", "ts": start + 500, "dur": 30.0,
                    "pid": 1, "tid": 1}]
    if reverse:
        events.reverse()
    head = {"ds_profutils": {"rank": 0, "world_size": 1, "host": "node-a", "step_numbering": "global",
                             "profiled_ranks": None}, "baseTimeNanoseconds": 1790000000000000000}
    path.write_text(json.dumps(head)[:-1] + ', "traceEvents": [\n' + ",\n".join(map(json.dumps, events)) + "\n]}\n")


@pytest.mark.parametrize("reverse", [False, True], ids=["in order", "written backwards"])
def test_operators_whose_self_time_changed_most_come_from_the_traces(tmp_path, reverse):
    """addmm doubles; linear's own time (around addmm) does not change, though its inclusive time does."""
    for run, addmm_us in (("base", 80.0), ("new", 160.0)):
        (tmp_path / run).mkdir()
        nested_trace(tmp_path / run / "trace_rank_0.json", addmm_us, reverse=reverse)
    operators = build_diff(tmp_path / "base", tmp_path / "new")["operators"]
    assert operators["rank"] == 0 and operators["steps"] == {"base": 2, "new": 2}
    rows = {row["name"]: row for row in operators["ops"]}
    assert operators["ops"][0]["name"] == "aten::addmm"
    assert rows["aten::addmm"]["change_ms"] == pytest.approx(0.08)
    assert rows["aten::addmm"]["new"] == {"count": 1.0, "self_ms": pytest.approx(0.16)}
    assert rows["aten::linear"]["change_ms"] == pytest.approx(0.0) and rows["aten::linear"]["base"]["self_ms"] == \
        pytest.approx(0.02)
    assert "ProfilerStep#0" not in rows and operators["late_events"] == {"base": 0, "new": 0}


def test_events_later_than_the_reorder_window_are_counted_not_nested(tmp_path, monkeypatch):
    from ds_profutils.diff import ops as diff_ops

    monkeypatch.setattr(diff_ops, "REORDER_WINDOW", 1)
    nested_trace(tmp_path / "trace.json", 80.0, steps=3, reverse=True)
    times = diff_ops.self_times(tmp_path / "trace.json")
    assert times.late > 0
    assert sum(self_ms for _, self_ms in times.ops.values()) > 3 * (100 + 30) / 1e3  # nothing lost, some counted twice


# --------------------------------------------------------------------------------------------------
# engines, errors, the command line
# --------------------------------------------------------------------------------------------------


def test_engines_are_matched_by_name_and_the_others_listed(tmp_path):
    for run in ("base", "new"):
        write_run(tmp_path / run)
        write_run(tmp_path / run, engine="critic" if run == "base" else "reward")
    diff = build_diff(tmp_path / "base", tmp_path / "new")
    assert list(diff["engines"]) == ["main"] and diff["matched_by"] == "name"
    assert diff["unmatched"] == {"base": ["critic"], "new": ["reward"]}
    assert "Only in BASE, not compared: engine critic" in render_diff(diff)


def test_the_only_engine_of_each_run_is_compared_whatever_its_name(tmp_path):
    write_run(tmp_path / "base")
    write_run(tmp_path / "new", engine="tuned", slowed=0, slow_ms=10.0)
    diff = build_diff(tmp_path / "base", tmp_path / "new")
    assert diff["matched_by"] == "the only engine of each run"
    assert diff["engines"]["main"]["engine"] == {"base": "main", "new": "tuned"}
    text = render_diff(diff)
    assert "Engines: main of BASE compared with tuned of NEW (the only engine of each run)." in text
    assert "== engine main (BASE) / tuned (NEW)" in text


def test_a_directory_with_no_run_or_several_is_a_clear_error(tmp_path, capsys):
    write_run(tmp_path / "base")
    assert main(["diff", str(tmp_path / "base"), str(tmp_path / "missing")]) == 1
    assert capsys.readouterr().err == f"ds-profutils diff: {tmp_path / 'missing'}: no such directory\n"
    for run in ("a", "b"):
        write_run(tmp_path / "runs" / run)
    with pytest.raises(ReportError, match="its subdirectories a, b hold runs: name one of them"):
        build_diff(tmp_path / "runs", tmp_path / "base")


def test_json_is_the_diff_alone_with_the_documented_keys(tmp_path, capsys):
    base = write_run(tmp_path / "base")
    new = write_run(tmp_path / "new", slowed=1, slow_ms=20.0, seed=1)
    assert main(["diff", str(base), str(new), "--json"]) == 0
    out = capsys.readouterr().out
    diff = json.loads(out)
    engine = diff["engines"]["main"]
    assert set(engine["step_ms"]) >= {"base", "new", "ratio", "significant"}
    assert engine["step_ms"]["significant"] is True and engine["step_ms"]["ratio"] > 1.5
    assert engine["straggler"]["base"] == [] and engine["straggler"]["new"] == [1]
    assert set(engine["parts"]) == {"busy_ms", "fetch_wait_ms", "collective_wait_ms"}
    assert engine["ranks"]["0"]["change"]["collective_wait_ms"] == pytest.approx(20.0, abs=1.5)
    assert diff["test"]["alpha"] == 0.01 and diff["test"]["min_change"] == 0.02
    assert len(engine["series"]["base"]["step_ms"]) == 30
    docs = Path(__file__).resolve().parent.parent / "docs" / "report.md"
    documented = docs.read_text().split("## `ds-profutils diff")[1]
    for key in [*diff, *engine, *engine["step_ms"]]:
        assert f"`{key}`" in documented, key


def test_many_ranks_show_those_whose_change_differs_from_the_typical_rank(tmp_path):
    base = write_run(tmp_path / "base", ranks=64, steps=12)
    new = write_run(tmp_path / "new", ranks=64, steps=12, slowed=40, slow_ms=15.0, seed=1)
    text = render_diff(build_diff(base, new), max_ranks=5)
    table = text.split("\nRanks (")[1].split("\n\n")[0].splitlines()
    assert "5 of 64 ranks shown: those whose change differs most from the typical rank's" in \
        " ".join(" ".join(table[0:2]).split())
    rows = [line.split() for line in table if line[:1].isdigit()]
    # Every rank's step is 15 ms longer; rank 40 got busier where the others waited: it is shown first.
    assert len(rows) == 5 and rows[[row[0] for row in rows].index("40")][-1] == "STRAGGLER"
    typical = table[-1].split()
    assert typical[:5] == ["median", "of", "all", "-", "-"]
    step, busy, fetch, collective = map(float, typical[5:])
    assert step == pytest.approx(15.0, abs=1.0) and busy == pytest.approx(0.0, abs=1.0)
    assert collective == pytest.approx(15.0, abs=1.0)


def test_plot_draws_both_runs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    base = write_run(tmp_path / "base")
    new = write_run(tmp_path / "new", slowed=1, slow_ms=20.0, seed=1)
    png = tmp_path / "diff.png"
    assert main(["diff", str(base), str(new), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().err == f"ds-profutils diff: plot written to {png}\n"


def test_plot_needs_matplotlib_and_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    base = write_run(tmp_path / "base")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["diff", str(base), str(base), "--plot", str(tmp_path / "diff.png")]) == 1
    assert "pip install 'ds-profutils[plot]'" in capsys.readouterr().err


def test_the_command_imports_no_torch_and_prints_only_the_diff(tmp_path):
    base = write_run(tmp_path / "base")
    new = write_run(tmp_path / "new", seed=1)
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "ds_profutils", "diff", str(base), str(new)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines()
              if line.startswith("import time:")}
    assert not loaded & {"torch", "deepspeed", "pydantic", "numpy", "scipy", "matplotlib"}
    assert done.stdout.startswith(f"ds-profutils diff: BASE {base} -> NEW {new}\n")

