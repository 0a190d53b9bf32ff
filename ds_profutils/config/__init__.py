"""Configuration from the job's own ds_config.json: file reading, section models, overrides, wording.

Import from here: ``from ds_profutils.config import load_config, ProfilerConfig, ConfigError``.  Each
concern has its module: :mod:`.file` reads a file as DeepSpeed does, :mod:`.models` holds the
sections, :mod:`.env` the ``DS_PROFUTILS_*`` overrides, :mod:`.loading` the order they apply in,
:mod:`.errors` the wording of problems, :mod:`.checks` what would switch a feature off silently (a
misspelt section) or fail only once the job runs, :mod:`.command` the ``check-config`` subcommand.
Nothing here imports torch or DeepSpeed.
"""
from typing import Any

from .env import BOOL_FALSE, BOOL_TRUE, ENV_PREFIX, environment_overrides
from .errors import ConfigError, ConfigProblem
from .loading import ConfigSource, load_config, raw_settings, resolve_section
from .models import (DEEPSPEED_APPLIED_KEYS, SECTIONS, SHARED_RECORD_KEYS, SUMMARY_SORT_KEYS, CommsLoggerSettings,
                     MemorySnapshotConfig, NvtxConfig, PartitionedParamProfilerConfig, ProfilerConfig, ProfUtilsConfig,
                     StepMetricsConfig, TraceCaptureConfig, check_ranks)

__all__ = [
    "BOOL_FALSE",
    "BOOL_TRUE",
    "CommsLoggerSettings",
    "ConfigError",
    "ConfigProblem",
    "ConfigSource",
    "DEEPSPEED_APPLIED_KEYS",
    "ENV_PREFIX",
    "MemorySnapshotConfig",
    "NvtxConfig",
    "PartitionedParamProfilerConfig",
    "ProfilerConfig",
    "ProfUtilsConfig",
    "SECTIONS",
    "SHARED_RECORD_KEYS",
    "SUMMARY_SORT_KEYS",
    "StepMetricsConfig",
    "TraceCaptureConfig",
    "check_ranks",
    "environment_overrides",
    "load_config",
    "raw_settings",
    "resolve_section",
]

_DEEPSPEED_CONFIG_NAMES = frozenset({"DeepSpeedConfigModel", "TIMERS_FORMAT", "TIMERS", "TIMERS_THROUGHPUT",
                                     "get_timers_config", "DeepSpeedThroughputTimerConfig"})
"""The names of ``deepspeed.utils.config`` (the timers' section), this package's namesake in the mirror."""


def __getattr__(name: str) -> Any:
    """``deepspeed.utils.config``'s names, read through to it on first use (so that importing this package, as
    the command line does, still imports no DeepSpeed)."""
    if name not in _DEEPSPEED_CONFIG_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from deepspeed.utils import config as deepspeed_config

    return getattr(deepspeed_config, name)
