"""Rank-aware logging on DeepSpeed's own ``"DeepSpeed"`` logger, as ``deepspeed.utils.logging``.

What differs from DeepSpeed:

* No handler is added here: ``logger`` is the very object DeepSpeed configured, so messages from
  DeepSpeed and from ds_profutils share one handler and one level, and nothing prints twice.
* Records point at the caller of ``log_dist`` (``stacklevel``), not at this file, so DeepSpeed's
  ``[file:line:func]`` prefix names the line that logged.
* A message below the logger's level costs one ``isEnabledFor`` check: the rank is not looked up and
  the message is not formatted.  Above it, the record is DeepSpeed's: ``record.msg`` is the formatted
  ``"[Rank N] message"`` with no args, so filters that match on ``record.msg`` see what they see with
  DeepSpeed.
"""
from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any, Dict, Iterable, Optional

from deepspeed import comm as dist
from deepspeed.utils.logging import LoggerFactory, logger
from deepspeed.utils.torch import required_torch_version  # reachable here as in DeepSpeed's module

from .exceptions import InvalidArgumentError

__all__ = [
    "LoggerFactory",
    "required_torch_version",
    "log_levels",
    "logger",
    "get_dist_msg",
    "log_dist",
    "log_dist_once",
    "print_dist",
    "print_json_dist",
    "get_log_level_from_string",
    "set_log_level_from_string",
    "get_current_level",
    "should_log_le",
    "warning_once",
    "print_configuration",
]

log_levels: Dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

_ALL_RANKS = -1


def _rank_if_logging(ranks: Optional[Iterable[int]]) -> Optional[int]:
    """The rank to print in the prefix when this process should log for ``ranks``, else None.

    DeepSpeed's semantics: before torch.distributed is up every process logs as rank -1; after, a
    process logs only if ``ranks`` holds its rank or starts with -1 (all ranks); an empty or absent
    ``ranks`` then logs nowhere.
    """
    if not dist.is_initialized():
        return _ALL_RANKS
    if not ranks:
        return None
    my_rank = dist.get_rank()
    if my_rank in ranks or next(iter(ranks)) == _ALL_RANKS:
        return my_rank
    return None


def get_dist_msg(message: str, ranks: Optional[Iterable[int]] = None) -> Optional[str]:
    """``"[Rank N] message"`` when this process should log for ``ranks`` (see ``log_dist``), else None."""
    rank = _rank_if_logging(ranks)
    return None if rank is None else f"[Rank {rank}] {message}"


def _log_dist_at(message: Any, ranks: Optional[Iterable[int]], level: int, stacklevel: int) -> None:
    if not logger.isEnabledFor(level):
        return
    rank = _rank_if_logging(ranks)
    if rank is not None:
        logger.log(level, f"[Rank {rank}] {message}", stacklevel=stacklevel + 1)


def log_dist(message: Any, ranks: Optional[Iterable[int]] = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the given global ranks (``[-1]`` for all), prefixed with the rank.

    Before ``torch.distributed`` is initialized every process logs.  The record points at the caller.
    """
    _log_dist_at(message, ranks, level, stacklevel=2)


@functools.lru_cache(None)
def _log_dist_once_cached(message: Any, ranks_key: Optional[tuple], level: int) -> None:
    # stacklevel 3: this function, log_dist_once, then its caller (lru_cache adds no Python frame).
    _log_dist_at(message, ranks_key, level, stacklevel=3)


def log_dist_once(message: Any, ranks: Optional[Iterable[int]] = None, level: int = logging.INFO) -> None:
    """``log_dist`` that emits each distinct (message, ranks, level) once per process."""
    _log_dist_once_cached(message, None if ranks is None else tuple(ranks), level)


def print_dist(message: Any, ranks: Optional[Iterable[int]] = None) -> None:
    """Print (whatever the log level) on the given ranks, with the ``[Rank N]`` prefix."""
    final_message = get_dist_msg(message, ranks)
    if final_message is not None:
        print(final_message)


def print_json_dist(message: Dict[str, Any], ranks: Optional[Iterable[int]] = None, path: Optional[str] = None) -> None:
    """Write ``message`` (with its ``rank`` added) as JSON to ``path`` on the given ranks, fsynced."""
    rank = _rank_if_logging(ranks)
    if rank is None:
        return
    if path is None:
        raise InvalidArgumentError("print_json_dist: path is required (a file to write the JSON to)")
    message["rank"] = rank
    with open(path, "w") as outfile:
        json.dump(message, outfile)
        outfile.flush()
        os.fsync(outfile.fileno())


def get_log_level_from_string(log_level_str: str) -> int:
    """``"info"`` -> ``logging.INFO``; an unknown name raises with the allowed names."""
    if not isinstance(log_level_str, str):
        raise InvalidArgumentError(f"log level must be a string, one of {sorted(log_levels)}; "
                                   f"got {log_level_str!r}")
    level = log_levels.get(log_level_str.lower())
    if level is None:
        raise ValueError(f"{log_level_str} is not one of the valid logging levels. "
                         f"Valid log levels are {sorted(log_levels)}.")
    return level


def set_log_level_from_string(log_level_str: str, custom_logger: Optional[logging.Logger] = None) -> None:
    """Set ``custom_logger`` (default: DeepSpeed's logger) and its handlers to the named level."""
    level = get_log_level_from_string(log_level_str)
    target = logger if custom_logger is None else custom_logger
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def get_current_level() -> int:
    """The DeepSpeed logger's effective level."""
    return logger.getEffectiveLevel()


def should_log_le(max_log_level_str: str) -> bool:
    """True when the current level is at or below the named level (``"info"`` is true at INFO or DEBUG)."""
    if not isinstance(max_log_level_str, str):
        raise ValueError(f"{max_log_level_str} is not a string")
    return get_current_level() <= get_log_level_from_string(max_log_level_str)


@functools.lru_cache(None)
def warning_once(*args: Any, **kwargs: Any) -> None:
    """``logger.warning`` that emits each distinct argument tuple once per process."""
    kwargs.setdefault("stacklevel", 2)  # the caller of warning_once, unless the caller says otherwise
    logger.warning(*args, **kwargs)


def print_configuration(args: Any, name: str) -> None:
    """Log every attribute of ``args`` at INFO, dotted to a column, as DeepSpeed does: each line formatted into the
    record's message (a filter reading ``record.msg`` sees the line, as with DeepSpeed's)."""
    logger.info(f"{name}:")
    for arg in sorted(vars(args)):
        logger.info(f"  {arg} {'.' * (29 - len(arg))} {getattr(args, arg)}")
