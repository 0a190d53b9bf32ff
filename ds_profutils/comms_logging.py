"""Per-operation communication statistics, with the API ``deepspeed.comm`` expects of its logger.

``deepspeed.comm`` times each collective and calls ``CommsLogger.append``; ``log_all`` prints (and
optionally returns) counts, latencies and bandwidths per operation and message size.  What differs
from ``deepspeed.utils.comms_logging``:

* ``configure`` reads ``"comms_logger": {"enabled": ...}`` as written, default off (as DeepSpeed's
  docs and ``ds_profutils.config`` say); DeepSpeed switches the logger on as soon as the section
  exists, even with ``"enabled": false``.
* ``calc_bw_log`` raises ``InvalidArgumentError`` naming an unknown op and the known ones, where
  DeepSpeed prints a message and calls ``exit(0)``, ending the job with a success status.  It also
  knows ``all_gather_object`` and ``monitored_barrier``, which ``deepspeed.comm`` times too.
* The per-size summary is computed in one place for ``log_all`` and ``get_operation_summary``.
* ``print_rank_0`` prints on every process before ``deepspeed.comm`` is initialized, where
  DeepSpeed's fails an assertion.
"""
from __future__ import annotations

import sys
from datetime import datetime
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

# Imported once here, not per recorded call: ``append`` runs on every timed collective.  (Free:
# .logging imports it too.)
from deepspeed import comm as dist

from .exceptions import InvalidArgumentError
from .logging import log_dist
from .timer import trim_mean

__all__ = ["CommsLogger", "calc_bw_log", "convert_size", "get_caller_func", "install_comms_logger", "print_rank_0"]

_SIZE_UNITS = ("B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")
_TRIM = 0.1  # share of outliers trimmed from each end of the averages, as in DeepSpeed
_COLUMN = 20  # width of every column in log_all's tables


def get_caller_func(frame: int = 3) -> str:
    """Name of the function ``frame`` levels up the stack from this one.

    ``deepspeed.comm`` uses it as a default argument value, so it runs once at import; the name then
    labels debug log records.
    """
    return sys._getframe(frame).f_code.co_name


def print_rank_0(message: Any) -> None:
    """Print ``message`` on global rank 0; before ``deepspeed.comm`` is initialized, on every process."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message)


def convert_size(size_bytes: float) -> str:
    """Bytes as text in 1024-based units, rounded to two decimals: ``"0B"``, ``"512.0 B"``, ``"1.5 KB"``.

    The unit is chosen by integer comparison, so exact powers of 1024 are never pushed to the unit
    below by floating-point ``log``.
    """
    if size_bytes < 0:
        raise InvalidArgumentError(f"convert_size: size_bytes must be >= 0, got {size_bytes!r}")
    if size_bytes == 0:
        return "0B"
    unit = 0
    while unit < len(_SIZE_UNITS) - 1 and size_bytes >= 1024**(unit + 1):
        unit += 1
    return f"{round(size_bytes / 1024**unit, 2)} {_SIZE_UNITS[unit]}"


# Bandwidth of each collective, per nccl-tests' PERFORMANCE.md: (algbw, busbw) in bytes per ms, from
# the message size in bytes, the duration in ms and the world size.
def _exchange_bw(size: float, duration: float, n: int) -> Tuple[float, float]:
    return size / duration, (size / duration) * ((n - 1) / n)


def _gather_bw(size: float, duration: float, n: int) -> Tuple[float, float]:
    # The message size is one rank's share; the collective moves all n shares.
    return _exchange_bw(size * n, duration, n)


def _all_reduce_bw(size: float, duration: float, n: int) -> Tuple[float, float]:
    return size * 2 / duration, (size / duration) * (2 * (n - 1) / n)


def _point_to_point_bw(size: float, duration: float, n: int) -> Tuple[float, float]:
    return size / duration, size / duration


_BANDWIDTH: Dict[str, Callable[[float, float, int], Tuple[float, float]]] = {
    "all_to_all_single": _exchange_bw,
    "all_to_all": _exchange_bw,
    "all_gather": _gather_bw,
    "all_gather_into_tensor": _gather_bw,
    "all_gather_object": _gather_bw,
    "reduce_scatter": _gather_bw,
    "reduce_scatter_tensor": _gather_bw,
    "all_reduce": _all_reduce_bw,
    "all_reduce_coalesced": _all_reduce_bw,
    "inference_all_reduce": _all_reduce_bw,
    "send": _point_to_point_bw,
    "recv": _point_to_point_bw,
    "isend": _point_to_point_bw,
    "irecv": _point_to_point_bw,
    "batch_isend_irecv": _point_to_point_bw,
    "broadcast": _point_to_point_bw,
    "broadcast_object_list": _point_to_point_bw,
    "reduce": _point_to_point_bw,
    "gather": _point_to_point_bw,
    "scatter": _point_to_point_bw,
    "barrier": _point_to_point_bw,
    "monitored_barrier": _point_to_point_bw,
}


def calc_bw_log(comm_op: str, size: float, duration: float) -> Tuple[float, float]:
    """``(algbw, busbw)`` in Gbps of ``comm_op`` moving ``size`` bytes in ``duration`` ms.

    The world size comes from ``deepspeed.comm`` (1 before it is initialized).
    """
    bandwidth = _BANDWIDTH.get(comm_op)
    if bandwidth is None:
        raise InvalidArgumentError(f"calc_bw_log: unknown comm_op {comm_op!r}; "
                                   f"known ops: {', '.join(sorted(_BANDWIDTH))}")
    if not duration > 0:
        raise InvalidArgumentError(f"calc_bw_log: duration of {comm_op!r} must be > 0 ms, got {duration!r}")
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    algbw, busbw = bandwidth(size, duration, world_size)
    # bytes/ms -> Gbit/s: x 8 bits, x 1000 ms/s, / 1e9.
    return algbw * 8 / 1e6, busbw * 8 / 1e6


def _row(labels: Sequence[Any], numbers: Sequence[float] = ()) -> str:
    """One line of ``log_all``'s tables: cells left-aligned in ``_COLUMN``-wide columns, numbers as ``.2f``."""
    return "".join(f"{cell:<{_COLUMN}}" for cell in labels) + "".join(f"{x:<{_COLUMN}.2f}" for x in numbers)


class CommsLogger:
    """Records each timed collective under its log name and message size; summarises on request.

    ``comms_dict`` is ``{record_name: {msg_size: [count, [latency_ms], [algbw_gbps], [busbw_gbps]]}}``,
    DeepSpeed's layout, which ``get_raw_data`` hands out and the straggler analysis needs per record.
    """

    def __init__(self) -> None:
        from deepspeed.comm.constants import (COMMS_LOGGER_DEBUG_DEFAULT, COMMS_LOGGER_ENABLED_DEFAULT,
                                              COMMS_LOGGER_PROF_ALL_DEFAULT, COMMS_LOGGER_PROF_OPS_DEFAULT,
                                              COMMS_LOGGER_VERBOSE_DEFAULT)

        self.comms_dict: Dict[str, Dict[int, list]] = {}
        self.verbose: bool = COMMS_LOGGER_VERBOSE_DEFAULT
        self.debug: bool = COMMS_LOGGER_DEBUG_DEFAULT
        self.prof_ops: List[str] = list(COMMS_LOGGER_PROF_OPS_DEFAULT)
        self.prof_all: bool = COMMS_LOGGER_PROF_ALL_DEFAULT
        self.enabled: bool = COMMS_LOGGER_ENABLED_DEFAULT

    def configure(self, comms_config: Any) -> None:
        """Apply DeepSpeed's comms config (``deepspeed.comm.config.DeepSpeedCommsConfig``).

        The ``comms_logger`` section itself (DeepSpeed's ``CommsLoggerConfig`` or our
        ``CommsLoggerSettings``) is accepted too.  The logger is on only if the section says
        ``"enabled": true``; the section's other settings apply either way, so a later
        ``deepspeed.comm.configure(enabled=True)`` uses them.
        """
        if hasattr(comms_config, "comms_logger_enabled"):
            section = comms_config.comms_logger if comms_config.comms_logger_enabled else None
        else:
            section = comms_config
        if section is None:
            self.enabled = False
            return
        self.enabled = section.enabled
        self.verbose = section.verbose
        self.debug = section.debug
        self.prof_ops = list(section.prof_ops)
        self.prof_all = section.prof_all

    def start_profiling_comms(self) -> None:
        """Record every collective."""
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        """Record only the ops in ``prof_ops`` (and calls made with ``prof=True``)."""
        self.prof_all = False

    def start_profiling_op(self, op_name_list: List[str]) -> None:
        """Add ops (log names, e.g. ``["all_reduce"]``) to ``prof_ops``."""
        self.prof_ops = self.prof_ops + [op for op in op_name_list if op not in self.prof_ops]

    def stop_profiling_op(self, op_name_list: List[str]) -> None:
        """Remove ops from ``prof_ops``."""
        self.prof_ops = [op for op in self.prof_ops if op not in op_name_list]

    def append(self, raw_name: str, record_name: str, latency: float, msg_size: int) -> None:
        """Record one call of op ``raw_name`` under ``record_name``: ``latency`` ms, ``msg_size`` bytes."""
        algbw, busbw = calc_bw_log(raw_name, msg_size, latency)
        count_and_lists = self.comms_dict.setdefault(record_name, {}).setdefault(msg_size, [0, [], [], []])
        count_and_lists[0] += 1
        count_and_lists[1].append(latency)
        count_and_lists[2].append(algbw)
        count_and_lists[3].append(busbw)
        if self.verbose:
            log_dist(f"comm op: {record_name} | time (ms): {latency:.2f} | msg size: {convert_size(msg_size)} | "
                     f"algbw (Gbps): {algbw:.2f} | busbw (Gbps): {busbw:.2f}", [0])

    def get_raw_data(self) -> Dict[str, Dict[int, list]]:
        """A shallow copy of ``comms_dict``."""
        return self.comms_dict.copy()

    def has_data(self) -> bool:
        """Whether any call was recorded."""
        return bool(self.comms_dict)

    def reset_data(self) -> None:
        """Forget every record (e.g. at an epoch boundary)."""
        self.comms_dict.clear()

    def get_operation_names(self) -> List[str]:
        """The record names seen, in first-seen order."""
        return list(self.comms_dict)

    def get_total_operations(self) -> int:
        """Calls recorded, over all ops and sizes."""
        return sum(vals[0] for sizes in self.comms_dict.values() for vals in sizes.values())

    def get_operation_summary(self, operation_name: str) -> Optional[Dict[int, Dict[str, Any]]]:
        """``{msg_size: summary}`` for one record name (see ``log_all``), or None if never recorded."""
        sizes = self.comms_dict.get(operation_name)
        if sizes is None:
            return None
        return {msg_size: _summary(msg_size, vals) for msg_size, vals in sizes.copy().items()}

    def log_all(self,
                print_log: bool = True,
                show_straggler: bool = False,
                return_dict: bool = False) -> Optional[Dict[str, Any]]:
        """Print and/or return per-op, per-size statistics; latencies in ms, bandwidths in Gbps.

        Averages drop the 10% smallest and largest values.  ``show_straggler`` adds, per record, the
        latency the slowest-to-arrive rank imposed on the others: it all-reduces every latency list
        (MIN) across ranks, so every rank must call it, with the same records.  The returned dict has
        ``summary``, ``straggler_analysis`` (None unless asked for) and ``metadata`` (world_size, rank,
        ISO timestamp), as in DeepSpeed.
        """
        # A snapshot: other threads may record collectives while this runs.
        snapshot = self.comms_dict.copy()
        result: Optional[Dict[str, Any]] = None
        if return_dict:
            initialized = dist.is_initialized()
            result = {
                "summary": {},
                "straggler_analysis": None,
                "metadata": {
                    "world_size": dist.get_world_size() if initialized else 1,
                    "rank": dist.get_rank() if initialized else 0,
                    "timestamp": datetime.now().isoformat(),
                },
            }
        if print_log:
            print(_row(["Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)",
                        "tput_avg (Gbps)", "busbw_avg (Gbps)"]))
        for record_name, sizes in snapshot.items():
            summaries = {msg_size: _summary(msg_size, vals) for msg_size, vals in sorted(sizes.items())}
            if result is not None:
                result["summary"][record_name] = summaries
            if print_log:
                print(record_name)
                for s in summaries.values():
                    print(_row(["", s["msg_size_str"], s["count"]],
                               [s["total_latency_ms"], s["avg_latency_ms"], s["tput_avg_gbps"], s["busbw_avg_gbps"]]))
        if show_straggler:
            straggler = _straggler_analysis(snapshot, print_log)
            if result is not None:
                result["straggler_analysis"] = straggler
        return result


def _summary(msg_size: int, vals: list) -> Dict[str, Any]:
    """The statistics of one (op, message size) record."""
    count, latencies, algbws, busbws = vals
    return {
        "count": count,
        "total_latency_ms": sum(latencies),
        "avg_latency_ms": trim_mean(latencies, _TRIM),
        "tput_avg_gbps": trim_mean(algbws, _TRIM),
        "busbw_avg_gbps": trim_mean(busbws, _TRIM),
        "msg_size_bytes": msg_size,
        "msg_size_str": convert_size(msg_size),
    }


def _straggler_analysis(snapshot: Dict[str, Dict[int, list]],
                        print_log: bool) -> Dict[str, Dict[int, Dict[str, Any]]]:
    """Per record: the fastest rank's latency (MIN across ranks) and each rank's wait beyond it."""
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm.reduce_op import ReduceOp

    if print_log:
        print("_______________________________")
        print("Breakdown with straggler effect")
        print("-------------------------------")
        print(_row(["Comm. Op", "Message Size", "Count", "Total comm lat(ms)", "Total straggler(ms)",
                    "Avg comm lat(ms)", "Avg straggler(ms)"]))
    device = get_accelerator().current_device_name()
    analysis: Dict[str, Dict[int, Dict[str, Any]]] = {}
    for record_name, sizes in snapshot.items():
        if print_log:
            print(record_name)
        analysis[record_name] = {}
        for msg_size, vals in sorted(sizes.items()):
            latencies = torch.tensor(vals[1], device=device)
            fastest = latencies.clone()
            dist.all_reduce(fastest, op=ReduceOp.MIN)
            waits = latencies - fastest
            row = {
                "count": vals[0],
                "total_comm_lat_ms": fastest.sum().item(),
                "total_straggler_ms": waits.sum().item(),
                "avg_comm_lat_ms": trim_mean(fastest.tolist(), _TRIM),
                "avg_straggler_ms": trim_mean(waits.tolist(), _TRIM),
                "msg_size_bytes": msg_size,
                "msg_size_str": convert_size(msg_size),
            }
            analysis[record_name][msg_size] = row
            if print_log:
                print(_row(["", row["msg_size_str"], row["count"]], [
                    row["total_comm_lat_ms"], row["total_straggler_ms"], row["avg_comm_lat_ms"], row["avg_straggler_ms"]
                ]))
    return analysis


_installed: List[CommsLogger] = []  # loggers install_comms_logger put in place and not yet undone, latest last
_replaced: List[Any] = []  # what the first of them replaced: (deepspeed.comm.comm's logger, the alias's)


def install_comms_logger(settings: Any) -> Callable[[], None]:
    """Make a ``CommsLogger`` of ours, configured by ``settings``, the one ``deepspeed.comm`` times
    collectives with; return what takes it out again.

    ``deepspeed.comm.comm`` looks its logger up by module global on every collective, so replacing
    that global is enough (``deepspeed.comm.comms_logger``, the star-imported alias users read, is
    replaced too).  ``settings`` (the ``comms_logger`` section) is applied with ``enabled`` meaning
    what it says, where DeepSpeed's own logger switches on whenever the section exists.  The new
    logger records into the previous one's ``comms_dict`` (the same object), so what was recorded
    before is kept, and the previous logger, once back, holds what was recorded meanwhile.

    Several engines may install one each and undo in any order: undoing one puts back the latest
    logger still installed, or, after the last, the logger that was there before the first.
    """
    import deepspeed.comm
    from deepspeed.comm import comm as ds_comm

    previous = ds_comm.comms_logger
    if not _installed:
        _replaced[:] = [previous, deepspeed.comm.comms_logger]
    logger = CommsLogger()
    logger.configure(settings)
    records = getattr(previous, "comms_dict", None)
    if isinstance(records, dict):
        logger.comms_dict = records
    _installed.append(logger)
    ds_comm.comms_logger = deepspeed.comm.comms_logger = logger

    def undo() -> None:
        if logger not in _installed:
            return
        _installed.remove(logger)
        in_force, alias = (_installed[-1], _installed[-1]) if _installed else _replaced
        if ds_comm.comms_logger is logger:
            ds_comm.comms_logger = in_force
        if deepspeed.comm.comms_logger is logger:
            deepspeed.comm.comms_logger = alias

    return undo
