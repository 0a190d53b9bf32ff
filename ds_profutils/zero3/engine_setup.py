"""What ``attach`` sets up in a live engine besides fetch records: NVTX, the comms logger, our timers.

Each follows the engine's own ds_config: the ``"nvtx"`` section switches ``instrument_w_nvtx``'s
ranges, ``"comms_logger"`` gets ds_profutils' logger (so ``"enabled": false`` means off), and with
``"wall_clock_breakdown": true`` ds_profutils' constant-memory timers take the place of DeepSpeed's.
Kept apart from the fetch recorder: this reconfigures the process, the recorder only observes.
"""
from __future__ import annotations

from typing import Any, List

from ..comms_logging import install_comms_logger
from ..config import ProfUtilsConfig
from ..exceptions import InvalidArgumentError
from ..nvtx import configure_nvtx
from ..timer import SynchronizedWallClockTimer

__all__ = ["apply_engine_settings", "install_timers"]

_TIMER_HOLDER_DEPTH = 3  # engine -> optimizer -> parameter_offload / optimizer_swapper -> async swapper


def apply_engine_settings(engine: Any, config: ProfUtilsConfig) -> None:
    """Apply the config's ``wall_clock_breakdown``, ``nvtx`` and ``comms_logger`` to ``engine``'s process.

    The timers go first: they may refuse (DeepSpeed's are running) before anything else changes.
    """
    if config.wall_clock_breakdown:
        install_timers(engine)
    if config.nvtx is not None:
        configure_nvtx(config.nvtx.enabled, config.nvtx.domain)
    install_comms_logger(config.comms_logger)


def install_timers(engine: Any) -> SynchronizedWallClockTimer:
    """Put ds_profutils' timer group in place of DeepSpeed's in a live engine; return it.

    DeepSpeed's engine makes one ``SynchronizedWallClockTimer`` and hands it to its optimizer, the
    ZeRO-3 parameter offload and the swappers, which keep it as ``.timers``.  Every such holder
    reachable from the engine through instance attributes gets ours instead, so all of them keep
    timing into one group, now in constant memory.  Call it before training: timers running in
    DeepSpeed's group would be lost (refused with ``InvalidArgumentError``).  Twice is harmless.
    """
    theirs = engine.timers
    if isinstance(theirs, SynchronizedWallClockTimer):
        return theirs
    running = [name for name, timer in theirs.get_timers().items() if timer.started_]
    if running:
        raise InvalidArgumentError(f"install_timers: DeepSpeed's timers {running} are running; install before "
                                   f"training starts")
    ours = SynchronizedWallClockTimer()
    for holder in _holders_of(engine, theirs):
        holder.timers = ours
    return ours


def _holders_of(root: Any, timers: Any) -> List[Any]:
    """Objects reachable from ``root`` through instance attributes whose ``timers`` is ``timers``."""
    holders, seen, level = [], {id(root)}, [root]
    for _ in range(_TIMER_HOLDER_DEPTH + 1):
        following = []
        for obj in level:
            attributes = getattr(obj, "__dict__", None)
            if attributes is None:
                continue
            if attributes.get("timers") is timers:
                holders.append(obj)
            for value in attributes.values():
                if id(value) not in seen and hasattr(value, "__dict__") and not isinstance(value, type):
                    seen.add(id(value))
                    following.append(value)
        level = following
    return holders
