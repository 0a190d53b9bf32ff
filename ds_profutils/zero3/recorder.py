"""The per-step ZeRO-3 fetch records of one engine on one rank.

Step boundaries are ours, not DeepSpeed's: DeepSpeed resets its counters at the *next* forward, so a
record is opened when a forward starts (that is when the step number is read), and written when
``engine.step()`` returns -- or, for an eval forward, when the next forward starts or the process
exits.  Steps that ``log_interval`` skips run with DeepSpeed's own (disabled) profiler, so they cost
what they cost without ds_profutils.  Each record is one line written with one call and flushed, so
every finished step is on disk and a line is never torn by a later kill.
"""
from __future__ import annotations

import atexit
import functools
import json
import time
from typing import Any, Dict, Optional, Sequence

import torch

from ..config import PartitionedParamProfilerConfig
from ..logging import warning_once
from ..nvtx import ranges_active
from ..outputs import fetch_records_file
from .fetch_profiler import PartitionedParameterProfiler

__all__ = ["PROFILER_ATTR", "RECORDER_ATTR", "ZeroFetchRecorder"]

PROFILER_ATTR = "_PartitionedParameterCoordinator__profiler"
"""Where DeepSpeed 0.19's coordinator keeps its profiler (a name-mangled private attribute)."""
RECORDER_ATTR = "_ds_profutils_fetch_recorder"
"""The engine attribute that holds its recorder, so ``attach`` twice returns the same one."""
_NS_PER_MS = 1e6


class ZeroFetchRecorder:
    """Owns the fetch profiler of an engine's coordinators and its per-rank JSONL file.

    Returned by ``attach``; ``close()`` (also at exit, or leaving a ``with`` block) writes the last
    record, puts DeepSpeed's profilers back and closes the file.
    """

    def __init__(self, engine: Any, coordinators: Sequence[Any], settings: PartitionedParamProfilerConfig, *,
                 rank: int, world_size: int, host: str, dtype: torch.dtype) -> None:
        self.settings = settings
        self.rank = rank
        self.path = fetch_records_file(settings.output_dir, rank)
        # DeepSpeed's ENABLE_PROFILER hands the engine's timers over; ours only take them as the "on" switch.
        self.profiler = PartitionedParameterProfiler(engine.timers,
                                                     element_size=torch.empty((), dtype=dtype).element_size())
        self._identity = {"rank": rank, "world_size": world_size, "host": host, "dtype": str(dtype)[len("torch."):],
                          "recording_ranks": settings.ranks}
        self._engine = engine
        self._originals = [(coordinator, vars(coordinator)[PROFILER_ATTR]) for coordinator in coordinators]
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
        setattr(engine, RECORDER_ATTR, self)
        atexit.register(self.close)

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran: the file is complete and the engine is DeepSpeed's again."""
        return self._file.closed

    def _install(self, profiler: PartitionedParameterProfiler) -> None:
        for coordinator, _ in self._originals:
            setattr(coordinator, PROFILER_ATTR, profiler)

    def _install_deepspeeds(self) -> None:
        for coordinator, original in self._originals:
            setattr(coordinator, PROFILER_ATTR, original)

    def _forward_started(self, module: torch.nn.Module, args: Any) -> None:
        self._write_pending()  # an eval forward, or a forward whose step() never came
        engine = self._engine
        if engine.global_steps % self.settings.log_interval:
            self._install_deepspeeds()  # a step not recorded costs what it costs without ds_profutils
            return
        self.profiler.trace_ranges = self.settings.trace_ranges and ranges_active()
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
        self._install_deepspeeds()
        for hook in self._hooks:
            hook.remove()
        del self._engine.step
        delattr(self._engine, RECORDER_ATTR)

    def __enter__(self) -> "ZeroFetchRecorder":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
