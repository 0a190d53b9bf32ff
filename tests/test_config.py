"""ds_config sections: loading from every source, messages for bad input, and the order of precedence."""
from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

import pytest

from ds_profutils.config import (BOOL_FALSE, BOOL_TRUE, SUMMARY_SORT_KEYS, ConfigError, ConfigProblem, NvtxConfig,
                                 PartitionedParamProfilerConfig, ProfilerConfig, ProfUtilsConfig, StepMetricsConfig,
                                 SECTIONS, check_ranks, load_config, resolve_section)
from ds_profutils.config.loading import config_from_raw
from launcher import REPO, run_one_rank

DS_CONFIGS = sorted((REPO / "ds_configs").glob("*.json"))


def problem_lines(excinfo) -> list:
    return [str(problem) for problem in excinfo.value.problems]


def write(tmp_path: Path, text: str, name: str = "ds_config.json") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# --- the example configs -------------------------------------------------------------------------


def test_there_are_example_configs():
    assert {p.name for p in DS_CONFIGS} >= {
        "zero3_all_profiling.json", "torch_profiler_only.json", "nsight_capture.json",
        "production_fetch_counters.json"
    }


@pytest.mark.parametrize("path", DS_CONFIGS, ids=lambda p: p.name)
def test_example_config_loads_in_ds_profutils_and_deepspeed(path):
    load_config(path)
    if '"auto"' in path.read_text():  # the Trainer's to fill before DeepSpeed reads it (test_integrations_jobs.py)
        return
    # DeepSpeed's own reading of the same file: batch size, optimizer and ZeRO sections are valid.
    from deepspeed.runtime.config import DeepSpeedConfig
    ds_config = DeepSpeedConfig(str(path))
    assert ds_config.optimizer_name == "adam"
    assert ds_config.optimizer_params.get("torch_adam") is True
    assert not ds_config.float16_config.enabled and not ds_config.bfloat16_config.enabled
    assert ds_config.zero_optimization_stage == (3 if "zero3" in path.name or "production" in path.name else
                                                 ds_config.zero_optimization_stage)


def test_example_configs_switch_on_what_their_names_say():
    configs = {p.stem: load_config(p) for p in DS_CONFIGS}
    everything = configs["zero3_all_profiling"]
    assert everything.profiler.enabled and everything.partitioned_param_profiler.enabled
    assert everything.nvtx.enabled and everything.wall_clock_breakdown and everything.comms_logger.enabled
    torch_only = configs["torch_profiler_only"]
    assert torch_only.profiler.enabled and not torch_only.profiler.nsight_enabled
    assert torch_only.nvtx is None and not torch_only.partitioned_param_profiler.enabled
    assert configs["nsight_capture"].profiler.nsight_enabled
    production = configs["production_fetch_counters"]
    assert production.partitioned_param_profiler.enabled and not production.partitioned_param_profiler.trace_ranges
    assert not production.profiler.enabled and production.nvtx is None
    assert not production.wall_clock_breakdown and not production.comms_logger.enabled


def test_zero3_examples_are_zero3():
    for name in ("zero3_all_profiling", "production_fetch_counters"):
        raw = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
        assert raw["zero_optimization"]["stage"] == 3
    raw = json.loads((REPO / "ds_configs" / "zero3_all_profiling.json").read_text())
    assert raw["zero_optimization"]["stage3_param_persistence_threshold"] == 0


# --- defaults and sources ------------------------------------------------------------------------


def test_config_without_our_sections_switches_everything_off():
    config = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
    assert not config.profiler.enabled
    assert not config.partitioned_param_profiler.enabled
    assert config.nvtx is None
    assert not config.wall_clock_breakdown and not config.comms_logger.enabled
    assert load_config() == config == load_config({})


def test_a_present_section_is_on_with_defaults():
    config = load_config({"profiler": {}, "nvtx": {}})
    assert config.profiler == ProfilerConfig()
    assert (config.profiler.skip_first, config.profiler.wait, config.profiler.warmup, config.profiler.active,
            config.profiler.repeat) == (1, 1, 1, 3, 1)
    assert config.profiler.output_dir == "./profiler_logs" and config.profiler.nsight_output == "nsight_profile"
    assert config.profiler.with_flops and not config.profiler.with_stack and not config.profiler.with_modules
    assert config.nvtx == NvtxConfig(enabled=True, domain="DeepSpeed")
    assert load_config({"partitioned_param_profiler": {}}).partitioned_param_profiler == \
        PartitionedParamProfilerConfig(enabled=False, output_dir="./profiler_logs", ranks=None, log_interval=1,
                                       trace_ranges=True)


def test_sources_give_the_same_config(tmp_path):
    raw = {"train_micro_batch_size_per_gpu": 1, "profiler": {"active": 5}}
    path = write(tmp_path, json.dumps(raw))
    parser = argparse.ArgumentParser()
    import deepspeed
    deepspeed.add_config_arguments(parser)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    from deepspeed.runtime.config import DeepSpeedConfig
    expected = load_config(raw)
    assert expected.profiler.active == 5
    for source in (path, str(path), args, DeepSpeedConfig(str(path))):
        assert load_config(source) == expected
    assert load_config(expected) is expected


def test_namespace_without_deepspeed_config():
    with pytest.raises(ConfigError) as excinfo:
        load_config(argparse.Namespace(deepspeed_config=None))
    assert problem_lines(excinfo)[0].startswith("deepspeed_config: not set")


def test_unreadable_source_type():
    with pytest.raises(TypeError, match="cannot read settings from a int"):
        load_config(5)


def test_real_engine_is_a_source(tmp_path):
    """``deepspeed.initialize`` in one process (world size 1), then ``load_config(engine)``."""
    script = textwrap.dedent("""
        import sys, torch, deepspeed
        from ds_profutils.config import load_config
        model = torch.nn.Linear(4, 4)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=sys.argv[1])
        config = load_config(engine)
        print("RESULT", config.profiler.active, config.partitioned_param_profiler.enabled, config.nvtx.domain)
    """)
    done = run_one_rank(["-c", script, str(REPO / "ds_configs" / "zero3_all_profiling.json")], timeout=300,
                        cwd=tmp_path)
    assert "RESULT 2 True DeepSpeed" in done.stdout


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("raw, line", [
    ({"profiler": {"enabled": "yes"}}, 'profiler.enabled: "yes" is not allowed; expected true or false'),
    ({"profiler": {"active": 0}}, "profiler.active: 0 is not allowed; expected an integer >= 1"),
    ({"profiler": {"active": -2}}, "profiler.active: -2 is not allowed; expected an integer >= 1"),
    ({"profiler": {"active": "3"}}, 'profiler.active: "3" is not allowed; expected an integer'),
    ({"profiler": {"active": 2.5}}, "profiler.active: 2.5 is not allowed; expected an integer"),
    ({"profiler": {"wait": -1}}, "profiler.wait: -1 is not allowed; expected an integer >= 0"),
    ({"profiler": {"output_dir": ""}}, 'profiler.output_dir: "" is not allowed; expected a non-empty string'),
    ({"profiler": {"ranks": [0, -1]}},
     "profiler.ranks: [0, -1] is not allowed; expected global ranks >= 0, or null for all ranks"),
    ({"profiler": {"ranks": ["a"]}}, 'profiler.ranks[0]: "a" is not allowed; expected an integer'),
    ({"profiler": {"ranks": 3}}, "profiler.ranks: 3 is not allowed; expected a list"),
    ({"profiler": 5}, "profiler: 5 is not allowed; expected an object"),
    ({"nvtx": "on"}, 'nvtx: "on" is not allowed; expected an object'),
    ({"nvtx": {"domain": ""}}, 'nvtx.domain: "" is not allowed; expected a non-empty string'),
    ({"partitioned_param_profiler": {"log_interval": 0}},
     "partitioned_param_profiler.log_interval: 0 is not allowed; expected an integer >= 1"),
    ({"comms_logger": {"enabled": "maybe"}}, 'comms_logger.enabled: "maybe" is not allowed; expected true or false'),
])
def test_bad_value_names_key_value_and_what_is_allowed(raw, line):
    with pytest.raises(ConfigError) as excinfo:
        load_config(raw)
    assert problem_lines(excinfo) == [line]


def test_unknown_key_lists_allowed_keys():
    with pytest.raises(ConfigError) as excinfo:
        load_config({"profiler": {"activ": 3}})
    allowed = ", ".join(sorted(ProfilerConfig.model_fields))
    assert problem_lines(excinfo) == [f"profiler.activ: unknown key (did you mean active?); allowed keys: {allowed}"]
    assert allowed.startswith("active, enabled, ")
    with pytest.raises(ConfigError, match=r"nvtx\.colour: unknown key; allowed keys: domain, enabled"):
        load_config({"nvtx": {"colour": "red"}})


def test_bad_sort_key_is_caught_at_load_time():
    with pytest.raises(ConfigError) as excinfo:
        load_config({"profiler": {"summary_sort_by": "cpu_total"}})
    (line, ) = problem_lines(excinfo)
    assert line == ('profiler.summary_sort_by: "cpu_total" is not allowed; expected one of self_cpu_time_total, '
                    'cpu_time_total, count, flops')


def test_every_sort_key_sorts_the_operator_summary():
    import torch

    from ds_profutils.torch_profiler.summary import OperatorSummary
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_flops=True) as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    for key in SUMMARY_SORT_KEYS:
        ProfilerConfig(summary_sort_by=key)
        summary = OperatorSummary(key, row_limit=3)
        summary.add_cycle(prof)
        assert f"sorted by {key}" in summary.table()


def test_all_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as excinfo:
        load_config({"profiler": {"active": 0, "with_stack": 1}, "nvtx": {"domian": "x"}})
    assert [p.key for p in excinfo.value.problems] == ["profiler.active", "profiler.with_stack", "nvtx.domian"]
    assert isinstance(excinfo.value, ValueError)
    assert str(excinfo.value).count("\n") == 2


def test_syntax_error_gives_line_and_column(tmp_path):
    path = write(tmp_path, """\
        {
          "profiler": {
            "active": 3,,
            "wait": 1
          }
        }
        """)
    with pytest.raises(ConfigError) as excinfo:
        load_config(path)
    (line, ) = excinfo.value.lines()
    assert line.startswith(f"{path}: syntax error at line 3, column 17: ")


def test_syntax_error_hjson_reports_late_gets_strict_json_position(tmp_path):
    # hjson reads ``tru}}`` as an unquoted string, so it only fails at the end of the (minified) file.
    path = write(tmp_path, '{"train_batch_size": 8, "profiler": {"active": tru}}')
    with pytest.raises(ConfigError) as excinfo:
        load_config(path)
    (line, ) = excinfo.value.lines()
    assert line.startswith(f"{path}: syntax error at line 1, column 53: ")
    assert line.endswith("(read as strict JSON: line 1, column 48: Expecting value)")


def test_hjson_is_read_as_deepspeed_reads_it(tmp_path):
    path = write(tmp_path, """\
        {
          # hjson comments and unquoted keys, as DeepSpeed's reader allows
          profiler: {active: 4}
        }
        """, "ds_config.hjson")
    assert load_config(path).profiler.active == 4


def test_missing_file_names_the_path(tmp_path, monkeypatch):
    path = tmp_path / "nope.json"
    with pytest.raises(ConfigError) as excinfo:
        load_config(path)
    assert str(excinfo.value) == f"{path}: no such file"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=rf"^nope\.json: no such file \(relative to {tmp_path}\)$"):
        load_config("nope.json")


def test_directory_is_not_a_config(tmp_path):
    with pytest.raises(ConfigError, match=rf"^{tmp_path}: cannot read the file: Is a directory$"):
        load_config(tmp_path)


def test_duplicate_keys_are_rejected_with_their_path(tmp_path):
    path = write(tmp_path, '{"profiler": {"active": 3, "active": 5}, "x": [{"a": 1, "a": 2}]}')
    with pytest.raises(ConfigError) as excinfo:
        load_config(path)
    assert problem_lines(excinfo) == [
        "profiler.active: duplicate key (values 3, 5); expected each key once per object, "
        "as DeepSpeed rejects duplicates",
        "x[0].a: duplicate key (values 1, 2); expected each key once per object, as DeepSpeed rejects duplicates",
    ]


def test_top_level_must_be_an_object(tmp_path):
    with pytest.raises(ConfigError, match=r"\(top level\): \[1, 2\] is not allowed; expected a JSON object"):
        load_config(write(tmp_path, "[1, 2]"))


def test_rank_outside_world_size():
    check_ranks("profiler.ranks", [0, 1], 2)
    check_ranks("profiler.ranks", None, 1)
    with pytest.raises(ConfigError) as excinfo:
        check_ranks("partitioned_param_profiler.ranks", [0, 2, 5], 2)
    assert problem_lines(excinfo) == [
        "partitioned_param_profiler.ranks: ranks [2, 5] are outside the world size 2; "
        "expected global ranks 0..1, or null for all ranks"
    ]


# --- DeepSpeed's own keys ------------------------------------------------------------------------


def test_comms_logger_enabled_false_means_off():
    assert not load_config({"comms_logger": {"enabled": False, "verbose": True}}).comms_logger.enabled
    assert not load_config({"comms_logger": {}}).comms_logger.enabled
    assert load_config({"comms_logger": {"enabled": True}}).comms_logger.enabled


def test_flops_profiler_turns_on_wall_clock_breakdown_as_in_deepspeed():
    assert load_config({"flops_profiler": {"enabled": True}}).wall_clock_breakdown
    assert not load_config({"flops_profiler": {"enabled": False}}).wall_clock_breakdown


@pytest.mark.parametrize("enabled, on", [(1, True), (2, True), (0, False), (None, False)])
def test_flops_profiler_enabled_is_read_as_deepspeed_reads_it(enabled, on):
    """DeepSpeed ORs wall_clock_breakdown with flops_profiler.enabled as written (``False | 1``): an integer counts."""
    assert load_config({"flops_profiler": {"enabled": enabled}}).wall_clock_breakdown is on


def test_deepspeeds_own_timing_keys_are_left_to_deepspeed():
    """DeepSpeed's engine applies timers.throughput and steps_per_print; we neither read nor check them."""
    config = load_config({"timers": {"throughput": {"enabled": "whatever DeepSpeed says"}}, "steps_per_print": 0})
    assert not hasattr(config, "timers") and not hasattr(config, "steps_per_print")


# --- environment overrides and precedence --------------------------------------------------------


@pytest.mark.parametrize("word", sorted(BOOL_TRUE | BOOL_FALSE))
def test_env_bool_table(monkeypatch, word):
    for spelling in (word, word.upper(), word.capitalize()):
        monkeypatch.setenv("DS_PROFUTILS_PROFILER_ENABLED", spelling)
        assert load_config({"profiler": {}}).profiler.enabled is (word in BOOL_TRUE)
    assert BOOL_TRUE == {"1", "true", "yes", "on"} and BOOL_FALSE == {"0", "false", "no", "off"}


@pytest.mark.parametrize("value", ["maybe", "", "2", "y", "enabled"])
def test_env_bool_outside_table_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("DS_PROFUTILS_NVTX_ENABLED", value)
    with pytest.raises(ConfigError) as excinfo:
        load_config()
    assert problem_lines(excinfo) == [
        f"DS_PROFUTILS_NVTX_ENABLED: {json.dumps(value)} is not allowed; expected 1/0, true/false, yes/no or "
        "on/off (any case) (sets nvtx.enabled)"
    ]


@pytest.mark.parametrize("value", ["5.0", "0x5", "1_0", "five", ""])
def test_env_int_is_parsed_strictly(monkeypatch, value):
    monkeypatch.setenv("DS_PROFUTILS_PROFILER_ACTIVE", value)
    with pytest.raises(ConfigError, match="DS_PROFUTILS_PROFILER_ACTIVE: .* expected an integer"):
        load_config()


def test_env_value_checked_like_the_file(monkeypatch):
    monkeypatch.setenv("DS_PROFUTILS_PROFILER_ACTIVE", "0")
    with pytest.raises(ConfigError) as excinfo:
        load_config({"profiler": {}})
    assert problem_lines(excinfo) == [
        "DS_PROFUTILS_PROFILER_ACTIVE: 0 is not allowed; expected an integer >= 1 (sets profiler.active)"
    ]


def test_env_rank_lists(monkeypatch):
    monkeypatch.setenv("DS_PROFUTILS_PARTITIONED_PARAM_PROFILER_RANKS", " 3, 1")
    monkeypatch.setenv("DS_PROFUTILS_PROFILER_RANKS", "all")
    config = load_config({"profiler": {"ranks": [0]}})
    assert config.partitioned_param_profiler.ranks == [1, 3]
    assert config.profiler.ranks is None
    monkeypatch.setenv("DS_PROFUTILS_PROFILER_RANKS", "2,3")  # summary_ranks, left out, follows: the lowest
    assert load_config({"profiler": {"ranks": [1]}}).profiler.summary_ranks == [2]
    assert resolve_section(load_config({}).profiler, {"ranks": [3]}).summary_ranks == [2]  # the variable decides
    monkeypatch.delenv("DS_PROFUTILS_PROFILER_RANKS")
    assert resolve_section(load_config({}).profiler, {"ranks": [3]}).summary_ranks == [3]  # a keyword's, alone
    assert resolve_section(load_config({}).profiler, {"ranks": [3, 1]}).summary_ranks == [1]
    monkeypatch.setenv("DS_PROFUTILS_PROFILER_RANKS", "0,x")
    with pytest.raises(ConfigError, match=r'DS_PROFUTILS_PROFILER_RANKS: "0,x" is not allowed; expected '
                       r"comma-separated integers, or all \(sets profiler.ranks\)"):
        load_config()


def test_unknown_env_variables_are_errors_for_check_config(monkeypatch):
    monkeypatch.setenv("DS_PROFUTILS_PROFILER_ACTIV", "3")
    monkeypatch.setenv("DS_PROFUTILS_PROFILR_ENABLED", "1")
    monkeypatch.setenv("DS_PROFUTILS_TOX_DIR", "/tmp/tox")  # tooling, not a setting
    with pytest.raises(ConfigError) as excinfo:
        config_from_raw({}, strict=True)
    first, second = problem_lines(excinfo)
    assert first.startswith("DS_PROFUTILS_PROFILER_ACTIV: unknown variable (did you mean "
                            "DS_PROFUTILS_PROFILER_ACTIVE?); profiler settings are DS_PROFUTILS_PROFILER_<FIELD> "
                            "with FIELD one of ACTIVE, ENABLED, ")
    assert second == ("DS_PROFUTILS_PROFILR_ENABLED: unknown variable; expected DS_PROFUTILS_<SECTION>_<FIELD> "
                      "with SECTION one of PROFILER, NVTX, PARTITIONED_PARAM_PROFILER, MEMORY_SNAPSHOT, STEP_METRICS, "
                      "TRACE_CAPTURE")


def test_an_unknown_env_variable_in_a_job_is_warned_once_with_the_closest_and_ignored(monkeypatch, ds_caplog):
    """Variables leak between jobs (module files, shell profiles): one naming no setting must not stop a job."""
    import ds_profutils.config.env as env

    monkeypatch.setattr(env, "_warned_unknown", set())
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("DS_PROFUTILS_PROFILER_ACTIV", "3")
    monkeypatch.setenv("DS_PROFUTILS_FOO", "1")
    monkeypatch.setenv("DS_PROFUTILS_NVTX_ENABLED", "1")  # a known key still sets its value
    config = load_config({"profiler": {"enabled": True}})
    assert config.profiler.active == ProfilerConfig().active and config.nvtx.enabled
    load_config({})
    resolve_section(config.profiler)
    assert [r.getMessage() for r in ds_caplog.records if r.levelname == "WARNING"] == [
        "ds_profutils: environment variable DS_PROFUTILS_FOO names no setting (closest: "
        f"{env.closest_variable('DS_PROFUTILS_FOO', SECTIONS)}); it is ignored (ds-profutils check-config rejects it)",
        "ds_profutils: environment variable DS_PROFUTILS_PROFILER_ACTIV names no setting (closest: "
        "DS_PROFUTILS_PROFILER_ACTIVE); it is ignored (ds-profutils check-config rejects it)"]
    monkeypatch.setenv("DS_PROFUTILS_PROFILER_ACTIVE", "many")  # a known key's bad value stays an error
    with pytest.raises(ConfigError, match="DS_PROFUTILS_PROFILER_ACTIVE"):
        load_config({})


def test_env_and_file_problems_are_reported_together(monkeypatch):
    monkeypatch.setenv("DS_PROFUTILS_NVTX_ENABLED", "perhaps")
    with pytest.raises(ConfigError) as excinfo:
        load_config({"profiler": {"active": 0}})
    assert [p.key for p in excinfo.value.problems] == ["profiler.active", "DS_PROFUTILS_NVTX_ENABLED"]


def test_env_switching_on_an_absent_section_creates_it_with_defaults(monkeypatch):
    monkeypatch.setenv("DS_PROFUTILS_PARTITIONED_PARAM_PROFILER_ENABLED", "1")
    monkeypatch.setenv("DS_PROFUTILS_PROFILER_ENABLED", "yes")
    monkeypatch.setenv("DS_PROFUTILS_NVTX_ENABLED", "false")
    config = load_config({})
    assert config.partitioned_param_profiler == PartitionedParamProfilerConfig(enabled=True)
    assert config.profiler == ProfilerConfig()
    assert config.nvtx == NvtxConfig(enabled=False)


def test_env_nvtx_domain_alone_leaves_an_absent_nvtx_section_absent(monkeypatch):
    """An absent nvtx leaves DeepSpeed's enable_nvtx alone: only DS_PROFUTILS_NVTX_ENABLED creates the section."""
    monkeypatch.setenv("DS_PROFUTILS_NVTX_DOMAIN", "mine")
    assert load_config({}).nvtx is None
    assert load_config({"nvtx": {"enabled": False}}).nvtx == NvtxConfig(enabled=False, domain="mine")
    monkeypatch.setenv("DS_PROFUTILS_NVTX_ENABLED", "1")
    assert load_config({}).nvtx == NvtxConfig(enabled=True, domain="mine")


def test_env_tuning_an_absent_section_leaves_it_off(monkeypatch):
    monkeypatch.setenv("DS_PROFUTILS_PROFILER_ACTIVE", "9")
    config = load_config({})
    assert not config.profiler.enabled and config.profiler.active == 9


def test_env_switches_off_a_configured_feature(monkeypatch):
    monkeypatch.setenv("DS_PROFUTILS_PROFILER_ENABLED", "0")
    assert not load_config(REPO / "ds_configs" / "zero3_all_profiling.json").profiler.enabled


def test_precedence_env_over_kwargs_over_config_over_off(monkeypatch):
    assert not load_config({}).profiler.enabled  # off
    section = load_config({"profiler": {"active": 3, "wait": 2}}).profiler
    assert resolve_section(section, {}).active == 3  # config
    resolved = resolve_section(section, {"active": 5, "wait": None})
    assert (resolved.active, resolved.wait) == (5, 2)  # kwargs over config; None means "not given"
    monkeypatch.setenv("DS_PROFUTILS_PROFILER_ACTIVE", "7")
    assert resolve_section(section, {"active": 5}).active == 7  # environment over kwargs
    assert load_config({"profiler": {"active": 3}}).profiler.active == 7  # and over the file


def test_resolve_section_checks_kwargs_like_the_file():
    section = load_config({"nvtx": {}}).nvtx
    with pytest.raises(ConfigError) as excinfo:
        resolve_section(section, {"domian": "x", "enabled": "yes"})
    assert problem_lines(excinfo) == [
        'nvtx.enabled: "yes" is not allowed; expected true or false',
        "nvtx.domian: unknown key (did you mean domain?); allowed keys: domain, enabled",
    ]
    assert resolve_section(PartitionedParamProfilerConfig(), {"ranks": (2, 0), "enabled": True}).ranks == [0, 2]
    with pytest.raises(TypeError, match="resolve_section expects one of ProfilerConfig"):
        resolve_section(ProfUtilsConfig(), {})


def test_resolve_section_applies_environment_to_absent_nvtx(monkeypatch):
    monkeypatch.setenv("DS_PROFUTILS_NVTX_DOMAIN", "mine")
    assert resolve_section(NvtxConfig(), {"domain": "kwarg"}).domain == "mine"


def test_config_error_is_a_value_error_with_structured_problems():
    error = ConfigError([ConfigProblem("profiler.active", "0 is not allowed"), ConfigProblem("", "whole file")],
                        "x.json")
    assert isinstance(error, ValueError)
    assert error.lines() == ["x.json: profiler.active: 0 is not allowed", "x.json: whole file"]
    assert str(error) == "x.json: profiler.active: 0 is not allowed\nx.json: whole file"


# --- a misspelt section at run time ---------------------------------------------------------------


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Each test starts as a new process would: nothing warned yet."""
    import ds_profutils.config.checks as checks
    monkeypatch.setattr(checks, "_warned", set())


def test_misspelt_section_is_one_warning_line_on_rank_0(tmp_path, ds_caplog, fresh_warnings, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    path = write(tmp_path, '{"profiller": {"active": 2}, "nvtx": {"enabled": false}}')
    config = load_config(path)
    assert not config.profiler.enabled  # what the warning is about
    load_config(path)  # the decorator and attach both load the config: still one line
    warnings = [r for r in ds_caplog.records if r.levelname == "WARNING"]
    assert [r.getMessage() for r in warnings] == [
        f'ds_profutils: top-level key "profiller" in {path} is not one of our sections (did you mean profiler?); '
        "DeepSpeed ignores unknown keys, so its settings are never read and profiler stays off"]
    assert warnings[0].name == "DeepSpeed"


def test_misspelt_section_is_not_warned_on_other_ranks(ds_caplog, fresh_warnings, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    load_config({"partitioned_param_profilier": {"enabled": True}})
    assert not [r for r in ds_caplog.records if r.levelname == "WARNING"]


def test_a_real_engines_config_is_checked_for_misspelt_sections(ds_caplog, fresh_warnings):
    class Engine:  # what load_config reads of a DeepSpeed engine
        config = {"nvxt": {"enabled": True}, "train_micro_batch_size_per_gpu": 1}

    load_config(Engine())
    assert [r.getMessage().split(";")[0] for r in ds_caplog.records if r.levelname == "WARNING"] == [
        'ds_profutils: top-level key "nvxt" is not one of our sections (did you mean nvtx?)']


def test_memory_snapshot_section_steps_from_the_file_and_the_environment(monkeypatch):
    config = load_config({"memory_snapshot": {"enabled": True, "at_steps": [10, 3, 3]}})
    assert config.memory_snapshot.at_steps == [3, 10] and config.memory_snapshot.on_oom
    monkeypatch.setenv("DS_PROFUTILS_MEMORY_SNAPSHOT_AT_STEPS", "5,1")
    assert load_config({"memory_snapshot": {"enabled": True}}).memory_snapshot.at_steps == [1, 5]
    monkeypatch.setenv("DS_PROFUTILS_MEMORY_SNAPSHOT_AT_STEPS", "5,x")
    with pytest.raises(ConfigError, match="DS_PROFUTILS_MEMORY_SNAPSHOT_AT_STEPS"):
        load_config({})
    monkeypatch.delenv("DS_PROFUTILS_MEMORY_SNAPSHOT_AT_STEPS")
    with pytest.raises(ConfigError, match=r"memory_snapshot\.at_steps"):
        load_config({"memory_snapshot": {"at_steps": [-1]}})


def test_check_config_says_the_memory_snapshot_needs_cuda(tmp_path, capsys):
    from ds_profutils.config.command import check_files

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"memory_snapshot": {"enabled": True, "output_dir": str(tmp_path)}}))
    assert check_files([str(path)])
    assert "note: memory_snapshot writes only on a CUDA accelerator" in capsys.readouterr().out


# --- step_metrics ------------------------------------------------------------------------------------

RECORD_KEYS = {"enabled", "output_dir", "ranks", "log_interval", "memory"}


def test_step_metrics_is_off_when_absent_and_has_its_defaults():
    assert load_config({}).step_metrics == load_config({"step_metrics": {}}).step_metrics == StepMetricsConfig(
        enabled=False, output_dir="./profiler_logs", ranks=None, log_interval=1, memory=True, peak_tflops=None,
        monitor_interval=10, console=True)
    config = load_config({"step_metrics": {"enabled": True, "peak_tflops": 400, "monitor_interval": 4,
                                           "console": False, "ranks": [1, 0, 1], "log_interval": 2}})
    assert config.step_metrics.enabled and config.step_metrics.peak_tflops == 400.0
    assert (config.step_metrics.monitor_interval, config.step_metrics.console) == (4, False)
    assert config.step_metrics.ranks == [0, 1] and config.step_metrics.reporting_rank == 0
    assert config.step_metrics.profiles_rank(1) and not config.partitioned_param_profiler.enabled


def test_the_record_keys_mean_the_same_in_both_sections_that_switch_records_on():
    shared = set(StepMetricsConfig.model_fields) & set(PartitionedParamProfilerConfig.model_fields)
    assert shared == RECORD_KEYS
    for key in RECORD_KEYS:
        theirs, ours = PartitionedParamProfilerConfig.model_fields[key], StepMetricsConfig.model_fields[key]
        assert (theirs.annotation, theirs.default, theirs.metadata) == (ours.annotation, ours.default, ours.metadata)
    assert set(StepMetricsConfig.model_fields) - RECORD_KEYS == {"peak_tflops", "monitor_interval", "console",
                                                                 "hang_timeout_s"}


def test_hang_timeout_s_defaults_to_five_minutes_zero_is_off_and_the_environment_sets_it(monkeypatch):
    assert load_config({"step_metrics": {}}).step_metrics.hang_timeout_s == 300
    assert load_config({"step_metrics": {"hang_timeout_s": 0}}).step_metrics.hang_timeout_s == 0
    with pytest.raises(ConfigError, match="hang_timeout_s: -1 is not allowed; expected an integer >= 0"):
        load_config({"step_metrics": {"hang_timeout_s": -1}})
    monkeypatch.setenv("DS_PROFUTILS_STEP_METRICS_HANG_TIMEOUT_S", "45")
    assert load_config({"step_metrics": {"hang_timeout_s": 5}}).step_metrics.hang_timeout_s == 45


@pytest.mark.parametrize("section", ["partitioned_param_profiler", "step_metrics"])
@pytest.mark.parametrize("values, line", [
    ({"log_interval": 0}, "log_interval: 0 is not allowed; expected an integer >= 1"),
    ({"output_dir": ""}, 'output_dir: "" is not allowed; expected a non-empty string'),
    ({"ranks": [0, -1]}, "ranks: [0, -1] is not allowed; expected global ranks >= 0, or null for all ranks"),
    ({"memory": "yes"}, 'memory: "yes" is not allowed; expected true or false'),
    ({"enabled": 1}, "enabled: 1 is not allowed; expected true or false"),
])
def test_shared_record_keys_are_checked_alike(section, values, line):
    with pytest.raises(ConfigError) as excinfo:
        load_config({section: values})
    assert problem_lines(excinfo) == [f"{section}.{line}"]


@pytest.mark.parametrize("values, line", [
    ({"peak_tflops": 0}, "step_metrics.peak_tflops: 0 is not allowed; expected a number > 0.0"),
    ({"peak_tflops": -312}, "step_metrics.peak_tflops: -312 is not allowed; expected a number > 0.0"),
    ({"peak_tflops": "989"}, 'step_metrics.peak_tflops: "989" is not allowed; expected a number'),
    ({"monitor_interval": 0}, "step_metrics.monitor_interval: 0 is not allowed; expected an integer >= 1"),
    ({"monitor_interval": 2.5}, "step_metrics.monitor_interval: 2.5 is not allowed; expected an integer"),
    ({"console": "on"}, 'step_metrics.console: "on" is not allowed; expected true or false'),
    ({"trace_ranges": True}, "step_metrics.trace_ranges: unknown key; allowed keys: console, enabled, "
     "hang_timeout_s, log_interval, memory, monitor_interval, output_dir, peak_tflops, ranks"),
    ({"monitor_intervall": 5}, "step_metrics.monitor_intervall: unknown key (did you mean monitor_interval?); "
     "allowed keys: console, enabled, hang_timeout_s, log_interval, memory, monitor_interval, output_dir, peak_tflops, "
     "ranks"),
    ("on", 'step_metrics: "on" is not allowed; expected an object'),
])
def test_bad_step_metrics_values_name_key_value_and_what_is_allowed(values, line):
    with pytest.raises(ConfigError) as excinfo:
        load_config({"step_metrics": values})
    assert problem_lines(excinfo) == [line]


def test_step_metrics_from_the_environment(monkeypatch):
    monkeypatch.setenv("DS_PROFUTILS_STEP_METRICS_ENABLED", "on")
    monkeypatch.setenv("DS_PROFUTILS_STEP_METRICS_PEAK_TFLOPS", " 989.5")
    monkeypatch.setenv("DS_PROFUTILS_STEP_METRICS_MONITOR_INTERVAL", "4")
    monkeypatch.setenv("DS_PROFUTILS_STEP_METRICS_CONSOLE", "0")
    monkeypatch.setenv("DS_PROFUTILS_STEP_METRICS_RANKS", "1,0")
    config = load_config({})  # an absent section switched on by ..._ENABLED: created with its defaults
    assert config.step_metrics == StepMetricsConfig(enabled=True, peak_tflops=989.5, monitor_interval=4,
                                                    console=False, ranks=[0, 1])
    monkeypatch.setenv("DS_PROFUTILS_STEP_METRICS_PEAK_TFLOPS", "null")
    assert load_config({"step_metrics": {"peak_tflops": 312}}).step_metrics.peak_tflops is None  # the last word
    monkeypatch.setenv("DS_PROFUTILS_PROFILER_PEAK_TFLOPS", "312")  # the profiler's figure reads the same way
    assert load_config({}).profiler.peak_tflops == 312.0


@pytest.mark.parametrize("text, line", [
    ("fast", 'DS_PROFUTILS_STEP_METRICS_PEAK_TFLOPS: "fast" is not allowed; expected a number, or null '
     "(sets step_metrics.peak_tflops)"),
    ("inf", 'DS_PROFUTILS_STEP_METRICS_PEAK_TFLOPS: "inf" is not allowed; expected a number, or null '
     "(sets step_metrics.peak_tflops)"),
    ("0", "DS_PROFUTILS_STEP_METRICS_PEAK_TFLOPS: 0.0 is not allowed; expected a number > 0.0 "
     "(sets step_metrics.peak_tflops)"),
])
def test_a_bad_peak_from_the_environment_names_the_variable(monkeypatch, text, line):
    monkeypatch.setenv("DS_PROFUTILS_STEP_METRICS_PEAK_TFLOPS", text)
    with pytest.raises(ConfigError) as excinfo:
        load_config({})
    assert problem_lines(excinfo) == [line]


def test_unknown_step_metrics_variable_says_the_fields(monkeypatch):
    monkeypatch.setenv("DS_PROFUTILS_STEP_METRICS_MONITOR", "3")
    with pytest.raises(ConfigError) as excinfo:
        config_from_raw({}, strict=True)
    assert problem_lines(excinfo) == [
        "DS_PROFUTILS_STEP_METRICS_MONITOR: unknown variable "
        "(did you mean DS_PROFUTILS_STEP_METRICS_MONITOR_INTERVAL?); step_metrics settings are "
        "DS_PROFUTILS_STEP_METRICS_<FIELD> with FIELD one of CONSOLE, ENABLED, HANG_TIMEOUT_S, LOG_INTERVAL, "
        "MEMORY, MONITOR_INTERVAL, OUTPUT_DIR, PEAK_TFLOPS, RANKS"]


def test_step_metrics_keyword_arguments_merge_in_the_order(monkeypatch):
    section = load_config({"step_metrics": {"monitor_interval": 5}}).step_metrics
    assert resolve_section(section, {"peak_tflops": 100.0, "console": None}) == StepMetricsConfig(
        monitor_interval=5, peak_tflops=100.0)
    with pytest.raises(ConfigError, match=r"step_metrics\.monitor_interval: 0 is not allowed"):
        resolve_section(section, {"monitor_interval": 0})
    monkeypatch.setenv("DS_PROFUTILS_STEP_METRICS_MONITOR_INTERVAL", "7")
    assert resolve_section(section, {"monitor_interval": 2}).monitor_interval == 7


def test_step_metrics_ranks_outside_the_world():
    with pytest.raises(ConfigError, match=r"step_metrics\.ranks: ranks \[2\] are outside the world size 2"):
        check_ranks("step_metrics.ranks", load_config({"step_metrics": {"ranks": [0, 2]}}).step_metrics.ranks, 2)


def test_misspelt_step_metrics_is_warned(ds_caplog, fresh_warnings, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    load_config({"step_metric": {"enabled": True}, "steps_per_print": 10})  # DeepSpeed's own key is not one
    assert [r.getMessage() for r in ds_caplog.records if r.levelname == "WARNING"] == [
        'ds_profutils: top-level key "step_metric" is not one of our sections (did you mean step_metrics?); '
        "DeepSpeed ignores unknown keys, so its settings are never read and step_metrics stays off"]


# --- read as DeepSpeed reads them ----------------------------------------------------------------------


def test_a_whole_number_float_is_read_as_the_integer_as_hjson_and_deepspeed_read_it(tmp_path):
    """hjson (check-config, DeepSpeed's file reader) reads ``2.0`` as 2; the Trainer and Accelerate hand the engine
    ``json.load``'s 2.0, which DeepSpeed's own pydantic config takes for its integer keys: so do we, everywhere."""
    raw = {"profiler": {"active": 2.0, "ranks": [1.0, 0]}, "step_metrics": {"monitor_interval": 5.0},
           "trace_capture": {"ranks": [2.0]}, "memory_snapshot": {"at_steps": [3.0]}}
    config = load_config(raw)
    assert (config.profiler.active, config.profiler.ranks, config.step_metrics.monitor_interval) == (2, [0, 1], 5)
    assert (config.trace_capture.ranks, config.memory_snapshot.at_steps) == ([2], [3])
    assert type(config.profiler.active) is int and type(config.step_metrics.monitor_interval) is int
    assert load_config(write(tmp_path, json.dumps(raw))) == config
    assert resolve_section(config.step_metrics, {"log_interval": 4.0}).log_interval == 4
    with pytest.raises(ConfigError) as excinfo:
        load_config({"profiler": {"active": 2.5, "with_stack": 1.0}, "nvtx": {"enabled": 1.0}})
    assert problem_lines(excinfo) == ["profiler.active: 2.5 is not allowed; expected an integer",
                                      "profiler.with_stack: 1.0 is not allowed; expected true or false",
                                      "nvtx.enabled: 1.0 is not allowed; expected true or false"]


def test_rank_words_are_read_in_any_case_in_a_file_as_in_the_environment():
    config = load_config({"step_metrics": {"ranks": "ALL"}, "profiler": {"ranks": " All "},
                          "trace_capture": {"ranks": "SUSPECTS"}})
    assert (config.step_metrics.ranks, config.profiler.ranks, config.trace_capture.ranks) == (None, None, "suspects")
    assert load_config({"trace_capture": {"ranks": "ALL"}}).trace_capture.ranks is None


def test_an_infinite_or_nan_number_is_refused_naming_the_key(tmp_path):
    """``json.load`` (the Trainer's, Accelerate's) reads ``1e999`` as infinity, which hjson refuses: a peak of
    infinity would make every MFU 0."""
    raw = '{"step_metrics": {"peak_tflops": 1e999}, "trace_capture": {"step_jump": NaN}}'
    with pytest.raises(ConfigError) as excinfo:
        load_config(json.loads(raw))
    assert problem_lines(excinfo) == [
        "step_metrics.peak_tflops: Infinity is not allowed: input should be a finite number",
        "trace_capture.step_jump: NaN is not allowed: input should be a finite number"]


@pytest.mark.parametrize("section", ["profiler", "partitioned_param_profiler", "step_metrics", "memory_snapshot",
                                     "trace_capture"])
def test_an_output_dir_with_a_nul_character_is_refused_naming_the_key(section):
    """No file system takes a NUL in a path: refused when the config loads, not at the first write."""
    with pytest.raises(ConfigError) as excinfo:
        load_config({section: {"output_dir": "/tmp/a\u0000b"}})
    assert problem_lines(excinfo) == [
        f'{section}.output_dir: "/tmp/a\\u0000b" is not allowed; expected a path without a NUL character']
