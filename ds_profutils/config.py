"""Typed ds_profutils settings, read from the same ds_config.json a job passes to DeepSpeed.

Our sections (``profiler``, ``nvtx``, ``partitioned_param_profiler``) sit beside DeepSpeed's own keys,
which DeepSpeed tolerates.  Each section is a pydantic model that rejects unknown keys, so a typo
fails at start instead of silently switching a feature off.  DeepSpeed's keys that we read
(``wall_clock_breakdown``, ``timers``, ``steps_per_print``, ``comms_logger``) keep DeepSpeed's meaning,
except that ``"comms_logger": {"enabled": false}`` really means off.

A section that is absent means its feature is off and costs nothing.
"""
from __future__ import annotations

from typing import List, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "CommsLoggerSettings",
    "NvtxConfig",
    "PartitionedParamProfilerConfig",
    "ProfilerConfig",
    "ProfUtilsConfig",
    "SUMMARY_SORT_KEYS",
    "check_ranks",
]

# Keys torch's ``key_averages().table(sort_by=...)`` understands (attributes of FunctionEventAvg).
# Checked when the config loads, so a typo does not surface only after a long run.
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
    "flops",
    "count",
)

RankList = Optional[List[int]]


class _Section(BaseModel):
    """Base of our own sections: unknown keys are errors, values are checked on assignment too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


def _validate_ranks(ranks: RankList) -> RankList:
    if ranks is None:
        return None
    negative = [r for r in ranks if r < 0]
    if negative:
        raise ValueError(f"ranks must be global ranks >= 0 (or null for all ranks), got {negative}")
    return sorted(set(ranks))


def check_ranks(key: str, ranks: RankList, world_size: int) -> None:
    """Fail at run time when a configured rank does not exist in this job (``key`` names the option)."""
    if ranks is None:
        return
    missing = [r for r in ranks if r >= world_size]
    if missing:
        raise ValueError(f"{key}: ranks {missing} are outside the world size {world_size}; "
                         f"allowed: global ranks 0..{world_size - 1}, or null for all ranks")


class ProfilerConfig(_Section):
    """The ``"profiler"`` section: torch.profiler's schedule and outputs, and Nsight capture ranges."""

    enabled: bool = True
    output_dir: str = "./profiler_logs"
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
    nsight_output: str = "nsight_profile"
    ranks: RankList = None
    summary_ranks: RankList = Field(default_factory=lambda: [0])
    summary_sort_by: str = "self_cpu_time_total"
    summary_row_limit: int = Field(20, ge=1)

    _check_ranks = field_validator("ranks", "summary_ranks")(_validate_ranks)

    @field_validator("summary_sort_by")
    @classmethod
    def _known_sort_key(cls, value: str) -> str:
        if value not in SUMMARY_SORT_KEYS:
            raise ValueError(f"unknown sort key {value!r}; allowed: {', '.join(SUMMARY_SORT_KEYS)}")
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
    output_dir: str = "./profiler_logs"
    ranks: RankList = None
    log_interval: int = Field(1, ge=1, description="write one record every this many optimizer steps")
    trace_ranges: bool = True

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
    steps_per_print: Optional[int] = Field(None, ge=1)
    comms_logger: CommsLoggerSettings = Field(default_factory=CommsLoggerSettings)
