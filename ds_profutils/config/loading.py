"""Where ds_profutils settings come from, and the one order in which they apply.

Every feature takes its settings through one path, so one order holds everywhere:
``DS_PROFUTILS_<SECTION>_<FIELD>`` environment variable > keyword arguments > config section > off.
:func:`load_config` reads a source (a file, a dict, an engine, launcher ``args``) and applies the
environment; :func:`resolve_section` merges a feature's keyword arguments into its section and
applies the environment again, last.
"""
from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any, Mapping, Optional, Tuple, TypeVar, Union

from pydantic import ValidationError

from .env import apply_environment, read_environment, with_values
from .errors import ConfigError, ConfigProblem, not_allowed, problems_from
from .checks import warn_misspelt_sections
from .file import read_config_file
from .models import SECTIONS, ProfUtilsConfig, Section

if TYPE_CHECKING:
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine

__all__ = ["ConfigSource", "config_from_raw", "load_config", "raw_settings", "resolve_section"]

SectionT = TypeVar("SectionT", bound=Section)

ConfigSource = Union[None, str, "os.PathLike[str]", Mapping[str, Any], argparse.Namespace, ProfUtilsConfig,
                     "DeepSpeedEngine", "DeepSpeedConfig"]


def raw_settings(source: ConfigSource) -> Tuple[Any, Optional[str]]:
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
        return raw_settings(path)
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
    environment says otherwise).  Raises :class:`ConfigError` listing every problem found.  A
    top-level key that looks like a misspelt section of ours is logged as a WARNING on rank 0
    (``check-config`` reports it as an error).
    """
    if isinstance(source, ProfUtilsConfig):
        return source
    raw, origin = raw_settings(source)
    if source is not None:
        warn_misspelt_sections(raw, origin)
    return config_from_raw(raw, origin)


def config_from_raw(raw: Any, origin: Optional[str] = None, strict: bool = False) -> ProfUtilsConfig:
    """Our settings in a raw ds_config (``raw_settings``), environment applied; errors name ``origin``.
    ``strict`` (check-config): a ``DS_PROFUTILS_*`` variable naming no setting is an error, not a warning."""
    overrides, problems = read_environment(SECTIONS, strict)
    config = None
    if not isinstance(raw, Mapping):
        problems.insert(0, ConfigProblem("(top level)", not_allowed(raw, "a JSON object")))
    else:
        try:
            config = ProfUtilsConfig.model_validate(raw)
        except ValidationError as exc:
            problems[:0] = problems_from(exc, ProfUtilsConfig)
    if problems:
        raise ConfigError(problems, origin)
    updates = {}
    for name, fields in overrides.items():
        section = getattr(config, name)
        if section is None:  # an absent nvtx (DeepSpeed's switch left alone): only ..._NVTX_ENABLED creates it
            if "enabled" not in fields:
                continue
            section = SECTIONS[name]()
        try:
            updates[name] = apply_environment(section, name, fields)
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
            section = with_values(section, given)
        except ValidationError as exc:
            raise ConfigError(problems_from(exc, type(section), (name, ))) from None
    environment, problems = read_environment(SECTIONS)
    if problems:
        raise ConfigError(problems)
    return apply_environment(section, name, environment.get(name, {}))
