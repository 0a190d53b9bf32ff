"""What ``attach`` sets up in a live engine besides fetch records: NVTX, the comms logger, our timers.

Each follows the engine's own ds_config: the ``"nvtx"`` section switches ``instrument_w_nvtx``'s
ranges (ours and DeepSpeed's) and names their domain, a ``"comms_logger"`` section gets ds_profutils'
logger (so ``"enabled": false`` means off), and with ``"wall_clock_breakdown": true`` ds_profutils'
constant-memory timers take the place of DeepSpeed's.  Everything changed is undone by the callable
:func:`apply_engine_settings` returns.  Kept apart from the fetch recorder: this reconfigures the
process, the recorder only observes.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

from ..comms_logging import install_comms_logger
from ..config import ProfUtilsConfig
from ..nvtx import configure_nvtx
from ..timer import SynchronizedWallClockTimer

__all__ = ["TIMER_HOLDERS", "apply_engine_settings", "install_timers"]

TIMER_HOLDERS: Tuple[Tuple[str, ...], ...] = (
    (),  # the engine
    ("optimizer", ),  # ZeRO-1/2 and ZeRO-3 optimizers, FP16/BF16 optimizers, or ZeRO-3's offload without one
    ("optimizer", "parameter_offload"),  # ZeRO-3: DeepSpeedZeRoOffload, which hands them to its coordinator
    ("optimizer", "optimizer_swapper"),  # ZeRO-3 with the optimizer state on NVMe
    ("optimizer", "optimizer_swapper", "gradient_swapper"),  # its asynchronous gradient swapper
)
"""Where DeepSpeed 0.19.x keeps the engine's timer group, as attribute paths from the engine (each holder
stores it as ``.timers``).  The ZeRO-3 coordinator's profiler is attach's own (``PartitionedParameterProfiler``)."""


def apply_engine_settings(engine: Any, config: ProfUtilsConfig) -> Optional[Callable[[], None]]:
    """Apply the config's ``wall_clock_breakdown``, ``nvtx`` and ``comms_logger`` to ``engine`` and its
    process; return a callable that restores exactly what was changed (None: nothing was).

    Sections the config lacks change nothing: without ``nvtx`` both NVTX switches and domains stay,
    without ``comms_logger`` DeepSpeed's logger stays (with what it recorded).  The undo puts back the
    original timer group on each holder that still has ours, the comms logger object that was in
    place, and the NVTX switches and domains as they were; calling it twice does nothing more.
    """
    undos: List[Callable[[], None]] = []
    if config.wall_clock_breakdown:
        undos.append(install_timers(engine))
    if config.nvtx is not None:
        undos.append(configure_nvtx(config.nvtx.enabled, config.nvtx.domain))
    if config.has_comms_logger_section:
        undos.append(install_comms_logger(config.comms_logger))
    if not undos:
        return None

    def undo() -> None:
        while undos:
            undos.pop()()

    return undo


def _holder(engine: Any, path: Tuple[str, ...]) -> Any:
    """The object at ``path`` from ``engine`` (None where an attribute on the way is missing)."""
    obj = engine
    for attribute in path:
        obj = getattr(obj, attribute, None)
    return obj


def install_timers(engine: Any) -> Callable[[], None]:
    """Put ds_profutils' timer group in place of DeepSpeed's in a live engine; return what puts it back.

    DeepSpeed's engine makes one ``SynchronizedWallClockTimer`` and hands it to the holders named in
    :data:`TIMER_HOLDERS`; each that holds the engine's group gets ours instead, so all keep timing
    into one group, now in constant memory (holders given a ``NoopTimer`` keep it).  An interval
    running at the swap moves to the new group (started there at once), so the engine's ``stop()``
    finds it started; the undo does the same the other way.  An engine whose timers are ours already is left
    as it is (its undo does nothing).
    """
    theirs = engine.timers
    if isinstance(theirs, SynchronizedWallClockTimer):
        return lambda: None
    ours = SynchronizedWallClockTimer()
    holders = [holder for holder in (_holder(engine, path) for path in TIMER_HOLDERS)
               if getattr(holder, "timers", None) is theirs]
    _carry_running_timers(theirs, ours)
    for holder in holders:
        holder.timers = ours

    def undo() -> None:
        restored = [holder for holder in holders if holder.timers is ours]
        if restored:
            _carry_running_timers(ours, theirs)
        for holder in restored:
            holder.timers = theirs

    return undo


def _carry_running_timers(source: Any, destination: Any) -> None:
    """Move each interval running in ``source`` to ``destination``: started there now, abandoned in ``source``
    (``started_ = False``, which DeepSpeed's timers and ours both accept)."""
    for name, timer in source.get_timers().items():
        if timer.started_:
            timer.started_ = False
            if not destination(name).started_:
                destination(name).start()
