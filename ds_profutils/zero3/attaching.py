"""``attach(engine)``: switch on what the engine's ds_config asks of ds_profutils.

DeepSpeed 0.19's ZeRO-3 parameter coordinator times every fetch through a profiler object that is
switched off in source (``ENABLE_PROFILER = False``).  ``attach`` swaps that object for our
``PartitionedParameterProfiler`` on the engine's coordinator, without editing DeepSpeed, and a
:class:`~.recorder.ZeroFetchRecorder` writes one JSON line per step and rank.  It also applies the
config's engine settings (:mod:`.engine_setup`).  An engine it does not know is refused, untouched.
"""
from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, Dict, List, Optional

import deepspeed
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from deepspeed.accelerator import get_accelerator

from ..config import check_ranks, load_config, resolve_section
from ..exceptions import InvalidArgumentError
from ..logging import log_dist, logger, warning_once
from ..outputs import ENGINE_NAME, MAIN_ENGINE, fetch_records_file, process_identity
from .device_clock import process_device_events
from .engine_setup import apply_engine_settings
from .fetch_profiler import PartitionedParameterProfiler
from .recorder import PROFILER_ATTR, RECORDER_ATTR, ZeroFetchRecorder

__all__ = ["AttachError", "SUPPORTED_DEEPSPEED", "attach"]

NAME_ATTR = "_ds_profutils_engine_name"
"""The engine attribute holding the name it records under."""
_engines_by_name: Dict[str, "weakref.ref[Any]"] = {}
_unnamed_attached = 0

SUPPORTED_DEEPSPEED = SpecifierSet(">=0.19.0,<0.20")
"""DeepSpeed releases whose coordinator layout ``attach`` knows (one coordinator per engine, its
profiler in the name-mangled ``__profiler`` attribute, DeepSpeed's event names)."""



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
    current = vars(coordinator).get(PROFILER_ATTR)
    if not isinstance(current, (DeepSpeedProfiler, PartitionedParameterProfiler)):
        raise _refuse("the parameter coordinator has no profiler where DeepSpeed 0.19 keeps it")
    return [coordinator]


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
    every rank; a name in use by another live engine of this process is an error.
    """
    global _unnamed_attached
    known = getattr(engine, NAME_ATTR, None)
    if known is not None:
        return known
    if requested is None:
        name = MAIN_ENGINE if _unnamed_attached == 0 else f"engine{_unnamed_attached}"
        _unnamed_attached += 1
    elif not isinstance(requested, str) or not ENGINE_NAME.fullmatch(requested) or requested == MAIN_ENGINE:
        raise InvalidArgumentError(f"attach: name must match {ENGINE_NAME.pattern} and not be {MAIN_ENGINE!r} "
                                   f"(the first unnamed engine's), got {requested!r}")
    else:
        name = requested
    holder = _engines_by_name.get(name)
    if holder is not None and holder() is not None and holder() is not engine:
        raise InvalidArgumentError(f"attach: an engine named {name!r} is already attached in this process; "
                                   f"give each engine its own name=")
    _engines_by_name[name] = weakref.ref(engine)
    setattr(engine, NAME_ATTR, name)
    return name


def attach(engine: Any,
           name: Optional[str] = None,
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
    timers become ds_profutils' (constant memory; see ``engine_setup.install_timers``).  Keyword
    arguments override the fetch-record section, ``DS_PROFUTILS_*`` variables override both.

    Several engines in one process (RLHF: actor, critic, ...) each write their own file: the first
    attached without ``name`` is "main" (``zero_fetch_rank_{r}.jsonl``), later unnamed ones "engine1",
    "engine2", ... in attach order; a ``name`` (letters, digits, dashes) writes
    ``zero_fetch_{name}_rank_{r}.jsonl``.

    Returns None when fetch records are off, or this rank is not in ``ranks``.  Raises AttachError
    (and changes nothing) on an engine it does not know how to profile.  Calling it again on the same
    engine returns the recorder it already has.
    """
    existing = getattr(engine, RECORDER_ATTR, None)
    if existing is not None:
        return existing
    config = load_config(engine)
    settings = resolve_section(
        config.partitioned_param_profiler,
        dict(enabled=enabled, output_dir=output_dir, ranks=ranks, log_interval=log_interval,
             trace_ranges=trace_ranges))
    identity = process_identity()
    coordinators: List[Any] = []
    if settings.enabled:  # every check that may refuse comes before anything changes
        coordinators = _coordinators(engine)
        check_ranks("partitioned_param_profiler.ranks", settings.ranks, identity.world_size)
        engine_name = _engine_name(engine, name)
    apply_engine_settings(engine, config)
    if not settings.enabled:
        return None
    if not settings.profiles_rank(identity.rank):  # an earlier run's file would pass for this run's in a report
        _remove_stale_records(fetch_records_file(settings.output_dir, identity.rank, engine_name))
        return None
    recorder = ZeroFetchRecorder(engine,
                                 coordinators,
                                 settings,
                                 name=engine_name,
                                 identity=identity,
                                 dtype=engine.get_data_types()[0],
                                 device_events=process_device_events(get_accelerator()))
    if identity.rank == settings.reporting_rank:
        pattern = fetch_records_file(settings.output_dir, "<r>", engine_name)
        ranks_text = "every rank" if settings.ranks is None else f"ranks {settings.ranks}"
        print(f"ds_profutils: ZeRO-3 fetch records of engine {engine_name!r} ({ranks_text}) go to {pattern}",
              flush=True)
        if config.comms_logger.enabled:
            logger.warning("ds_profutils: DeepSpeed's comms logger is on: it synchronizes the device after every "
                           "collective, so step times and waits in the fetch records include those synchronizations "
                           "(each record says \"comms_logger\": true)")
    return recorder
