"""``ds-profutils check-config``: each file checked as a job would read it, then what would fail later.

Beyond what loading checks (syntax, duplicate keys, each value), a file is refused for what would
otherwise switch a feature off silently or stop the job once it runs: a misspelt section name, the
fetch profiler without ZeRO stage 3, an output directory that cannot be written, and (with
``--world-size``) a configured rank the job does not have.  Problems go to stderr, one line each;
the resolved settings of a valid file go to stdout, and its warnings (a DeepSpeed monitor enabled whose
package is not installed here, both record sections on below ZeRO stage 3) to stderr.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from typing import Any, List, Mapping, Optional, Sequence, Tuple

from .checks import (missing_monitor_packages, misspelt_sections, output_dir_problems, section_enabled,
                     zero_stage_problems, zero_stage_warnings)
from .env import environment_overrides, raw_with_environment
from .errors import ConfigError, ConfigProblem
from .loading import config_from_raw, raw_settings
from .models import (DEEPSPEED_APPLIED_KEYS, DEEPSPEED_NVTX_DOMAIN, SECTIONS, SHARED_RECORD_KEYS, ProfUtilsConfig,
                     check_ranks)

__all__ = ["EFFECTS_HEADER", "check_files"]


def _render(settings: Mapping[str, Any], indent: str = "") -> List[str]:
    """Settings as indented ``key: value`` lines, values spelled as in JSON (true, null, "text")."""
    lines = []
    for key, value in settings.items():
        if isinstance(value, Mapping) and value:
            lines.append(f"{indent}{key}:")
            lines.extend(_render(value, indent + "  "))
        else:
            lines.append(f"{indent}{key}: {json.dumps(value)}")
    return lines


_RANK_KEYS = (("profiler", "ranks"), ("profiler", "summary_ranks"), ("partitioned_param_profiler", "ranks"),
              ("step_metrics", "ranks"), ("trace_capture", "ranks"))


def _rank_problems(sections: Mapping[str, Any], world_size: int) -> List[ConfigProblem]:
    """Every rank list of an enabled section checked against the job's world size, as the features do at run time
    (a disabled section's ranks are not used).

    ``sections``: the resolved settings, or (when other values are bad) the file's own, so that these
    problems are listed beside the others rather than after they are fixed.
    """
    problems: List[ConfigProblem] = []
    for section, key in _RANK_KEYS:
        # with step_metrics on, the records take its ranks: the fetch section's are not used
        unused = section == "partitioned_param_profiler" and section_enabled(sections, "step_metrics")
        if unused or not section_enabled(sections, section):
            continue
        ranks = sections[section].get(key)
        if not isinstance(ranks, list) or not all(type(rank) is int for rank in ranks):
            continue  # absent, null (every rank), or a bad value loading has named
        try:
            check_ranks(f"{section}.{key}", ranks, world_size)
        except ConfigError as exc:
            problems.extend(exc.problems)
    return problems


def _nvtx_effect(config: ProfUtilsConfig) -> str:
    """What the ``nvtx`` section does in a job, in words (the accelerator is only known there)."""
    if config.nvtx is None:
        return ("absent: instrument_w_nvtx (ds_profutils' and DeepSpeed's own) left as DeepSpeed sets it: "
                "deepspeed.utils.nvtx.enable_nvtx and DEEPSPEED_NVTX_DOMAIN untouched")
    state = "on" if config.nvtx.enabled else "off"
    switch = (f"enabled {json.dumps(config.nvtx.enabled)}: the ranges of instrument_w_nvtx are {state}, ds_profutils' "
              f"and DeepSpeed's own (~85 instrumented DeepSpeed functions; it sets deepspeed.utils.nvtx.enable_nvtx)")
    if config.nvtx.domain == DEEPSPEED_NVTX_DOMAIN:
        return f"{switch}; domain {json.dumps(config.nvtx.domain)}: DeepSpeed's own"
    package = "installed" if importlib.util.find_spec("nvtx") is not None else "not installed"
    return (f"{switch}; domain {json.dumps(config.nvtx.domain)}: names both where the accelerator takes an NVTX domain "
            f"(DeepSpeed's CUDA accelerator with the nvtx package, pip install ds-profutils[nvtx]: {package} here); "
            "elsewhere not applicable, which the job says in one line at start")


def _comms_logger_effect(config: ProfUtilsConfig) -> str:
    """What the ``comms_logger`` section does in a job, in words."""
    if not config.has_comms_logger_section:
        return "absent: DeepSpeed's comms logger left as it is (off unless the job switches it on)"
    state = "on" if config.comms_logger.enabled else "off (DeepSpeed's would be on: the section exists)"
    return (f"present: ds_profutils' logger replaces DeepSpeed's at attach, keeping what DeepSpeed's recorded; "
            f"enabled {json.dumps(config.comms_logger.enabled)}: {state}")


def _shared_record_keys(config: ProfUtilsConfig) -> Optional[str]:
    """How the two record sections combine when both are on (one file per engine and rank), in words."""
    fetches, metrics = config.partitioned_param_profiler, config.step_metrics
    if not (fetches.enabled and metrics.enabled):
        return None
    differing = [key for key in SHARED_RECORD_KEYS if getattr(fetches, key) != getattr(metrics, key)]
    text = ("step_metrics and partitioned_param_profiler are both on: one records file per engine and rank, its "
            f"{', '.join(SHARED_RECORD_KEYS)} from step_metrics; the fetch section adds the fetch events")
    if differing:
        text += "; not used: " + ", ".join(f"partitioned_param_profiler.{key} {json.dumps(getattr(fetches, key))}"
                                           for key in differing)
    return text


EFFECTS_HEADER = "what nvtx and comms_logger do in a job:"


def _resolved(config: ProfUtilsConfig) -> dict:
    """The settings as a job applies them: a section the file leaves out is ``null`` (as ``nvtx`` is), not
    its defaults.  An absent ``comms_logger`` leaves DeepSpeed's logger alone, which its defaults
    (``enabled: false``) would contradict, so the view and the effects below say the same."""
    settings = config.model_dump()
    if not config.has_comms_logger_section:
        settings["comms_logger"] = None
    return settings


def _check(path: str, world_size: Optional[int]) -> Tuple[ProfUtilsConfig, Mapping[str, Any]]:
    """The resolved settings and raw contents of a file that passes every check; ConfigError with every
    problem otherwise."""
    raw, origin = raw_settings(path)
    misspelt = misspelt_sections(raw)
    try:
        config = config_from_raw(raw, origin, strict=True)
    except ConfigError as exc:  # with every other problem the file's own values show (the environment's over them)
        more: List[ConfigProblem] = []
        if isinstance(raw, Mapping):
            named, given = {problem.key for problem in exc.problems}, raw_with_environment(raw, SECTIONS)
            more = [problem for problem in output_dir_problems(given) if problem.key not in named]
            more += _rank_problems(given, world_size) if world_size is not None else []
        raise ConfigError(misspelt + list(exc.problems) + more, origin) from None
    problems = misspelt + zero_stage_problems(raw, config) + output_dir_problems(config.model_dump())
    if world_size is not None:
        problems += _rank_problems(config.model_dump(), world_size)
    if problems:
        raise ConfigError(problems, origin)
    return config, raw


def check_files(paths: Sequence[str], world_size: Optional[int] = None) -> bool:
    """Check each file, print its resolved settings or its problems; True when every file is valid."""
    valid = True
    overrides = environment_overrides()
    for path in paths:
        try:
            config, raw = _check(path, world_size)
        except ConfigError as exc:
            print("\n".join(exc.lines()), file=sys.stderr)
            valid = False
            continue
        below_stage_3 = zero_stage_warnings(raw, config)
        for warning in missing_monitor_packages(raw) + below_stage_3:
            print(f"{path}: WARNING: {warning}", file=sys.stderr)
        print(f"{path}: valid; resolved ds_profutils settings:")
        if overrides:
            print("  (with environment overrides "
                  f"{', '.join(f'{name}={value}' for name, value in sorted(overrides.items()))})")
        print("\n".join(_render(_resolved(config), "  ")))
        if config.memory_snapshot.enabled:
            print("note: memory_snapshot writes only on a CUDA accelerator (the allocator history is CUDA's); "
                  "elsewhere the job says so at start and writes nothing")
        if config.trace_capture.enabled and not config.step_metrics.enabled:
            print(f"note: trace_capture runs the live exchange every {config.step_metrics.monitor_interval} steps "
                  "(step_metrics.monitor_interval) without step_metrics' records or console line")
        shared = None if below_stage_3 else _shared_record_keys(config)  # no fetch records: one section records
        if shared:
            print(f"note: {shared}")
        theirs = {key: raw[key] for key in DEEPSPEED_APPLIED_KEYS if key in raw}
        if theirs:
            print("applied by DeepSpeed, not read by ds_profutils:")
            print("\n".join(_render(theirs, "  ")))
        print(EFFECTS_HEADER)
        print(f"  nvtx: {_nvtx_effect(config)}")
        print(f"  comms_logger: {_comms_logger_effect(config)}")
    return valid
