"""``attach(engine)``: switch on what the engine's ds_config asks of ds_profutils, and take it off again.

DeepSpeed 0.19's ZeRO-3 parameter coordinator times every fetch through a profiler object that is
switched off in source (``ENABLE_PROFILER = False``).  ``attach`` puts our
``PartitionedParameterProfiler`` in its place on the engine's coordinator, without editing DeepSpeed
(:class:`ds_profutils.zero3.CoordinatorFetches`), and a :class:`~.recorder.StepRecorder` writes one
JSON line per step and rank.  It also applies the config's engine settings (:mod:`.engine_setup`),
the memory snapshot (:mod:`.snapshot`) and the torch profiler driven by the engine's steps
(:mod:`.engine_driven`), all following the engine through one set of hooks (:mod:`.hooks`).  With
``"step_metrics"`` on, a :class:`~.live.LiveMetrics` on every rank takes the recorder's step figures and
sends them, every ``monitor_interval`` steps, to DeepSpeed's monitor, the console and whatever sink a
framework adapter adds (:meth:`Attachment.report_to`).  An engine it does not know is refused, untouched.
:class:`Attachment` is what it returns: ``close()`` takes everything off again.

Step records come from either section.  ``"step_metrics"`` records any ZeRO stage (0-3) and adds FLOPs;
``"partitioned_param_profiler"`` needs stage 3 and adds the fetch events (alone below stage 3 it is
refused; beside ``"step_metrics"`` it is switched off there, said once).  With both on, one file is
written whose shared keys (``output_dir``, ``ranks``, ``log_interval``, ``memory``) are step_metrics':
the section that asks for the records of every stage decides where and how often they are written
(a differing value in the other section is said once, and by ``check-config``).
"""
from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set

import deepspeed
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from deepspeed.accelerator import get_accelerator

from ..config import (SHARED_RECORD_KEYS, PartitionedParamProfilerConfig, ProfUtilsConfig, check_ranks, load_config,
                      resolve_section)
from ..exceptions import InvalidArgumentError
from ..logging import log_dist, logger, warning_once
from ..outputs import ENGINE_NAME, MAIN_ENGINE, ProcessIdentity, fetch_records_file, process_identity
from .._device_clock import process_device_events
from ..zero3 import PartitionedParameterProfiler
from ..zero3.fetches import PROFILER_ATTR
from . import hangs, snapshot
from .capture import attach_capture
from .engine_driven import EngineDrivenProfiler
from .engine_setup import apply_engine_settings
from .hooks import EngineHooks, Listener, do_nothing
from .live import LiveMetrics, LiveSink, monitor_sink
from .live.clock import LiveStepClock
from .live.gather import exchange_group
from .memory import StepMemory
from .pipeline import PipelineHooks, is_pipeline_engine
from .recorder import StepRecorder
from .records_file import config_hash
from .throughput.accelerators import device_name, engine_compute_dtype, resolve_peak
from .throughput.flops import FlopCounter

__all__ = ["ATTACHMENT_ATTR", "AttachError", "Attachment", "SUPPORTED_DEEPSPEED", "attach", "continue_series"]

ATTACHMENT_ATTR = "_ds_profutils_attachment"
"""The engine attribute holding its attachment while attached, so ``attach`` twice returns the same one."""
SUPPORTED_DEEPSPEED = SpecifierSet(">=0.19.0,<0.20")
"""DeepSpeed releases whose coordinator layout ``attach`` knows (one coordinator per engine, its
profiler in the name-mangled ``__profiler`` attribute, DeepSpeed's event names)."""

_attached_names: Dict[str, "weakref.ref[Attachment]"] = {}  # names whose engines are attached now
# The name each engine records under, kept after close (attaching again appends), held beside the engine
# rather than on it: close() leaves nothing on the engine, and a dropped engine is not kept alive.
_engine_names: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
_started_files: Set[Path] = set()  # record files this process started: attaching again appends
_unnamed_attached = 0


class AttachError(RuntimeError):
    """``attach`` does not recognise this engine; the engine was left as it was."""


def _refuse(reason: str) -> AttachError:
    return AttachError(f"ds_profutils.attach: {reason}; the engine was left untouched. Switch "
                       "\"partitioned_param_profiler\" off (or DS_PROFUTILS_PARTITIONED_PARAM_PROFILER_ENABLED=0) "
                       "to run without ZeRO-3 fetch records.")


def _coordinator(engine: Any) -> Any:
    """The engine's ZeRO-3 parameter coordinator, or AttachError saying why there is none we know."""
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
                      "(zero_optimization.stage must be 3; the \"step_metrics\" section records the steps of any "
                      "stage)")
    optimizer = engine.optimizer
    offload = optimizer if isinstance(optimizer, DeepSpeedZeRoOffload) else getattr(optimizer, "parameter_offload",
                                                                                    None)
    coordinator = offload.get_param_coordinator() if isinstance(offload, DeepSpeedZeRoOffload) else None
    if not isinstance(coordinator, PartitionedParameterCoordinator):
        raise _refuse(f"no ZeRO-3 parameter coordinator found behind the engine's {type(optimizer).__name__}")
    current = vars(coordinator).get(PROFILER_ATTR)
    if not isinstance(current, (DeepSpeedProfiler, PartitionedParameterProfiler)):
        raise _refuse("the parameter coordinator has no profiler where DeepSpeed 0.19 keeps it")
    return coordinator


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


def _engine_name(engine: Any, requested: Optional[str]) -> str:
    """The engine's name: kept from an earlier attach, as given, or "main", "engine1", ... in attach order.

    Every rank attaches the same engines in the same order, so unnamed engines get the same names on
    every rank.  A name in use by another engine attached now is an error; the name of an engine whose
    attachment was closed may be taken again (its file is then appended to: a resumed ``train()``).
    """
    global _unnamed_attached
    name = _engine_names.get(engine)
    if name is None:
        if requested is None:
            name = MAIN_ENGINE if _unnamed_attached == 0 else f"engine{_unnamed_attached}"
            _unnamed_attached += 1
        elif not isinstance(requested, str) or not ENGINE_NAME.fullmatch(requested) or requested == MAIN_ENGINE:
            raise InvalidArgumentError(f"attach: name must match {ENGINE_NAME.pattern} and not be {MAIN_ENGINE!r} "
                                       f"(the first unnamed engine's), got {requested!r}")
        else:
            name = requested
        _engine_names[engine] = name
    holder = _attached_names.get(name)
    other = holder() if holder is not None else None
    if other is not None and not other.closed and other.engine is not engine:
        raise InvalidArgumentError(f"attach: an engine named {name!r} is already attached in this process; "
                                   f"give each engine its own name=")
    return name


def continue_series(engine: Any, name: str) -> None:
    """``engine`` continues the records of ``name`` (a framework's next engine for a resumed run): attached
    without a name, it records under ``name`` and appends to its file.  An engine named already keeps its name."""
    _engine_names.setdefault(engine, name)


class Attachment:
    """Everything ``attach`` put on one engine; ``close()`` (also at the end of a ``with`` block) takes it off.

    ``recorder`` is the step recorder (None when neither record section is on, or this rank does not record;
    with ``step_metrics`` on, a rank outside ``ranks`` has one that measures for its listeners and writes no file).
    ``live`` the live metrics (None unless ``"step_metrics"`` is on), which the recorder feeds.
    """

    def __init__(self, engine: Any, name: Optional[str], undo_settings: Optional[Callable[[], None]]) -> None:
        self.engine = engine
        self.name = name
        self.recorder: Optional[StepRecorder] = None
        self.live: Optional[LiveMetrics] = None
        self._hooks: Optional[EngineHooks] = None
        self._undo_settings = undo_settings
        self._closers: List[Callable[[], None]] = []
        self.closed = False
        setattr(engine, ATTACHMENT_ATTR, self)
        if name is not None:
            _engine_names[engine] = name
            _attached_names[name] = weakref.ref(self)

    @property
    def hooks(self) -> EngineHooks:
        """The engine's hooks, put on at the first call (a PipelineEngine's step is its train_batch())."""
        if self._hooks is None:
            self._hooks = (PipelineHooks if is_pipeline_engine(self.engine) else EngineHooks)(self.engine)
        return self._hooks

    def add(self, listener: Listener, close: Callable[[], None]) -> None:
        """Have ``listener`` follow the engine's steps until ``close()``, which calls ``close`` first."""
        self.hooks.add(listener)
        self._closers.append(close)

    def report_to(self, sink: LiveSink) -> None:
        """Send the live events to ``sink`` as well: a framework's own reporting (the Trainer's ``report_to``,
        Accelerate's trackers, Lightning's loggers), added by its adapter, which knows the framework's objects
        while engine/ does not (:meth:`.live.LiveMetrics.add_sink`).  Nothing happens when live metrics are off."""
        if self.live is not None:
            self.live.add_sink(sink)

    def close(self) -> None:
        """Write what is finished and give the engine and the process back as they were before ``attach``."""
        if self.closed:
            return
        self.closed = True
        try:
            for close in self._closers:
                close()
            if self.live is not None:
                self.live.close()  # after the recorder's close: the recorder feeds it
        finally:
            if self._hooks is not None:
                self._hooks.remove()
            if self._undo_settings is not None:
                self._undo_settings()
            if getattr(self.engine, ATTACHMENT_ATTR, None) is self:
                delattr(self.engine, ATTACHMENT_ATTR)

    def __enter__(self) -> "Attachment":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def attach(engine: Any,
           name: Optional[str] = None,
           *,
           config: Any = None,
           enabled: Optional[bool] = None,
           output_dir: Optional[str] = None,
           ranks: Optional[List[int]] = None,
           log_interval: Optional[int] = None,
           trace_ranges: Optional[bool] = None,
           memory: Optional[bool] = None) -> Optional[Attachment]:
    """Switch on what the engine's ds_config asks of ds_profutils; return what was attached, if anything.

    Reads the ``"step_metrics"``, ``"partitioned_param_profiler"``, ``"profiler"``, ``"memory_snapshot"``,
    ``"nvtx"`` and ``"comms_logger"`` sections and ``wall_clock_breakdown`` of the config the engine was built
    with (or ``config``: a path or dict, for an engine built from another).  Keyword arguments override the
    record sections (``enabled`` and ``trace_ranges`` the fetch section's), ``DS_PROFUTILS_*`` variables override
    both.  An enabled ``"profiler"`` section runs the torch profiler from the engine's steps, no decorator
    (docs/profiler.md).

    Several engines in one process (RLHF: actor, critic, ...) each write their own file: the first
    attached without ``name`` is "main" (``zero_fetch_rank_{r}.jsonl``), later unnamed ones "engine1",
    "engine2", ... in attach order; a ``name`` (letters, digits, dashes) writes
    ``zero_fetch_{name}_rank_{r}.jsonl``.  The first attach of a name in a process starts its file;
    attaching again (after ``close()``, or a new engine under the name of a closed one) appends.

    Returns None, touching nothing, when the config asks nothing of the engine.  Raises AttachError
    (and changes nothing) on an engine it does not know how to profile.  Calling it again on an
    attached engine returns the same attachment.
    """
    existing = getattr(engine, ATTACHMENT_ATTR, None)
    if existing is not None:
        return existing
    loaded: ProfUtilsConfig = load_config(engine if config is None else config)
    given = dict(output_dir=output_dir, ranks=ranks, log_interval=log_interval, memory=memory)
    fetch_given = dict(enabled=enabled, trace_ranges=trace_ranges, **given)
    # the shared keywords set the enabled section's records (step_metrics' where both are): a bad one is named there
    metrics = resolve_section(loaded.step_metrics, given) if loaded.step_metrics.enabled else None
    fetch_settings = resolve_section(loaded.partitioned_param_profiler, fetch_given)
    if metrics is None:
        metrics = resolve_section(loaded.step_metrics, given)
    fetch_settings = _fetches_where_partitioned(engine, fetch_settings, metrics)
    settings = _record_settings(fetch_settings, metrics)
    snapshot_settings = resolve_section(loaded.memory_snapshot)
    profiler_settings = resolve_section(loaded.profiler)
    capture = resolve_section(loaded.trace_capture)
    identity = process_identity()
    coordinator = engine_name = None
    if fetch_settings.enabled:  # every check that may refuse comes before anything changes
        coordinator = _coordinator(engine)
    if settings.enabled:  # the records' ranks: step_metrics' where it is on (the fetch section's are not used then)
        check_ranks(f"{'step_metrics' if metrics.enabled else 'partitioned_param_profiler'}.ranks", settings.ranks,
                    identity.world_size)
    if capture.enabled and isinstance(capture.ranks, list):
        check_ranks("trace_capture.ranks", capture.ranks, identity.world_size)
    if settings.enabled or capture.enabled:
        engine_name = _engine_name(engine, name)
    if profiler_settings.enabled:
        profiler_settings.check_world(identity.world_size)
    profiles_here = profiler_settings.enabled and profiler_settings.profiles_rank(identity.rank)
    undo_settings = apply_engine_settings(engine, loaded)  # None: it changed nothing
    records_here = settings.enabled and settings.profiles_rank(identity.rank)
    if settings.enabled and not records_here:  # an earlier run's file would pass for this run's in a report
        _remove_stale_records(fetch_records_file(settings.output_dir, identity.rank, engine_name))
    # live metrics take every rank's figures; trace_capture runs them (writing no records) when step_metrics is off
    measures_here = records_here or metrics.enabled or capture.enabled
    history = snapshot.cuda_allocator_history(get_accelerator()) if snapshot_settings.enabled else None
    if not measures_here and history is None and not profiles_here and undo_settings is None:
        return None
    attachment = Attachment(engine, engine_name, undo_settings)
    profiling = EngineDrivenProfiler(engine, profiler_settings) if profiles_here else None
    if measures_here:
        _attach_recorder(attachment, coordinator, settings, identity, loaded, writes=records_here,
                         metrics=metrics if metrics.enabled or capture.enabled else None,
                         profiler_active=profiling.recording if profiling is not None else None)
    if capture.enabled:
        attach_capture(attachment, capture, metrics.output_dir, profiler_settings, identity)
    if metrics.enabled and metrics.hang_timeout_s:  # every rank, recording or not (docs/hangs.md)
        watch = hangs.watch_engine(attachment.hooks, engine_name, metrics.output_dir, metrics.hang_timeout_s)
        attachment.add(watch, watch.close)
    if profiling is not None:
        attachment.add(profiling, profiling.close)
    if history is not None:
        snapshots = snapshot.MemorySnapshots(snapshot_settings, identity, history)
        attachment.add(snapshot.StepSnapshots(snapshots), snapshots.close)
    return attachment


def _fetches_where_partitioned(engine: Any, fetches: PartitionedParamProfilerConfig,
                               metrics: Any) -> PartitionedParamProfilerConfig:
    """Both record sections on below ZeRO-3: the step records stay, the fetch records (which need stage 3)
    are off, said once; the fetch section alone is refused as before (there is nothing else to record)."""
    if not (fetches.enabled and metrics.enabled):
        return fetches
    stage = engine.zero_optimization_stage()
    if stage == 3:
        return fetches
    warning_once(f"ds_profutils: partitioned_param_profiler is on, but ZeRO stage {stage} does not partition "
                 "parameters: fetch records need zero_optimization.stage 3; the step records of step_metrics go on")
    return fetches.model_copy(update=dict(enabled=False))


def _record_settings(fetches: PartitionedParamProfilerConfig, metrics: Any) -> PartitionedParamProfilerConfig:
    """The records' settings: the fetch section's, with step_metrics' shared keys where it is on (module doc)."""
    if not metrics.enabled:
        return fetches
    differing = [key for key in SHARED_RECORD_KEYS if getattr(fetches, key) != getattr(metrics, key)]
    if fetches.enabled and differing:
        warning_once("ds_profutils: step_metrics and partitioned_param_profiler are both on and differ in "
                     f"{', '.join(differing)}: the records (one file) take step_metrics' values")
    shared = {key: getattr(metrics, key) for key in SHARED_RECORD_KEYS}
    return fetches.model_copy(update=dict(enabled=True, **shared))


def model_numel(engine: Any) -> int:
    """The model's full parameter count (ZeRO-3 keeps each parameter's full size in ``ds_numel``)."""
    return sum(getattr(param, "ds_numel", None) or param.numel() for param in engine.module.parameters())


def _live_settings(metrics: Any) -> Any:
    """step_metrics' settings for the live exchange; with step_metrics off (trace_capture runs the exchange)
    its monitor_interval, no console line."""
    return metrics if metrics.enabled else metrics.model_copy(update=dict(console=False))


def _attach_recorder(attachment: Attachment, coordinator: Any, settings: Any, identity: ProcessIdentity,
                     config: ProfUtilsConfig, *, writes: bool, metrics: Any,
                     profiler_active: Optional[Callable[[], bool]]) -> None:
    engine, name = attachment.engine, attachment.name
    path = fetch_records_file(settings.output_dir, identity.rank, name).resolve()
    accelerator = get_accelerator()
    dtype = engine.get_data_types()[0]
    peak = resolve_peak(metrics.peak_tflops, device_name(accelerator), engine_compute_dtype(engine, dtype)) \
        if metrics else None
    # on every rank (each takes part in the interval's gather), into DeepSpeed's monitor where one is enabled
    sinks = [monitor_sink(engine)] if metrics is not None and metrics.enabled else []  # else: trace_capture's only
    attachment.live = None if metrics is None else LiveMetrics(_live_settings(metrics), peak.tflops, sinks,
                                                               # a pipeline's exchange spans its stages: the whole world
                                                               group=None if is_pipeline_engine(engine) else
                                                               exchange_group(engine))
    recorder = StepRecorder(engine, coordinator, settings,
                            name=name,
                            identity=identity,
                            dtype=dtype,
                            device_events=process_device_events(accelerator),
                            # no peak resets where only trace_capture runs the recorder (no record section on)
                            memory=StepMemory(accelerator) if settings.memory and settings.enabled else None,
                            append=path in _started_files,
                            writes=writes,
                            # a pipeline stage's FLOPs are not one forward's: not counted yet (docs/pipeline.md)
                            flops=FlopCounter() if metrics is not None and metrics.enabled and
                            not is_pipeline_engine(engine) else None,
                            peak_tflops=peak.tflops if peak is not None else None,
                            model_numel=model_numel(engine),
                            config_hash=config_hash(engine),
                            profiler_active=profiler_active,
                            step_listeners=[] if attachment.live is None else [attachment.live.step_finished])
    if writes:
        _started_files.add(path)
    attachment.recorder = recorder
    attachment.add(recorder, recorder.close)
    if attachment.live is not None:  # after the recorder: a step whose figures did not come counts empty
        attachment.add(LiveStepClock(attachment.live), do_nothing)
    if writes and identity.rank == settings.reporting_rank and not recorder.records_file.failed:
        pattern = fetch_records_file(settings.output_dir, "<r>", name)
        ranks_text = "every rank" if settings.ranks is None else f"ranks {settings.ranks}"
        what = "step records" if coordinator is None else "step and ZeRO-3 fetch records"
        print(f"ds_profutils: {what} of engine {name!r} ({ranks_text}) go to {pattern}", flush=True)
        if config.comms_logger.enabled:
            logger.warning("ds_profutils: DeepSpeed's comms logger is on: it synchronizes the device after every "
                           "collective, so step times and waits in the fetch records include those synchronizations "
                           "(each record says \"comms_logger\": true)")
