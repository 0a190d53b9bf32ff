"""Typed ds_profutils settings, read from the same ds_config.json a job passes to DeepSpeed.

Our sections (``profiler``, ``nvtx``, ``partitioned_param_profiler``) sit beside DeepSpeed's own keys,
which DeepSpeed tolerates.  Each section is a pydantic model that rejects unknown keys, so a typo
fails at start instead of silently switching a feature off.  DeepSpeed's keys that we read
(``wall_clock_breakdown``, ``timers``, ``steps_per_print``, ``comms_logger``) keep DeepSpeed's meaning,
except that ``"comms_logger": {"enabled": false}`` really means off.

A section that is absent means its feature is off and costs nothing.

Every feature takes its settings through one path, so one order holds everywhere:
``DS_PROFUTILS_<SECTION>_<FIELD>`` environment variable > keyword arguments > config section > off.
:func:`load_config` reads a source and applies the environment; :func:`resolve_section` merges a
feature's keyword arguments into its section and applies the environment again, last.

This module holds the section models and that order, and is the one to import from.  Reading a file
(:mod:`.config_file`), the environment variables (:mod:`.config_env`) and the wording of problems
(:mod:`.config_errors`) each live in a module of their own.
"""
from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple, Type, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .config_env import BOOL_FALSE, BOOL_TRUE, ENV_PREFIX, _apply_environment, _read_environment, environment_overrides
from .config_errors import ConfigError, ConfigProblem, _not_allowed, _problems, _show
from .config_file import read_config_file

if TYPE_CHECKING:
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine

__all__ = [
    "BOOL_FALSE",
    "BOOL_TRUE",
    "CommsLoggerSettings",
    "ConfigError",
    "ConfigProblem",
    "ConfigSource",
    "ENV_PREFIX",
    "NvtxConfig",
    "PartitionedParamProfilerConfig",
    "ProfilerConfig",
    "ProfUtilsConfig",
    "SECTIONS",
    "SUMMARY_SORT_KEYS",
    "ThroughputTimerSettings",
    "TimersSettings",
    "check_ranks",
    "environment_overrides",
    "load_config",
    "resolve_section",
]

# --------------------------------------------------------------------------------------------------
# Section models
# --------------------------------------------------------------------------------------------------

# Keys torch's ``key_averages().table(sort_by=...)`` understands: attributes of FunctionEventAvg, where
# torch maps "cuda"/"xpu" to "device".  Checked when the config loads, so a typo does not surface only
# after a long run.
SUMMARY_SORT_KEYS = (
    "cpu_time",
    "cpu_time_total",
    "self_cpu_time_total",
    "cpu_memory_usage",
    "self_cpu_memory_usage",
    "device_time",
    "device_time_total",
    "self_device_time_total",
    "device_memory_usage",
    "self_device_memory_usage",
    "cuda_time",
    "cuda_time_total",
    "self_cuda_time_total",
    "cuda_memory_usage",
    "self_cuda_memory_usage",
    "xpu_time",
    "xpu_time_total",
    "self_xpu_time_total",
    "xpu_memory_usage",
    "self_xpu_memory_usage",
    "flops",
    "count",
)

RankList = Optional[List[int]]


class _Section(BaseModel):
    """Base of our own sections: unknown keys are errors, values are checked on assignment too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


def _rank_list_input(value: Any) -> Any:
    """Accept ``"all"`` (as the environment spells it) for null, and tuples or ranges from Python callers."""
    if value == "all":
        return None
    if isinstance(value, (tuple, range)):
        return list(value)
    return value


def _validate_ranks(ranks: RankList) -> RankList:
    if ranks is None:
        return None
    if any(r < 0 for r in ranks):
        raise ValueError("global ranks >= 0, or null for all ranks")
    return sorted(set(ranks))


def check_ranks(key: str, ranks: RankList, world_size: int) -> None:
    """Fail at run time when a configured rank does not exist in this job (``key`` names the option).

    The world size is only known once the job runs, so this cannot be part of loading the file.
    """
    if ranks is None:
        return
    missing = [r for r in ranks if r >= world_size]
    if missing:
        raise ConfigError([
            ConfigProblem(
                key, f"ranks {_show(missing)} are outside the world size {world_size}; "
                f"expected global ranks 0..{world_size - 1}, or null for all ranks")
        ])


class ProfilerConfig(_Section):
    """The ``"profiler"`` section: torch.profiler's schedule and outputs, and Nsight capture ranges."""

    enabled: bool = True
    output_dir: str = Field("./profiler_logs", min_length=1)
    skip_first: int = Field(1, ge=0)
    wait: int = Field(1, ge=0)
    warmup: int = Field(1, ge=0)
    active: int = Field(3, ge=1)
    repeat: int = Field(1, ge=0, description="cycles of wait+warmup+active; 0 repeats until the run ends")
    with_stack: bool = False
    with_flops: bool = True
    with_modules: bool = False
    record_shapes: bool = False
    profile_memory: bool = False
    nsight_enabled: bool = False
    nsight_output: str = Field("nsight_profile", min_length=1)
    ranks: RankList = None
    summary_ranks: RankList = Field(default_factory=lambda: [0])
    summary_sort_by: str = "self_cpu_time_total"
    summary_row_limit: int = Field(20, ge=1)

    _rank_input = field_validator("ranks", "summary_ranks", mode="before")(_rank_list_input)
    _check_ranks = field_validator("ranks", "summary_ranks")(_validate_ranks)

    @field_validator("summary_sort_by")
    @classmethod
    def _known_sort_key(cls, value: str) -> str:
        if value not in SUMMARY_SORT_KEYS:
            raise ValueError(f"one of {', '.join(SUMMARY_SORT_KEYS)}")
        return value

    def profiles_rank(self, rank: int) -> bool:
        """True when this global rank records (``ranks`` null means every rank)."""
        return self.ranks is None or rank in self.ranks


class NvtxConfig(_Section):
    """The ``"nvtx"`` section: whether ``instrument_w_nvtx`` pushes ranges, and in which domain."""

    enabled: bool = True
    domain: str = Field("DeepSpeed", min_length=1)

    def apply(self) -> None:
        """Switch ``instrument_w_nvtx`` ranges (process-wide) as this section says."""
        from .nvtx import configure_nvtx

        configure_nvtx(self.enabled, self.domain)


class PartitionedParamProfilerConfig(_Section):
    """The ``"partitioned_param_profiler"`` section: ZeRO-3 parameter-fetch records."""

    enabled: bool = False
    output_dir: str = Field("./profiler_logs", min_length=1)
    ranks: RankList = None
    log_interval: int = Field(1, ge=1, description="write one record every this many optimizer steps")
    trace_ranges: bool = True

    _rank_input = field_validator("ranks", mode="before")(_rank_list_input)
    _check_ranks = field_validator("ranks")(_validate_ranks)

    def profiles_rank(self, rank: int) -> bool:
        """True when this global rank records (``ranks`` null means every rank)."""
        return self.ranks is None or rank in self.ranks


class CommsLoggerSettings(BaseModel):
    """DeepSpeed's ``"comms_logger"`` section, read with ``enabled`` meaning what it says.

    DeepSpeed validates this section itself, so keys we do not know are left alone.
    """

    model_config = ConfigDict(extra="allow")

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    prof_ops: List[str] = Field(default_factory=list)
    debug: bool = False


class ThroughputTimerSettings(BaseModel):
    """DeepSpeed's ``"timers": {"throughput": ...}``: the engine's samples/s timer."""

    model_config = ConfigDict(extra="allow")

    enabled: bool = True
    synchronized: bool = True


class TimersSettings(BaseModel):
    """DeepSpeed's ``"timers"`` section; DeepSpeed reads only ``throughput`` from it."""

    model_config = ConfigDict(extra="allow")

    throughput: ThroughputTimerSettings = Field(default_factory=ThroughputTimerSettings)


class ProfUtilsConfig(BaseModel):
    """Everything ds_profutils reads from one ds_config.json.

    ``profiler`` and ``partitioned_param_profiler`` are off (``enabled=False``) when their section is
    absent; ``nvtx`` is None when absent, which leaves ``instrument_w_nvtx`` behaving as DeepSpeed's.
    """

    model_config = ConfigDict(extra="ignore")

    profiler: ProfilerConfig = Field(default_factory=lambda: ProfilerConfig(enabled=False))
    nvtx: Optional[NvtxConfig] = None
    partitioned_param_profiler: PartitionedParamProfilerConfig = Field(
        default_factory=PartitionedParamProfilerConfig)
    wall_clock_breakdown: bool = False
    timers: TimersSettings = Field(default_factory=TimersSettings)
    steps_per_print: Optional[int] = Field(None, ge=1)
    comms_logger: CommsLoggerSettings = Field(default_factory=CommsLoggerSettings)

    @model_validator(mode="before")
    @classmethod
    def _flops_profiler_breaks_down_wall_clock(cls, data: Any) -> Any:
        """DeepSpeed turns ``wall_clock_breakdown`` on whenever its flops profiler is enabled; so do we."""
        if isinstance(data, Mapping):
            flops_profiler = data.get("flops_profiler")
            if isinstance(flops_profiler, Mapping) and flops_profiler.get("enabled") is True:
                return {**data, "wall_clock_breakdown": True}
        return data


# Our own sections, by their key in ds_config: the only ones environment variables may override.
SECTIONS: Dict[str, Type[_Section]] = {
    "profiler": ProfilerConfig,
    "nvtx": NvtxConfig,
    "partitioned_param_profiler": PartitionedParamProfilerConfig,
}

SectionT = TypeVar("SectionT", bound=_Section)

# --------------------------------------------------------------------------------------------------
# Reading a source
# --------------------------------------------------------------------------------------------------

ConfigSource = Union[None, str, "os.PathLike[str]", Mapping[str, Any], argparse.Namespace, ProfUtilsConfig,
                     "DeepSpeedEngine", "DeepSpeedConfig"]


def _raw_settings(source: ConfigSource) -> Tuple[Any, Optional[str]]:
    """The raw ds_config dict behind ``source``, and the file it came from (for error messages)."""
    if source is None:
        return {}, None
    if isinstance(source, (str, os.PathLike)):
        return read_config_file(source), os.fspath(source)
    if isinstance(source, Mapping):
        return source, None
    if isinstance(source, argparse.Namespace):
        path = getattr(source, "deepspeed_config", None)
        if path is None:
            raise ConfigError([
                ConfigProblem("deepspeed_config", "not set; expected the path given with --deepspeed_config "
                              "(added by deepspeed.add_config_arguments)")
            ])
        return _raw_settings(path)
    # A DeepSpeed engine keeps the dict in engine._config._param_dict (also engine.config); a
    # DeepSpeedConfig keeps it in ._param_dict.
    param_dict = getattr(getattr(source, "_config", source), "_param_dict", None)
    if param_dict is None:
        param_dict = getattr(source, "config", None)
    if isinstance(param_dict, Mapping):
        return param_dict, None
    raise TypeError(f"load_config cannot read settings from a {type(source).__name__}; expected a path, a dict, "
                    "a DeepSpeed engine, an argparse.Namespace with deepspeed_config, or a ProfUtilsConfig")


def load_config(source: ConfigSource = None) -> ProfUtilsConfig:
    """Read ds_profutils settings from what a user has at hand, then apply environment overrides.

    ``source`` is a path to a ds_config json/hjson, a ds_config dict, a DeepSpeed engine (or its
    DeepSpeedConfig), the ``args`` of ``deepspeed.add_config_arguments`` (``args.deepspeed_config``), a
    ``ProfUtilsConfig`` (returned as is), or None (no config: every feature off unless the
    environment says otherwise).  Raises :class:`ConfigError` listing every problem found.
    """
    if isinstance(source, ProfUtilsConfig):
        return source
    raw, origin = _raw_settings(source)
    overrides, problems = _read_environment(SECTIONS)
    config = None
    if not isinstance(raw, Mapping):
        problems.insert(0, ConfigProblem("(top level)", _not_allowed(raw, "a JSON object")))
    else:
        try:
            config = ProfUtilsConfig.model_validate(raw)
        except ValidationError as exc:
            problems[:0] = _problems(exc, ProfUtilsConfig)
    if problems:
        raise ConfigError(problems, origin)
    updates = {}
    for name, fields in overrides.items():
        section = getattr(config, name) or SECTIONS[name]()  # an absent nvtx starts from the defaults
        try:
            updates[name] = _apply_environment(section, name, fields)
        except ConfigError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ConfigError(problems, origin)
    return config.model_copy(update=updates)


def resolve_section(section: SectionT, overrides: Optional[Mapping[str, Any]] = None) -> SectionT:
    """``section`` with a feature's keyword arguments merged in, then the environment applied on top.

    ``overrides`` maps field names to values; None values are skipped, so a feature can forward its
    keyword defaults (``active=None``) as they are.  Bad values raise :class:`ConfigError` naming
    ``<section>.<field>``, as a bad config file would; the environment wins over keyword arguments.
    For ``nvtx``, which is None when absent, pass ``cfg.nvtx or NvtxConfig()``.
    """
    name = next((key for key, model in SECTIONS.items() if isinstance(section, model)), None)
    if name is None:
        raise TypeError(f"resolve_section expects one of {', '.join(m.__name__ for m in SECTIONS.values())}, "
                        f"got {type(section).__name__}")
    given = {field: value for field, value in (overrides or {}).items() if value is not None}
    if given:
        try:
            section = type(section).model_validate({**section.model_dump(), **given})
        except ValidationError as exc:
            raise ConfigError(_problems(exc, type(section), (name, ))) from None
    environment, problems = _read_environment(SECTIONS)
    if problems:
        raise ConfigError(problems)
    return _apply_environment(section, name, environment.get(name, {}))
