"""``attach(engine)``: per-step ZeRO-3 parameter-fetch records from a live DeepSpeed engine.

DeepSpeed 0.19's ZeRO-3 parameter coordinator times every fetch through a profiler object that is
switched off in source (``ENABLE_PROFILER = False``).  ``attach`` swaps that object for our
``PartitionedParameterProfiler`` on the engine's coordinator, without editing DeepSpeed, and writes
one JSON line per step and rank to ``{output_dir}/zero_fetch_rank_{rank}.jsonl``.

Step boundaries are ours, not DeepSpeed's: DeepSpeed resets its counters at the *next* forward, so a
record is opened when a forward starts (that is when the step number is read), and written when
``engine.step()`` returns -- or, for an eval forward, when the next forward starts or the process
exits.  Steps that ``log_interval`` skips run with a disabled profiler, so they cost nothing.
"""
from __future__ import annotations

import atexit
import functools
import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import deepspeed
import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .comms_logging import install_comms_logger
from .config import PartitionedParamProfilerConfig, check_ranks, load_config, resolve_section
from .dist_env import global_rank, hostname, world_size
from .fetch_report import RECORD_FILE
from .logging import log_dist, warning_once
from .nvtx import ranges_active
from .partitioned_param_profiler import PartitionedParameterProfiler
from .timer import install_timers

__all__ = ["AttachError", "SUPPORTED_DEEPSPEED", "ZeroFetchRecorder", "attach"]

SUPPORTED_DEEPSPEED = SpecifierSet(">=0.19.0,<0.20")
"""DeepSpeed releases whose coordinator layout ``attach`` knows (one coordinator per engine, its
profiler in the name-mangled ``__profiler`` attribute, DeepSpeed's event names)."""

_PROFILER_ATTR = "_PartitionedParameterCoordinator__profiler"
_RECORDER_ATTR = "_ds_profutils_fetch_recorder"
_NS_PER_MS = 1e6


class AttachError(RuntimeError):
    """``attach`` does not recognise this engine; the engine was left as it was."""


def _refuse(reason: str) -> AttachError:
    return AttachError(f"ds_profutils.attach: {reason}; the engine was left untouched. Switch "
                       "\"partitioned_param_profiler\" off (or DS_PROFUTILS_PARTITIONED_PARAM_PROFILER_ENABLED=0) "
                       "to run without ZeRO-3 fetch records.")


def _coordinators(engine: Any) -> List[Any]:
    """The engine's ZeRO-3 parameter coordinators, or AttachError saying why there are none we know."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    from deepspeed.runtime.zero.partitioned_param_profiler import \
        PartitionedParameterProfiler as DeepSpeedProfiler

    version = Version(deepspeed.__version__)
    if not SUPPORTED_DEEPSPEED.contains(version, prereleases=True):
        raise _refuse(f"DeepSpeed {version} is not a version whose ZeRO-3 coordinator it knows "
                      f"(supported: {SUPPORTED_DEEPSPEED})")
    if getattr(engine, "is_compiled", False) or hasattr(getattr(engine, "module", None), "_orig_mod"):
        raise _refuse("the engine runs under torch.compile, where ZeRO-3 fetches are not the eager "
                      "coordinator's; attach before compiling, or profile an uncompiled run")
    if getattr(engine, "is_deepcompile_active", lambda: False)():
        raise _refuse("DeepCompile is active and fetches parameters with its own graph passes, not the coordinator")
    stage = engine.zero_optimization_stage()
    if stage != 3:
        raise _refuse(f"ZeRO stage {stage} does not partition parameters, so there are no fetches to record "
                      "(zero_optimization.stage must be 3)")
    optimizer = engine.optimizer
    offload = optimizer if isinstance(optimizer, DeepSpeedZeRoOffload) else getattr(optimizer, "parameter_offload",
                                                                                    None)
    coordinator = offload.get_param_coordinator() if isinstance(offload, DeepSpeedZeRoOffload) else None
    if not isinstance(coordinator, PartitionedParameterCoordinator):
        raise _refuse(f"no ZeRO-3 parameter coordinator found behind the engine's {type(optimizer).__name__}")
    current = vars(coordinator).get(_PROFILER_ATTR)
    if not isinstance(current, (DeepSpeedProfiler, PartitionedParameterProfiler)):
        raise _refuse("the parameter coordinator has no profiler where DeepSpeed 0.19 keeps it")
    return [coordinator]


class ZeroFetchRecorder:
    """Owns the fetch profiler of an engine's coordinators and its per-rank JSONL file.

    Returned by ``attach``; ``close()`` (also at exit, or leaving a ``with`` block) writes the last
    record, puts DeepSpeed's profilers back and closes the file.
    """

    def __init__(self, engine: Any, coordinators: Sequence[Any], settings: PartitionedParamProfilerConfig, *,
                 rank: int, world_size: int, host: str, dtype: torch.dtype) -> None:
        self.settings = settings
        self.rank = rank
        self.path = Path(settings.output_dir) / RECORD_FILE.format(rank=rank)
        # DeepSpeed's ENABLE_PROFILER hands the engine's timers over; ours only take them as the "on" switch.
        self.profiler = PartitionedParameterProfiler(engine.timers,
                                                     element_size=torch.empty((), dtype=dtype).element_size())
        self._idle = PartitionedParameterProfiler(None)
        self._identity = {"rank": rank, "world_size": world_size, "host": host, "dtype": str(dtype)[len("torch."):],
                          "recording_ranks": settings.ranks}
        self._engine = engine
        self._originals = [(coordinator, vars(coordinator)[_PROFILER_ATTR]) for coordinator in coordinators]
        self._pending: Optional[Dict[str, Any]] = None
        self._start_ns = self._end_ns = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("w", encoding="utf-8")  # a fresh file per run
        # prepend: our boundary must come before DeepSpeed's reset_step(), which resets and logs counters.
        self._hooks = [
            engine.module.register_forward_pre_hook(self._forward_started, prepend=True),
            engine.module.register_forward_hook(self._forward_ended),
        ]
        original_step = engine.step

        @functools.wraps(original_step)
        def step(*args: Any, **kwargs: Any) -> Any:
            try:
                return original_step(*args, **kwargs)
            finally:
                self._end_ns = time.perf_counter_ns()
                self._write_pending()

        engine.step = step
        setattr(engine, _RECORDER_ATTR, self)
        atexit.register(self.close)

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran: the file is complete and the engine is DeepSpeed's again."""
        return self._file.closed

    def _install(self, profiler: PartitionedParameterProfiler) -> None:
        for coordinator, _ in self._originals:
            setattr(coordinator, _PROFILER_ATTR, profiler)

    def _forward_started(self, module: torch.nn.Module, args: Any) -> None:
        self._write_pending()  # an eval forward, or a forward whose step() never came
        engine = self._engine
        if engine.global_steps % self.settings.log_interval:
            self._install(self._idle)
            return
        self.profiler.set_trace_ranges(self.settings.trace_ranges and ranges_active())
        self.profiler.reset_events()
        self._install(self.profiler)
        self._pending = {
            "step": engine.micro_steps,
            "global_step": engine.global_steps,
            "mode": "train" if module.training else "eval",
            "time": time.time(),
        }
        self._start_ns = self._end_ns = time.perf_counter_ns()

    def _forward_ended(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._end_ns = time.perf_counter_ns()

    def _write_pending(self) -> None:
        record, self._pending = self._pending, None
        if record is None:
            return
        events = self.profiler.statistics()
        self.profiler.reset_events()
        if not events:
            return
        record.update(self._identity)
        record["step_time_ms"] = (self._end_ns - self._start_ns) / _NS_PER_MS
        record["events"] = events
        try:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
            self._file.flush()
        except OSError as exc:
            self._write_failed(exc)

    def _write_failed(self, exc: OSError) -> None:
        """A full disk must not stop the training it observes: warn once, go on without those records."""
        warning_once(f"ds_profutils: cannot write ZeRO-3 fetch records to {self.path} ({exc.strerror}); "
                     "training goes on, those steps are not recorded")

    def close(self) -> None:
        """Write the open record, give the coordinators DeepSpeed's profilers back, close the file."""
        if self.closed:
            return
        atexit.unregister(self.close)
        self._write_pending()
        try:
            self._file.close()
        except OSError as exc:
            self._write_failed(exc)
        for coordinator, original in self._originals:
            setattr(coordinator, _PROFILER_ATTR, original)
        for hook in self._hooks:
            hook.remove()
        del self._engine.step
        delattr(self._engine, _RECORDER_ATTR)

    def __enter__(self) -> "ZeroFetchRecorder":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def _remove_stale_records(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        return
    except OSError as exc:
        warning_once(f"ds_profutils: cannot remove {path} of an earlier run ({exc.strerror}); "
                     "a report of this output_dir would include it")
        return
    log_dist(f"ds_profutils: removed {path}, written by an earlier run: this rank records no fetches now",
             ranks=[-1])


def attach(engine: Any,
           *,
           enabled: Optional[bool] = None,
           output_dir: Optional[str] = None,
           ranks: Optional[List[int]] = None,
           log_interval: Optional[int] = None,
           trace_ranges: Optional[bool] = None) -> Optional[ZeroFetchRecorder]:
    """Switch on what the engine's ds_config asks of ds_profutils; return the fetch recorder, if any.

    Reads the ``"nvtx"``, ``"comms_logger"`` and ``"partitioned_param_profiler"`` sections and
    ``wall_clock_breakdown`` of the config the engine was built with: the comms logger becomes
    ds_profutils' (so ``"enabled": false`` is off), and with ``wall_clock_breakdown`` the engine's
    timers become ds_profutils' (constant memory; see ``timer.install_timers``).  Keyword arguments
    override the fetch-record section, ``DS_PROFUTILS_*`` variables override both.
    Returns None when fetch records are off, or this rank is not in ``ranks``.  Raises AttachError
    (and changes nothing) on an engine it does not know how to profile.  Calling it again on the same
    engine returns the recorder it already has.
    """
    existing = getattr(engine, _RECORDER_ATTR, None)
    if existing is not None:
        return existing
    config = load_config(engine)
    settings = resolve_section(
        config.partitioned_param_profiler,
        dict(enabled=enabled, output_dir=output_dir, ranks=ranks, log_interval=log_interval,
             trace_ranges=trace_ranges))
    coordinators: List[Any] = []
    if settings.enabled:
        coordinators = _coordinators(engine)
        check_ranks("partitioned_param_profiler.ranks", settings.ranks, world_size())
    if config.wall_clock_breakdown:  # first: it may refuse (running timers) before anything else changes
        install_timers(engine)
    if config.nvtx is not None:
        config.nvtx.apply()
    install_comms_logger(config.comms_logger)
    rank = global_rank()
    if not (settings.enabled and settings.profiles_rank(rank)):
        if settings.enabled:  # this rank's file from an earlier run would pass for this run's in a report
            _remove_stale_records(Path(settings.output_dir) / RECORD_FILE.format(rank=rank))
        return None
    recorder = ZeroFetchRecorder(engine,
                                 coordinators,
                                 settings,
                                 rank=rank,
                                 world_size=world_size(),
                                 host=hostname(),
                                 dtype=engine.get_data_types()[0])
    log_dist(f"ds_profutils: ZeRO-3 fetch records of rank {rank} go to {recorder.path}", ranks=[rank])
    return recorder
