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
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import typing
from collections import Counter
from pathlib import Path
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence,
                    Tuple, Type, TypeVar, Union)

import hjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

if TYPE_CHECKING:
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine
    from pydantic_core import ErrorDetails

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
# Errors
# --------------------------------------------------------------------------------------------------


class ConfigProblem(typing.NamedTuple):
    """One thing wrong with the settings: where (``key``) and what, with what is allowed (``message``).

    ``key`` is a dotted key path (``profiler.active``, ``profiler.ranks[0]``), an environment variable,
    or empty when the problem is the file as a whole (unreadable, a syntax error).
    """

    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}" if self.key else self.message


class ConfigError(ValueError):
    """Bad ds_profutils settings; carries every problem found, not just the first.

    A user fixing a config before a long job wants the whole list in one go.  ``str()`` gives one
    line per problem, each prefixed with ``source`` (the file) when there is one.
    """

    def __init__(self, problems: Iterable[ConfigProblem], source: Optional[str] = None) -> None:
        self.problems: Tuple[ConfigProblem, ...] = tuple(problems)
        self.source = source
        super().__init__("\n".join(self.lines()))

    def lines(self) -> List[str]:
        """One line per problem, as ``check-config`` prints them."""
        prefix = f"{self.source}: " if self.source else ""
        return [f"{prefix}{problem}" for problem in self.problems]


def _show(value: Any) -> str:
    """A value as the user wrote it in JSON (``true``, ``"x"``), shortened so a line stays readable."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _not_allowed(value: Any, expected: str) -> str:
    return f"{_show(value)} is not allowed; expected {expected}"


def _key_path(loc: Sequence[Union[str, int]]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


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

# --------------------------------------------------------------------------------------------------
# pydantic errors -> ConfigProblem
# --------------------------------------------------------------------------------------------------

_EXPECTED_BY_ERROR_TYPE = {
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "string_type": "a string",
    "list_type": "a list",
    "model_type": "an object",
}

_COMPARISONS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


def _model_at(root: Type[BaseModel], loc: Sequence[Union[str, int]]) -> Optional[Type[BaseModel]]:
    """The model class that validates the object at ``loc`` (for listing its allowed keys)."""
    model: Any = root
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        candidates = [field.annotation, *typing.get_args(field.annotation)]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return None
    return model


def _unknown_key_message(key: str, allowed: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown key{hint}; allowed keys: {', '.join(sorted(allowed))}"


def _describe(error: "ErrorDetails", root: Type[BaseModel]) -> str:
    """What is wrong with one value and what is allowed, in the words of a JSON user."""
    kind, value, ctx = error["type"], error["input"], error.get("ctx", {})
    if kind == "extra_forbidden":
        model = _model_at(root, error["loc"][:-1])
        return _unknown_key_message(str(error["loc"][-1]), list(model.model_fields) if model else [])
    if kind == "value_error":  # our validators phrase their error as what is expected
        return _not_allowed(value, str(ctx["error"]))
    if kind in _COMPARISONS:
        bound = next(iter(ctx.values()))
        number = "an integer" if isinstance(value, int) else "a number"
        return _not_allowed(value, f"{number} {_COMPARISONS[kind]} {bound}")
    if kind == "string_too_short":
        return _not_allowed(value, "a non-empty string")
    if kind in _EXPECTED_BY_ERROR_TYPE:
        return _not_allowed(value, _EXPECTED_BY_ERROR_TYPE[kind])
    # An error we have no words for (a field added later, say): keep pydantic's.
    return f"{_show(value)} is not allowed: {error['msg'][0].lower()}{error['msg'][1:]}"


def _problems(exc: ValidationError, root: Type[BaseModel], prefix: Tuple[str, ...] = ()) -> List[ConfigProblem]:
    return [ConfigProblem(_key_path(prefix + tuple(e["loc"])), _describe(e, root)) for e in exc.errors()]


# --------------------------------------------------------------------------------------------------
# Environment overrides
# --------------------------------------------------------------------------------------------------

ENV_PREFIX = "DS_PROFUTILS_"

# DS_PROFUTILS_* variables that are not settings (build and test tooling), so not "unknown".
_NOT_SETTINGS = frozenset({"DS_PROFUTILS_TOX_DIR"})

BOOL_TRUE = frozenset({"1", "true", "yes", "on"})
BOOL_FALSE = frozenset({"0", "false", "no", "off"})
_BOOL_EXPECTED = "1/0, true/false, yes/no or on/off (any case)"

_INTEGER = re.compile(r"[+-]?[0-9]+")


def _parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in BOOL_TRUE:
        return True
    if word in BOOL_FALSE:
        return False
    raise ValueError(text)


def _parse_int(text: str) -> int:
    if not _INTEGER.fullmatch(text.strip()):
        raise ValueError(text)
    return int(text)


# How an environment string becomes a value of each field type: (parser, what is allowed).  The
# field's own checks (ranges, sort keys) run afterwards, as for a value from the file.
_ENV_READERS: Dict[Any, Tuple[Callable[[str], Any], str]] = {
    bool: (_parse_bool, _BOOL_EXPECTED),
    int: (_parse_int, "an integer"),
}


def _parse_ranks(text: str) -> RankList:
    return None if text.strip().lower() == "all" else [_parse_int(part) for part in text.split(",")]


def _env_reader(annotation: Any) -> Tuple[Callable[[str], Any], str]:
    if annotation == RankList:
        return _parse_ranks, "comma-separated integers, or all"
    return _ENV_READERS.get(annotation, (str, "a string"))  # str, or a type whose own checks say more


def environment_overrides() -> Dict[str, str]:
    """The ``DS_PROFUTILS_*`` variables set in this process that override settings (for logging them)."""
    return {name: value for name, value in os.environ.items() if name.startswith(ENV_PREFIX)
            and name not in _NOT_SETTINGS}


def _variable(section: str, field: str) -> str:
    return f"{ENV_PREFIX}{section.upper()}_{field.upper()}"


def _split_variable(name: str) -> Tuple[Optional[str], Optional[str], Optional[ConfigProblem]]:
    """Map ``DS_PROFUTILS_<SECTION>_<FIELD>`` to (section, field), or say why it maps to nothing."""
    rest = name[len(ENV_PREFIX):]
    for section, model in SECTIONS.items():
        head = section.upper() + "_"
        if rest.startswith(head):
            field = rest[len(head):].lower()
            if field in model.model_fields:
                return section, field, None
            fields = sorted(model.model_fields)
            close = difflib.get_close_matches(field, fields, n=1)
            hint = f" (did you mean {_variable(section, close[0])}?)" if close else ""
            return None, None, ConfigProblem(
                name, f"unknown variable{hint}; {section} settings are {_variable(section, '<FIELD>')} "
                f"with FIELD one of {', '.join(f.upper() for f in fields)}")
    return None, None, ConfigProblem(
        name, f"unknown variable; expected {ENV_PREFIX}<SECTION>_<FIELD> with SECTION one of "
        f"{', '.join(s.upper() for s in SECTIONS)}")


def _read_environment() -> Tuple[Dict[str, Dict[str, Tuple[str, Any]]], List[ConfigProblem]]:
    """Parse every override: {section: {field: (variable, value)}}, and the problems found."""
    overrides: Dict[str, Dict[str, Tuple[str, Any]]] = {}
    problems: List[ConfigProblem] = []
    for name, text in sorted(environment_overrides().items()):
        section, field, problem = _split_variable(name)
        if problem is not None:
            problems.append(problem)
            continue
        parse, expected = _env_reader(SECTIONS[section].model_fields[field].annotation)
        try:
            value = parse(text)
        except ValueError:
            problems.append(ConfigProblem(name, f"{_not_allowed(text, expected)} (sets {section}.{field})"))
            continue
        overrides.setdefault(section, {})[field] = (name, value)
    return overrides, problems


SectionT = TypeVar("SectionT", bound=_Section)


def _apply_environment(section: SectionT, name: str, overrides: Mapping[str, Tuple[str, Any]]) -> SectionT:
    """``section`` with the environment's values set; errors name the variable that set the bad value."""
    if not overrides:
        return section
    values = {field: value for field, (_, value) in overrides.items()}
    try:
        return type(section).model_validate({**section.model_dump(), **values})
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            field = str(error["loc"][0]) if error["loc"] else ""
            # A check across fields has no single field: name every variable that took part.
            variable = overrides[field][0] if field in overrides else ", ".join(v for v, _ in overrides.values())
            key = _key_path((name, *error["loc"]))
            problems.append(ConfigProblem(variable, f"{_describe(error, type(section))} (sets {key})"))
        raise ConfigError(problems) from None


# --------------------------------------------------------------------------------------------------
# Reading a source
# --------------------------------------------------------------------------------------------------

ConfigSource = Union[None, str, "os.PathLike[str]", Mapping[str, Any], argparse.Namespace, ProfUtilsConfig,
                     "DeepSpeedEngine", "DeepSpeedConfig"]


class _JsonObject(dict):
    """A parsed JSON object that remembers the keys it was given more than once, with their values."""

    duplicates: Dict[str, List[Any]]


def _object_pairs(pairs: List[Tuple[str, Any]]) -> _JsonObject:
    """hjson ``object_pairs_hook``: like DeepSpeed's, but records duplicates so we can name their path."""
    obj = _JsonObject(pairs)
    counts = Counter(key for key, _ in pairs)
    obj.duplicates = {key: [v for k, v in pairs if k == key] for key, n in counts.items() if n > 1}
    return obj


def _duplicate_problems(value: Any, loc: Tuple[Union[str, int], ...] = ()) -> Iterator[ConfigProblem]:
    if isinstance(value, _JsonObject):
        for key, values in value.duplicates.items():
            yield ConfigProblem(_key_path(loc + (key, )),
                                f"duplicate key (values {', '.join(_show(v) for v in values)}); "
                                "expected each key once per object, as DeepSpeed rejects duplicates")
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _duplicate_problems(child, loc + (key, ))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _duplicate_problems(child, loc + (index, ))


def _syntax_problem(text: str, exc: hjson.HjsonDecodeError) -> ConfigProblem:
    """hjson's position, which is where DeepSpeed fails; plus strict JSON's when it is earlier.

    hjson reads unquoted text as strings, so a typo such as ``tru`` or ``01`` is reported where the
    string finally breaks, often at the end of the file; strict JSON points at the typo itself.
    """
    message = f"syntax error at line {exc.lineno}, column {exc.colno}: {exc.msg}"
    try:
        json.loads(text)
    except json.JSONDecodeError as strict:
        if (strict.lineno, strict.colno) < (exc.lineno, exc.colno):
            message += f" (read as strict JSON: line {strict.lineno}, column {strict.colno}: {strict.msg})"
    return ConfigProblem("", message)


def _read_file(path: Union[str, "os.PathLike[str]"]) -> Any:
    """Parse a ds_config file as DeepSpeed does (hjson, duplicate keys rejected); errors as ConfigError."""
    source = os.fspath(path)
    try:
        text = Path(source).read_text(encoding="utf-8")
    except FileNotFoundError:
        where = "" if os.path.isabs(source) else f" (relative to {os.getcwd()})"
        raise ConfigError([ConfigProblem("", f"no such file{where}")], source) from None
    except OSError as exc:
        raise ConfigError([ConfigProblem("", f"cannot read the file: {exc.strerror}")], source) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([ConfigProblem("", f"not UTF-8 text (byte {exc.start})")], source) from None
    try:
        raw = hjson.loads(text, object_pairs_hook=_object_pairs)
    except hjson.HjsonDecodeError as exc:
        raise ConfigError([_syntax_problem(text, exc)], source) from None
    duplicates = list(_duplicate_problems(raw))
    if duplicates:
        raise ConfigError(duplicates, source)
    return raw


def _raw_settings(source: ConfigSource) -> Tuple[Any, Optional[str]]:
    """The raw ds_config dict behind ``source``, and the file it came from (for error messages)."""
    if source is None:
        return {}, None
    if isinstance(source, (str, os.PathLike)):
        return _read_file(source), os.fspath(source)
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
    overrides, problems = _read_environment()
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
    environment, problems = _read_environment()
    if problems:
        raise ConfigError(problems)
    return _apply_environment(section, name, environment.get(name, {}))
