"""The sections ds_profutils reads from a ds_config.json, as typed models.

Our sections (``profiler``, ``nvtx``, ``partitioned_param_profiler``, ``memory_snapshot``,
``step_metrics``, ``trace_capture``) sit beside DeepSpeed's own keys, which DeepSpeed tolerates.  Each rejects unknown
keys, so a typo inside a section fails at start instead of silently switching a feature off.  Of
DeepSpeed's keys, two change what we do and are read here: ``wall_clock_breakdown`` (ds_profutils'
timers replace DeepSpeed's) and ``comms_logger`` (whose ``"enabled": false`` then really means off).
Others, such as ``timers`` and ``steps_per_print``, DeepSpeed applies itself; we do not read them.
"""
from __future__ import annotations

import typing
from typing import Annotated, Any, Dict, List, Literal, Mapping, Optional, Type, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator,
                      model_validator)

from .errors import ConfigError, ConfigProblem, show_value

__all__ = [
    "CommsLoggerSettings",
    "DEEPSPEED_APPLIED_KEYS",
    "DEEPSPEED_NVTX_DOMAIN",
    "NvtxConfig",
    "PartitionedParamProfilerConfig",
    "ProfilerConfig",
    "MemorySnapshotConfig",
    "ProfUtilsConfig",
    "SECTIONS",
    "SUMMARY_SORT_KEYS",
    "Section",
    "SHARED_RECORD_KEYS",
    "StepMetricsConfig",
    "TraceCaptureConfig",
    "check_ranks",
]

SUMMARY_SORT_KEYS = ("self_cpu_time_total", "cpu_time_total", "count", "flops")
"""Columns the operator summary can be sorted by: host time spent in the operator itself, host time
including the operators it called, calls, and counted FLOPs (named as torch's ``key_averages`` names them)."""

DEEPSPEED_NVTX_DOMAIN = "DeepSpeed"
"""The NVTX domain DeepSpeed names its ranges with (``deepspeed.utils.nvtx``'s default)."""

DEEPSPEED_APPLIED_KEYS = ("timers", "steps_per_print")
"""DeepSpeed's own timing keys, which DeepSpeed's engine applies and ds_profutils does not read."""


def _takes_integers(annotation: Any) -> bool:
    """Whether a field's type is an integer or holds integers (a list of ranks or steps)."""
    return annotation is int or any(_takes_integers(arg) for arg in typing.get_args(annotation))


def _whole_number_as_int(value: Any) -> Any:
    """``2.0`` as 2, in a list too; any other value as it is (``2.5`` stays, to be refused)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return [_whole_number_as_int(item) for item in value] if isinstance(value, list) else value


class Section(BaseModel):
    """Base of our own sections: unknown keys are errors, values are checked on assignment too.

    Strict (``"3"`` is no integer, ``1`` no boolean, infinity and NaN, which ``json.load`` reads from ``1e999`` and
    ``NaN``, no number), except that an integer key takes a whole-number float
    (``2.0``): hjson, DeepSpeed's file reader, reads ``2.0`` as 2, and DeepSpeed's own pydantic config takes
    ``json.load``'s 2.0 (the dict a transformers Trainer or Accelerate hands the engine) for its integer keys.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _whole_numbers_are_integers(cls, value: Any, info: ValidationInfo) -> Any:
        return _whole_number_as_int(value) if _takes_integers(cls.model_fields[info.field_name].annotation) else value


def _without_nul(path: str) -> str:
    if "\0" in path:
        raise ValueError("a path without a NUL character")
    return path


OutputDir = Annotated[str, Field(min_length=1), AfterValidator(_without_nul)]
"""A directory the feature writes to, non-empty: no file system takes a NUL in a path, so one is refused at load."""


def _rank_list_input(value: Any) -> Any:
    """Accept ``"all"`` (in any case, as the environment takes it) for null, and tuples or ranges from Python
    callers."""
    if isinstance(value, str) and value.strip().lower() == "all":
        return None
    if isinstance(value, (tuple, range)):
        return list(value)
    return value


def _validate_ranks(ranks: Optional[List[int]]) -> Optional[List[int]]:
    if ranks is None:
        return None
    if any(r < 0 for r in ranks):
        raise ValueError("global ranks >= 0, or null for all ranks")
    return sorted(set(ranks))


RankList = Annotated[Optional[List[int]], BeforeValidator(_rank_list_input), AfterValidator(_validate_ranks)]
"""Global ranks, sorted and without repeats; null (or ``"all"``) for every rank."""


class _RecordsOnRanks:
    """For sections whose ``ranks`` field (a :data:`RankList`) chooses the ranks that record.

    Not annotated here: pydantic would take the annotation for a field and put it first.
    """

    def profiles_rank(self, rank: int) -> bool:
        """True when this global rank records (``ranks`` null means every rank)."""
        return self.ranks is None or rank in self.ranks

    @property
    def reporting_rank(self) -> int:
        """The rank that says where the files go: the lowest that records (``ranks`` is sorted)."""
        return self.ranks[0] if self.ranks else 0


def check_ranks(key: str, ranks: RankList, world_size: int) -> None:
    """Fail when a configured rank does not exist in a job of ``world_size`` ranks (``key`` names the option).

    The world size is only known once the job runs (or from ``check-config --world-size``), so this
    cannot be part of loading the file.
    """
    if ranks is None:
        return
    missing = [r for r in ranks if r >= world_size]
    if missing:
        raise ConfigError([
            ConfigProblem(
                key, f"ranks {show_value(missing)} are outside the world size {world_size}; "
                f"expected global ranks 0..{world_size - 1}, or null for all ranks")
        ])


class ProfilerConfig(_RecordsOnRanks, Section):
    """The ``"profiler"`` section: torch.profiler's schedule and outputs, and Nsight capture ranges."""

    enabled: bool = True
    output_dir: OutputDir = "./profiler_logs"
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
    summary_ranks: RankList = Field(default_factory=lambda: [0], description="left out: the lowest profiled rank")
    summary_sort_by: str = "self_cpu_time_total"
    summary_row_limit: int = Field(20, ge=1)
    peak_tflops: Optional[float] = Field(None, gt=0, description="the accelerator's peak, for the share of it achieved")

    @field_validator("summary_sort_by")
    @classmethod
    def _known_sort_key(cls, value: str) -> str:
        if value not in SUMMARY_SORT_KEYS:
            raise ValueError(f"one of {', '.join(SUMMARY_SORT_KEYS)}")
        return value

    @model_validator(mode="after")
    def _summary_on_the_lowest_profiled_rank(self) -> "ProfilerConfig":
        """Left out, ``summary_ranks`` is the rank that prints the end-of-run lines (rank 0, else the lowest of
        ``ranks``), so that the printout has its table.  Written into ``__dict__``: it stays "left out" (not in
        ``model_fields_set``) and follows ``ranks`` when an override changes them."""
        if "summary_ranks" not in self.model_fields_set:
            self.__dict__["summary_ranks"] = [self.reporting_rank]
        return self

    def check_world(self, world_size: int) -> None:
        """Fail for ``ranks`` or ``summary_ranks`` outside the job, whose size is known only once it runs."""
        check_ranks("profiler.ranks", self.ranks, world_size)
        check_ranks("profiler.summary_ranks", self.summary_ranks, world_size)


class NvtxConfig(Section):
    """The ``"nvtx"`` section: whether ``instrument_w_nvtx`` pushes ranges, and in which domain."""

    enabled: bool = True
    domain: str = Field(DEEPSPEED_NVTX_DOMAIN, min_length=1)


class _StepRecordSection(_RecordsOnRanks, Section):
    """The keys of every section that switches on the per-step records (one file per engine and rank).

    Either section may switch the records on, and the engine writes one file whichever did: the keys
    that decide where, on which ranks, how often and with what memory figures are declared once here so
    that both sections mean the same by them.
    """

    enabled: bool = False
    output_dir: OutputDir = "./profiler_logs"
    ranks: RankList = None
    log_interval: int = Field(1, ge=1, description="write one record every this many optimizer steps")
    memory: bool = Field(True, description="per-step peak memory in each record (resets the accelerator's peak "
                         "statistics at each phase boundary)")


SHARED_RECORD_KEYS = ("output_dir", "ranks", "log_interval", "memory")
"""The keys both record sections declare.  With both on, the one file per engine and rank takes step_metrics'
values (the section asking for records of every ZeRO stage decides where and how often); the fetch section
adds its events to those records."""


class PartitionedParamProfilerConfig(_StepRecordSection):
    """The ``"partitioned_param_profiler"`` section: ZeRO-3 parameter-fetch records."""

    trace_ranges: bool = True


class StepMetricsConfig(_StepRecordSection):
    """The ``"step_metrics"`` section: per-step records for any ZeRO stage, FLOPs and MFU, and live figures."""

    peak_tflops: Optional[float] = Field(None, gt=0, description="the accelerator's dense peak, for MFU; null: "
                                         "from the table of known accelerators, else no MFU")
    monitor_interval: int = Field(10, ge=1, description="send the live figures every this many optimizer steps")
    console: bool = Field(True, description="one line of the live figures on rank 0's console")
    hang_timeout_s: int = Field(300, ge=0, description="write hang_rank_{r}.json when no optimizer step has ended "
                                "for this many seconds (set it below the process-group timeout); 0: no watchdog")


class MemorySnapshotConfig(Section):
    """The ``"memory_snapshot"`` section: the CUDA allocator's history, written where memory runs out."""

    enabled: bool = False
    output_dir: OutputDir = "./profiler_logs"
    max_entries: int = Field(100_000, ge=1, description="allocations and frees kept (a ring)")
    at_steps: List[int] = Field(default_factory=list, description="global steps after which to write a snapshot")
    on_oom: bool = True

    @field_validator("at_steps")
    @classmethod
    def _steps_are_global_steps(cls, value: List[int]) -> List[int]:
        if any(step < 0 for step in value):
            raise ValueError("global steps >= 0")
        return sorted(set(value))


MAX_LISTED_RANK = 51
"""The highest rank a capture's rank list may name: a listed rank travels in the live exchange as one bit of a
float64 column (a float holds 52 exact bits)."""


def _capture_ranks_input(value: Any) -> Any:
    """``"all"`` is null (every rank); ``"0,3"`` (as the environment spells a list) is ``[0, 3]``.  Anything else
    is refused here, in one message for the key (the union's branches would each name themselves).  Words in any
    case, as the environment takes them."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "suspects":
            return text
        if text in ("all", "null"):
            return None
        if text and all(part.strip().isdigit() for part in text.split(",")):
            return [int(part) for part in text.split(",")]
    value = _rank_list_input(value)
    if value is None or (isinstance(value, list) and all(type(rank) is int for rank in value)):
        return value
    raise ValueError('"suspects", "all" or null (every rank), or global ranks: a list of integers or "0,3"')


def _validate_capture_ranks(ranks: Union[str, List[int], None]) -> Union[str, List[int], None]:
    if isinstance(ranks, list) and any(rank > MAX_LISTED_RANK for rank in ranks):
        raise ValueError(f"global ranks 0..{MAX_LISTED_RANK} (a list travels in the live exchange as a bit mask), "
                         "\"suspects\", "
                         "or null for all ranks")
    return ranks if isinstance(ranks, str) else _validate_ranks(ranks)


CaptureRanks = Annotated[Union[Literal["suspects"], List[int], None], BeforeValidator(_capture_ranks_input),
                         AfterValidator(_validate_capture_ranks)]
"""The ranks a capture traces: ``"suspects"`` (the straggler or slowest rank, the rank that waited most, a median
rank), null or ``"all"`` (every rank), or a list of global ranks."""


class TraceCaptureConfig(Section):
    """The ``"trace_capture"`` section: torch traces of a few steps on the ranks that matter, asked for while
    the job trains (``ds-profutils capture``) or fired by an anomaly the live exchange shows (docs/capture.md)."""

    enabled: bool = False
    output_dir: Optional[OutputDir] = Field(None, description="null: step_metrics' output_dir")
    on_request: bool = Field(True, description="rank 0 looks for capture_request.json once per interval")
    on_anomaly: bool = Field(False, description="capture when a straggler or a step-time jump lasts an interval")
    steps: int = Field(2, ge=1, le=1000, description="optimizer steps traced per capture")
    ranks: CaptureRanks = "suspects"
    max_captures: int = Field(3, ge=0, description="captures per attached engine, requested or fired")
    cooldown_steps: int = Field(100, ge=0, description="steps after a capture before an anomaly fires another")
    step_jump: float = Field(1.5, gt=1, description="the slowest rank's interval median step over the run's median "
                             "so far that counts as a jump")
    gzip: bool = Field(False, description="write trace_rank_{r}.json.gz")


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

    ``profiler``, ``partitioned_param_profiler``, ``memory_snapshot`` and ``step_metrics`` are off
    (``enabled=False``) when their section is absent; ``nvtx`` is None when absent, which leaves
    ``instrument_w_nvtx`` behaving as DeepSpeed's.
    ``comms_logger`` reads as off when absent, and then DeepSpeed's own logger is left in place
    (:attr:`has_comms_logger_section`).
    """

    model_config = ConfigDict(extra="ignore")

    profiler: ProfilerConfig = Field(default_factory=lambda: ProfilerConfig(enabled=False))
    nvtx: Optional[NvtxConfig] = None
    partitioned_param_profiler: PartitionedParamProfilerConfig = Field(
        default_factory=PartitionedParamProfilerConfig)
    memory_snapshot: MemorySnapshotConfig = Field(default_factory=MemorySnapshotConfig)
    step_metrics: StepMetricsConfig = Field(default_factory=StepMetricsConfig)
    trace_capture: TraceCaptureConfig = Field(default_factory=TraceCaptureConfig)
    wall_clock_breakdown: bool = False
    comms_logger: CommsLoggerSettings = Field(default_factory=CommsLoggerSettings)

    @property
    def has_comms_logger_section(self) -> bool:
        """Whether the config has a ``comms_logger`` section: only then does ds_profutils' logger replace
        DeepSpeed's (which the section's mere presence switches on)."""
        return "comms_logger" in self.model_fields_set

    @model_validator(mode="before")
    @classmethod
    def _flops_profiler_breaks_down_wall_clock(cls, data: Any) -> Any:
        """DeepSpeed turns ``wall_clock_breakdown`` on whenever its flops profiler is enabled; so do we.  It takes
        ``enabled`` as written (``wall_clock_breakdown | enabled``), so a non-zero integer (``1``) is on too."""
        if isinstance(data, Mapping):
            flops_profiler = data.get("flops_profiler")
            enabled = flops_profiler.get("enabled") if isinstance(flops_profiler, Mapping) else None
            if isinstance(enabled, int) and enabled:  # true, or an integer other than 0 (bool is an int)
                return {**data, "wall_clock_breakdown": True}
        return data


SECTIONS: Dict[str, Type[Section]] = {
    "profiler": ProfilerConfig,
    "nvtx": NvtxConfig,
    "partitioned_param_profiler": PartitionedParamProfilerConfig,
    "memory_snapshot": MemorySnapshotConfig,
    "step_metrics": StepMetricsConfig,
    "trace_capture": TraceCaptureConfig,
}
"""Our own sections, by their key in ds_config: the only ones environment variables may override."""
