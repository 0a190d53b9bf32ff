"""``ds-profutils check-config``: accepts the example configs, rejects bad ones with one line per problem."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ds_profutils.cli import EXIT_INVALID, main
from ds_profutils.config.command import EFFECTS_HEADER
from ds_profutils.config.errors import show_value
from report_testing import record, write_records, write_trace

REPO = Path(__file__).resolve().parent.parent
DS_CONFIGS = sorted((REPO / "ds_configs").glob("*.json"))


def run_module(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds_profutils", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


@pytest.fixture
def bad_config(tmp_path) -> Path:
    path = tmp_path / "bad.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 1,\n'
                    ' "profiler": {"active": 0, "activ": 3, "ranks": [0, -1]},\n'
                    ' "nvtx": {"enabled": "yes"}}\n')
    return path


def test_module_accepts_every_example_config():
    done = run_module("check-config", *map(str, DS_CONFIGS))
    assert done.returncode == 0, done.stderr
    for path in DS_CONFIGS:
        assert f"{path}: valid; resolved ds_profutils settings:" in done.stdout
    assert "Traceback" not in done.stderr


def test_module_rejects_bad_config_one_line_per_problem(bad_config):
    done = run_module("check-config", str(bad_config))
    assert done.returncode == EXIT_INVALID
    assert "Traceback" not in done.stderr
    problems = [line for line in done.stderr.splitlines() if line.startswith(f"{bad_config}: ")]
    assert problems == [
        f"{bad_config}: profiler.active: 0 is not allowed; expected an integer >= 1",
        f"{bad_config}: profiler.ranks: [0, -1] is not allowed; expected global ranks >= 0, or null for all ranks",
        f"{bad_config}: profiler.activ: unknown key (did you mean active?); allowed keys: active, enabled, "
        "nsight_enabled, nsight_output, output_dir, peak_tflops, profile_memory, ranks, record_shapes, repeat, skip_first, "
        "summary_ranks, summary_row_limit, summary_sort_by, wait, warmup, with_flops, with_modules, with_stack",
        f'{bad_config}: nvtx.enabled: "yes" is not allowed; expected true or false',
    ]


@pytest.mark.parametrize("path", DS_CONFIGS, ids=lambda p: p.name)
def test_check_config_prints_resolved_settings(path, capsys):
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{path}: valid; resolved ds_profutils settings:\n")
    out, _, effects = out.partition(EFFECTS_HEADER + "\n")
    assert [line.split(":")[0] for line in effects.splitlines()] == ["  nvtx", "  comms_logger"]
    ours, _, theirs = out.partition("applied by DeepSpeed, not read by ds_profutils:\n")
    keys = [line.split(":")[0] for line in ours.splitlines()[1:] if not line.startswith("    ")]
    raw = json.loads(path.read_text())
    both_record = all(raw.get(section, {}).get("enabled") for section in ("step_metrics", "partitioned_param_profiler"))
    assert keys == ["  profiler", "  nvtx", "  partitioned_param_profiler", "  memory_snapshot", "  step_metrics",
                    "  trace_capture", "  wall_clock_breakdown", "  comms_logger"] + (["note"] if both_record else [])
    assert [line.split(":")[0] for line in theirs.splitlines() if not line.startswith("    ")] == \
        [f"  {key}" for key in ("timers", "steps_per_print") if key in raw]


@pytest.mark.parametrize("section, says", [
    ({}, ["  nvtx: absent: instrument_w_nvtx (ds_profutils' and DeepSpeed's own) left as DeepSpeed sets it: "
          "deepspeed.utils.nvtx.enable_nvtx and DEEPSPEED_NVTX_DOMAIN untouched",
          "  comms_logger: absent: DeepSpeed's comms logger left as it is (off unless the job switches it on)"]),
    ({"nvtx": {"enabled": False}, "comms_logger": {"enabled": False}},
     ["  nvtx: enabled false: the ranges of instrument_w_nvtx are off, ds_profutils' and DeepSpeed's own (~85 "
      "instrumented DeepSpeed functions; it sets deepspeed.utils.nvtx.enable_nvtx); domain \"DeepSpeed\": "
      "DeepSpeed's own",
      "  comms_logger: present: ds_profutils' logger replaces DeepSpeed's at attach, keeping what DeepSpeed's "
      "recorded; enabled false: off (DeepSpeed's would be on: the section exists)"]),
])
def test_check_config_says_what_the_nvtx_and_comms_logger_sections_govern(tmp_path, capsys, section, says):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, **section}))
    assert main(["check-config", str(path)]) == 0
    assert capsys.readouterr().out.partition(EFFECTS_HEADER + "\n")[2].splitlines() == says


@pytest.mark.parametrize("installed", [True, False])
def test_check_config_says_where_a_custom_nvtx_domain_applies(tmp_path, capsys, monkeypatch, installed):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (real_find_spec(name, *a) if installed else None) if name == "nvtx" else
                        real_find_spec(name, *a))
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "nvtx": {"domain": "Job"}}))
    assert main(["check-config", str(path)]) == 0
    nvtx_line = capsys.readouterr().out.partition(EFFECTS_HEADER + "\n")[2].splitlines()[0]
    assert nvtx_line.endswith(
        "domain \"Job\": names both where the accelerator takes an NVTX domain (DeepSpeed's CUDA accelerator with "
        f"the nvtx package, pip install ds-profutils[nvtx]: {'installed' if installed else 'not installed'} here); "
        "elsewhere not applicable, which the job says in one line at start")


def test_defaults_are_filled_in(tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 1, "profiler": {"active": 5}}')
    assert main(["check-config", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:5] == ["  profiler:", "    enabled: true", '    output_dir: "./profiler_logs"', "    skip_first: 1"]
    assert "    active: 5" in lines and "    summary_ranks: [0]" in lines and "    ranks: null" in lines
    assert "  nvtx: null" in lines


def test_missing_file(tmp_path, capsys):
    path = tmp_path / "missing.json"
    assert main(["check-config", str(path)]) == EXIT_INVALID
    assert capsys.readouterr().err == f"{path}: no such file\n"


def test_malformed_json_gives_line_and_column(tmp_path, capsys):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "profiler": {"active": 3,, "wait": 1}\n}\n')
    assert main(["check-config", str(path)]) == EXIT_INVALID
    assert capsys.readouterr().err.startswith(f"{path}: syntax error at line 2, column 28: ")


@pytest.mark.parametrize("text, says", [
    ('{"step_metrics": {"peak_tflops": 1e999}}', "a number out of range (such as 1e999)"),
    ('{"x": ' + "[" * 5000 + "]" * 5000 + "}", "nested too deeply"),
])
def test_a_file_hjson_cannot_read_is_named_not_a_traceback(tmp_path, capsys, text, says):
    """hjson, DeepSpeed's reader, raises OverflowError and RecursionError on these: one line naming the file."""
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    assert main(["check-config", str(path)]) == EXIT_INVALID
    (line, ) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"{path}: {says}")


def test_every_file_is_checked_and_any_failure_fails(bad_config, capsys):
    good = DS_CONFIGS[0]
    assert main(["check-config", str(bad_config), str(good)]) == EXIT_INVALID
    captured = capsys.readouterr()
    assert f"{good}: valid" in captured.out
    assert f"{bad_config}: profiler.active" in captured.err


def test_environment_overrides_are_applied_and_shown(monkeypatch, capsys):
    monkeypatch.setenv("DS_PROFUTILS_PROFILER_ACTIVE", "7")
    assert main(["check-config", str(DS_CONFIGS[0])]) == 0
    out = capsys.readouterr().out
    assert "  (with environment overrides DS_PROFUTILS_PROFILER_ACTIVE=7)" in out
    assert "    active: 7" in out.splitlines()


def test_bad_environment_is_reported_against_the_file(monkeypatch, capsys):
    monkeypatch.setenv("DS_PROFUTILS_PROFILER_ENABLED", "sometimes")
    path = DS_CONFIGS[0]
    assert main(["check-config", str(path)]) == EXIT_INVALID
    assert capsys.readouterr().err == (f'{path}: DS_PROFUTILS_PROFILER_ENABLED: "sometimes" is not allowed; '
                                       "expected 1/0, true/false, yes/no or on/off (any case) (sets profiler.enabled)\n")


def test_world_size_checks_configured_ranks(tmp_path, capsys):
    path = tmp_path / "ranks.json"
    path.write_text('{"profiler": {"ranks": [0, 3]}, "partitioned_param_profiler": {"ranks": [1]}}')
    assert main(["check-config", "--world-size", "4", str(path)]) == 0
    capsys.readouterr()
    assert main(["check-config", "--world-size", "2", str(path)]) == EXIT_INVALID
    assert capsys.readouterr().err == (f"{path}: profiler.ranks: ranks [3] are outside the world size 2; "
                                       "expected global ranks 0..1, or null for all ranks\n")
    # Listed beside other problems, not only once they are fixed.
    path.write_text('{"profiler": {"ranks": [0, 3], "active": -1}, "partitioned_param_profiler": {"ranks": [1]}}')
    assert main(["check-config", "--world-size", "2", str(path)]) == EXIT_INVALID
    problems = capsys.readouterr().err.splitlines()
    assert len(problems) == 2 and problems[0].startswith(f"{path}: profiler.active: -1")
    assert problems[1] == (f"{path}: profiler.ranks: ranks [3] are outside the world size 2; "
                           "expected global ranks 0..1, or null for all ranks")


def test_world_size_checks_the_ranks_of_enabled_sections_only(tmp_path, capsys):
    """attach checks the ranks of the features it switches on: a disabled section's are not checked."""
    path = tmp_path / "ranks.json"
    path.write_text(json.dumps({"profiler": {"enabled": False, "ranks": [5]}, "step_metrics": {"ranks": [7]},
                                "trace_capture": {"ranks": [9]}, "partitioned_param_profiler": {"ranks": [3]}}))
    assert main(["check-config", "--world-size", "2", str(path)]) == 0, capsys.readouterr().err
    path.write_text(json.dumps({"profiler": {"enabled": False, "ranks": [5], "active": -1},
                                "step_metrics": {"ranks": [7], "enabled": True, "output_dir": str(tmp_path)}}))
    assert main(["check-config", "--world-size", "2", str(path)]) == EXIT_INVALID
    problems = capsys.readouterr().err.splitlines()
    assert [line.split(": ")[1] for line in problems] == ["profiler.active", "step_metrics.ranks"]


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main([])
    assert excinfo.value.code == 2
    with pytest.raises(SystemExit) as excinfo:
        main(["check-config"])
    assert excinfo.value.code == 2
    assert "PATH" in capsys.readouterr().err


def imported_modules(*args: str, cwd=None) -> set:
    """Top-level modules a fresh ``python -X importtime -m ds_profutils ARGS`` imported (its stderr); the
    command must succeed, so every module its work needs was loaded."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "ds_profutils", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=cwd)
    assert done.returncode == 0, (args, done.stderr[-2000:])
    return {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines()
            if line.startswith("import time:")}


def test_report_and_timeline_load_neither_torch_deepspeed_nor_pydantic(tmp_path):
    for rank in (0, 1):  # a run to report on and traces to merge: each command does its whole work
        write_records(tmp_path, rank, [record(rank, step) for step in range(3)])
        write_trace(tmp_path / f"trace_rank_{rank}.json", {0: 5.0, 1: 6.0}, rank=rank)
    for args in (["report", str(tmp_path)], ["report", str(tmp_path), "--json"],
                 ["timeline", str(tmp_path), "-o", str(tmp_path / "t.json")]):
        loaded = imported_modules(*args)
        assert "ds_profutils" in loaded
        assert not loaded & {"torch", "deepspeed", "pydantic", "pydantic_core", "hjson", "numpy"}, (args, loaded)


def test_check_config_loads_neither_torch_nor_deepspeed():
    loaded = imported_modules("check-config", str(DS_CONFIGS[0]))
    assert "pydantic" in loaded and not loaded & {"torch", "deepspeed"}


def test_json_on_stdout_is_valid_and_alone(tmp_path):
    (tmp_path / "zero_fetch_rank_0.jsonl").write_text(json.dumps({
        "schema": 2, "engine": "main", "rank": 0, "world_size": 1, "mode": "train", "global_step": 0,
        "step_time_ms": 10.0, "fetch_wait_ms": 1.0, "collective_wait_ms": 2.0, "collectives": {}, "events": {}}) + "\n")
    done = run_module("report", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["engines"]["main"]["ranks"] == [0]


def test_world_size_must_be_at_least_one(capsys):
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit) as excinfo:
            main(["check-config", "--world-size", bad, str(DS_CONFIGS[0])])
        assert excinfo.value.code == 2
        assert f"--world-size: {bad!r} is not allowed; expected an integer >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("key, meant", [("profiller", "profiler"), ("Profiler", "profiler"), ("nvxt", "nvtx"),
                                        ("partition_param_profiler", "partitioned_param_profiler"),
                                        ("step_metric", "step_metrics"), ("stepmetrics", "step_metrics")])
def test_a_misspelt_section_is_an_error_with_did_you_mean(tmp_path, capsys, key, meant):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, key: {"enabled": True}}))
    assert main(["check-config", str(path)]) == EXIT_INVALID
    captured = capsys.readouterr()
    assert captured.err == (f"{path}: {key}: unknown top-level key (did you mean {meant}?); DeepSpeed ignores unknown "
                            f"keys, so its settings are never read and {meant} stays off\n")
    assert "WARNING" not in captured.err and captured.out == ""


def test_deepspeeds_own_keys_near_our_names_are_not_misspellings(tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "flops_profiler": {"enabled": False},
                                "comms_logger": {"enabled": False}, "profiler": {"enabled": False},
                                "steps_per_print": 10, "step_metrics": {"enabled": False}}))
    assert main(["check-config", str(path)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("zero, shown", [({"stage": 2}, "2"), (None, "not set (DeepSpeed's default: 0)"),
                                         (True, "1 (zero_optimization: true, DeepSpeed's deprecated form)")])
def test_fetch_profiler_without_zero_stage_3_names_both_keys(tmp_path, capsys, zero, shown):
    config = {"partitioned_param_profiler": {"enabled": True, "output_dir": str(tmp_path / "out")}}
    if zero is not None:
        config["zero_optimization"] = zero
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    assert main(["check-config", str(path)]) == EXIT_INVALID
    assert capsys.readouterr().err == (
        f"{path}: partitioned_param_profiler.enabled: true needs zero_optimization.stage 3, but "
        f"zero_optimization.stage is {shown}: below stage 3 ZeRO does not partition parameters, so there are no "
        "fetches to record\n")
    config["zero_optimization"] = {"stage": 3}
    path.write_text(json.dumps(config))
    assert main(["check-config", str(path)]) == 0
    assert not (tmp_path / "out").exists()  # checked, not created


@pytest.mark.parametrize("stage", ['"3"', '"3.0"', "3.0", '" 3"'])
def test_zero_stage_is_read_as_deepspeed_reads_it(tmp_path, capsys, stage):
    """DeepSpeed's pydantic config takes "3" and 3.0 for stage 3 (and attach then records fetches)."""
    path = tmp_path / "ds_config.json"
    path.write_text('{"zero_optimization": {"stage": %s}, "partitioned_param_profiler": {"enabled": true, '
                    '"output_dir": %s}}' % (stage, json.dumps(str(tmp_path / "out"))))
    assert main(["check-config", str(path)]) == 0, capsys.readouterr().err


def test_both_record_sections_below_stage_3_is_a_warning_as_at_attach(tmp_path, capsys):
    """attach keeps step_metrics' records and switches the fetch records off, in one warning: so does check-config."""
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2},
                                "partitioned_param_profiler": {"enabled": True, "output_dir": str(tmp_path / "a")},
                                "step_metrics": {"enabled": True, "output_dir": str(tmp_path / "b")}}))
    assert main(["check-config", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == (f"{path}: WARNING: partitioned_param_profiler is on, but zero_optimization.stage is 2: "
                            "below stage 3 ZeRO does not partition parameters, so the job records no fetches (attach "
                            "says so once); the step records of step_metrics go on\n")
    assert "note: step_metrics and partitioned_param_profiler are both on" not in captured.out


def test_an_output_dir_that_cannot_be_created_is_an_error(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"profiler": {"output_dir": str(blocker / "traces")},
                                "partitioned_param_profiler": {"enabled": False, "output_dir": str(blocker / "x")}}))
    assert main(["check-config", str(path)]) == EXIT_INVALID
    # the value as the user wrote it, shortened past 80 characters (how long tmp_path is varies)
    assert capsys.readouterr().err == (f'{path}: profiler.output_dir: {show_value(str(blocker / "traces"))} cannot be '
                                       f"created: {blocker} is not a directory\n")  # the disabled section writes nothing: not checked


def test_the_fetch_sections_output_dir_and_ranks_are_not_checked_where_step_metrics_decides_them(tmp_path, capsys):
    """Both record sections on: one file, in step_metrics' output_dir on step_metrics' ranks (attach writes there);
    the fetch section's own are "not used", so neither is refused."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3},
                                "partitioned_param_profiler": {"enabled": True, "output_dir": str(blocker / "x"),
                                                               "ranks": [4]},
                                "step_metrics": {"enabled": True, "output_dir": str(tmp_path / "m")}}))
    assert main(["check-config", "--world-size", "2", str(path)]) == 0, capsys.readouterr().err
    (note, ) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: step_metrics")]
    assert "not used: partitioned_param_profiler.output_dir " in note  # the path as long as the test's tmp_path
    assert note.endswith(f'{blocker.name}/x", partitioned_param_profiler.ranks [4]')
    path.write_text(json.dumps({"zero_optimization": {"stage": 3},  # the fetch section alone: its own are used
                                "partitioned_param_profiler": {"enabled": True, "output_dir": str(blocker / "x"),
                                                               "ranks": [4]}}))
    assert main(["check-config", "--world-size", "2", str(path)]) == EXIT_INVALID
    assert [line.split(": ")[1] for line in capsys.readouterr().err.splitlines()] == [
        "partitioned_param_profiler.output_dir", "partitioned_param_profiler.ranks"]


@pytest.mark.parametrize("directory, says", [
    ("/sys", '"/sys" cannot be written: /sys: '),
    ("/proc/records", '"/proc/records" cannot be created: nothing can be created in /proc (')])
def test_an_output_dir_that_cannot_be_written_is_an_error(tmp_path, capsys, directory, says):
    """sysfs and procfs take no files even from root (CI here runs as root, for whom permission bits do not stop
    writes); a directory to be made is blamed on its parent, not named as missing when it exists (procfs: ENOENT)."""
    needed = Path(directory) if directory == "/sys" else Path(directory).parent  # what must exist to be probed
    if not needed.is_dir():
        pytest.skip(f"no {needed} here")
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3},
                                "partitioned_param_profiler": {"enabled": True, "output_dir": directory}}))
    assert main(["check-config", str(path)]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert err.startswith(f'{path}: partitioned_param_profiler.output_dir: {says}'), err


@pytest.mark.parametrize("overridden", [False, True])
def test_an_unusable_output_dir_is_named_beside_the_sections_bad_values(tmp_path, capsys, monkeypatch, overridden):
    """One line per problem, in one run: the output_dir is checked on the file's own values where other values of
    its section are bad (a newcomer fixed those first, then met this one), with the environment's over them (a
    variable giving a usable output_dir leaves nothing to say of it)."""
    if not Path("/proc").is_dir():
        pytest.skip("no /proc here")
    if overridden:
        monkeypatch.setenv("DS_PROFUTILS_STEP_METRICS_OUTPUT_DIR", str(tmp_path / "records"))
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"step_metrics": {"enabled": True, "output_dir": "/proc/records", "console": 1,
                                                 "hang_timeout_s": -1}}))
    assert main(["check-config", str(path)]) == EXIT_INVALID
    assert [line.split(": ")[1] for line in capsys.readouterr().err.splitlines()] == [
        "step_metrics.console", "step_metrics.hang_timeout_s"] + ([] if overridden else ["step_metrics.output_dir"])


def test_check_config_checks_step_metrics_ranks_and_output_dir(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2},  # any stage: no stage-3 check
                                "step_metrics": {"enabled": True, "ranks": [0, 3], "output_dir": str(tmp_path / "m")}}))
    assert main(["check-config", "--world-size", "4", str(path)]) == 0
    out = capsys.readouterr().out
    assert "  step_metrics:\n    enabled: true\n" in out and "    peak_tflops: null\n    monitor_interval: 10\n" in out
    assert not (tmp_path / "m").exists()  # checked, not created
    assert main(["check-config", "--world-size", "2", str(path)]) == EXIT_INVALID
    assert capsys.readouterr().err == (f"{path}: step_metrics.ranks: ranks [3] are outside the world size 2; "
                                       "expected global ranks 0..1, or null for all ranks\n")
    path.write_text(json.dumps({"step_metrics": {"enabled": True, "output_dir": str(blocker / "m")}}))
    assert main(["check-config", str(path)]) == EXIT_INVALID
    assert capsys.readouterr().err == (f'{path}: step_metrics.output_dir: {show_value(str(blocker / "m"))} cannot be '
                                       f"created: {blocker} is not a directory\n")


def test_version_prints_the_package_version_without_torch():
    from ds_profutils import __version__

    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "ds_profutils", "--version"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and done.stdout == f"ds-profutils {__version__}\n"
    assert "| torch" not in done.stderr and "| deepspeed" not in done.stderr


@pytest.mark.parametrize("command", ["report", "timeline", "diff"])
def test_a_file_given_as_the_directory_is_named_a_file(tmp_path, capsys, command):
    path = tmp_path / "zero_fetch_rank_0.jsonl"
    write_records(tmp_path, 0, [record(0, 0)])
    args = {"report": [str(path)], "timeline": [str(path), "-o", str(tmp_path / "t.json")],
            "diff": [str(tmp_path), str(path)]}[command]
    assert main([command, *args]) == 1
    assert capsys.readouterr().err == f"ds-profutils {command}: {path} is a file, not a directory: name the run's " \
                                      "output_dir\n"


def test_a_trace_cut_at_60_percent_is_read_by_report_and_timeline_and_named_incomplete(tmp_path):
    for rank in (0, 1):
        write_trace(tmp_path / f"trace_rank_{rank}.json", {step: 5.0 + step for step in range(10)}, rank=rank)
    whole = (tmp_path / "trace_rank_1.json").read_bytes()
    (tmp_path / "trace_rank_1.json").write_bytes(whole[:int(0.6 * len(whole))])
    done = run_module("report", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    cut = report["traces"]["1"]
    assert 0 < cut["events"] < report["traces"]["0"]["events"] and cut["steps"]
    assert cut["incomplete"] and report["traces"]["0"]["incomplete"] is None
    assert {(entry["kind"], entry["rank"]) for entry in report["incomplete"]} == {("trace", 1)}
    assert report["incomplete"][0]["reason"].startswith("incomplete: ")  # and where its steps end
    text = run_module("report", str(tmp_path)).stdout
    assert "  trace, rank 1 (trace_rank_1.json): incomplete: " in text
    merged = run_module("timeline", str(tmp_path), "-o", str(tmp_path / "t.json"))
    assert merged.returncode == 0 and "trace_rank_1.json ends early" in merged.stderr
    ranks = {event["pid"] for event in json.loads((tmp_path / "t.json").read_text())["traceEvents"]}
    assert {0, 1} <= ranks


def test_a_directory_with_nothing_readable_exits_1(tmp_path):
    (tmp_path / "trace_rank_0.json").write_text("this is not a trace\n")
    done = run_module("report", str(tmp_path))
    assert done.returncode == 1 and done.stdout == ""
    assert "nothing readable (trace_rank_0.json: not read: no \"traceEvents\" array)" in done.stderr


def test_check_config_says_absent_in_the_resolved_view_as_in_the_effects(tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1}))
    assert main(["check-config", str(path)]) == 0
    view, _, effects = capsys.readouterr().out.partition(EFFECTS_HEADER + "\n")
    assert "  comms_logger: null" in view.splitlines() and "  nvtx: null" in view.splitlines()
    assert "  comms_logger: absent: " in effects
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "comms_logger": {"enabled": False}}))
    assert main(["check-config", str(path)]) == 0
    view, _, effects = capsys.readouterr().out.partition(EFFECTS_HEADER + "\n")
    assert "  comms_logger:" in view.splitlines() and "    enabled: false" in view.splitlines()
    assert "  comms_logger: present: " in effects


def test_check_config_says_how_the_two_record_sections_combine(tmp_path, capsys):
    """Both record sections on: one file per engine and rank, whose shared keys are step_metrics'."""
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3},
                                "step_metrics": {"enabled": True, "output_dir": str(tmp_path / "a")},
                                "partitioned_param_profiler": {"enabled": True, "output_dir": str(tmp_path / "b"),
                                                               "log_interval": 1}}))
    assert main(["check-config", str(path)]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: step_metrics")]
    assert notes == [("note: step_metrics and partitioned_param_profiler are both on: one records file per engine "
                      "and rank, its output_dir, ranks, log_interval, memory from step_metrics; the fetch section adds "
                      f"the fetch events; not used: partitioned_param_profiler.output_dir \"{tmp_path / 'b'}\"")]


@pytest.mark.parametrize("section, module", [("tensorboard", "tensorboard"), ("wandb", "wandb"), ("comet", "comet_ml")])
def test_check_config_warns_of_an_enabled_monitor_whose_package_is_missing(tmp_path, capsys, monkeypatch, section,
                                                                            module):
    """DeepSpeed imports the monitor's package inside deepspeed.initialize: a job without it stops there, so
    check-config says so (a warning: the job's environment may have it); a disabled monitor is not mentioned."""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == module else real_find_spec(name, *a))
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, section: {"enabled": True}}))
    assert main(["check-config", str(path)]) == 0
    err = capsys.readouterr().err
    assert err == (f"{path}: WARNING: {section}.enabled is true, but the {module} package is not installed here: "
                   f"DeepSpeed imports it in deepspeed.initialize, where a job without it stops (pip install {module})\n")
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, section: {"enabled": False}}))
    assert main(["check-config", str(path)]) == 0
    assert capsys.readouterr().err == ""
