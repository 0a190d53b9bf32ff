"""What a rank writes when no optimizer step has ended for ``hang_timeout_s``: ``hang_rank_{r}.json``.

Everything is read from what the process keeps anyway, from the watchdog's thread: the engines' last
global step and phase (:class:`.watchdog.EngineWatch`), the collective this rank is inside and the last it
finished (:mod:`.sequence`), every thread's Python stack (``sys._current_frames()``: file, line and
function, no source read), and memory as RSS and the allocator's counters (no device call, no
synchronize).  The file is written to a temporary name carrying host, rank and pid, then renamed, so a
reader (or a kill) never meets half a file.  The format is :data:`ds_profutils.outputs.HANG_SCHEMA`'s.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from time import perf_counter_ns
from typing import Any, Dict, Iterable, List, Optional

from ...outputs import HANG_SCHEMA, ProcessIdentity, atomic_path, hang_file
from ..memory import rss_reader
from . import sequence

__all__ = ["hang_content", "write_hang_file"]

_MAX_FRAMES = 64  # per thread: deep recursion is cut to its innermost frames


def _stack(frame: Any) -> List[Dict[str, Any]]:
    """A thread's frames, innermost first (the top of its stack)."""
    frames = []
    while frame is not None and len(frames) < _MAX_FRAMES:
        code = frame.f_code
        frames.append({"file": code.co_filename, "line": frame.f_lineno, "function": code.co_name})
        frame = frame.f_back
    return frames


def _threads(training_thread: Optional[int]) -> List[Dict[str, Any]]:
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    me = threading.get_ident()
    return [{"name": names.get(ident, "?"), "ident": ident, "training": ident == training_thread,
             "stack": _stack(frame)}
            for ident, frame in sys._current_frames().items() if ident != me]


def _rss_bytes() -> Optional[int]:
    try:
        return rss_reader()()
    except Exception:  # noqa: BLE001 - the hang file goes out without it
        return None


def _memory(cuda_device: Optional[int]) -> Dict[str, Optional[int]]:
    """RSS, and the CUDA caching allocator's counters where this rank allocates on a CUDA device (host-side
    counters: no device call)."""
    figures: Dict[str, Optional[int]] = {"rss_bytes": _rss_bytes()}
    if cuda_device is not None:
        import torch

        if torch.cuda.is_initialized():
            figures["allocated_bytes"] = torch.cuda.memory_allocated(cuda_device)
            figures["reserved_bytes"] = torch.cuda.memory_reserved(cuda_device)
    return figures


def _inside_now(groups: Iterable[sequence.GroupProgress]) -> Dict[str, Any]:
    """The collective this rank is inside now (the latest started, where several are) and the last it ended."""
    current = [group.current for group in groups if group.current is not None]
    ended = [group.last for group in groups if group.last is not None]
    inside = max(current, key=lambda collective: collective.started_ns, default=None)
    last = max(ended, key=lambda collective: collective.ended_ns or 0, default=None)
    return {"collective": None if inside is None else {**inside.as_dict(),
                                                       "waiting_s": (perf_counter_ns() - inside.started_ns) / 1e9},
            "last_collective": None if last is None else last.as_dict()}


def hang_content(identity: ProcessIdentity, engines: List[Dict[str, Any]], *, timeout_s: float, since: float,
                 training_thread: Optional[int], cuda_device: Optional[int], writes: int,
                 resolved_after_s: Optional[float] = None) -> Dict[str, Any]:
    """The hang file's content: ``since`` is the wall time of the last optimizer step's end (or the watch's
    start), ``resolved_after_s`` the time from it to the step that ended after all (None: still stuck).
    ``closed_after_s`` is None here: the watchdog sets it on the last content where the program closes its last
    engine with no step between."""
    now = time.time()
    groups = sequence.progress()
    return {
        "schema": HANG_SCHEMA, "rank": identity.rank, "world_size": identity.world_size, "host": identity.host,
        "pid": identity.pid, "time": now, "timeout_s": timeout_s, "since": since, "stuck_s": now - since,
        "writes": writes, "resolved": resolved_after_s is not None, "resolved_after_s": resolved_after_s,
        "closed_after_s": None,
        "engines": engines, **_inside_now(groups),
        "groups": [{"group": list(group.ranks), "seq": group.seq,
                    "ended_seq": group.last.seq if group.last is not None else 0} for group in groups],
        "threads": _threads(training_thread), "memory": _memory(cuda_device),
    }


def write_hang_file(output_dir: Path, identity: ProcessIdentity, content: Dict[str, Any]) -> Path:
    """Write ``content`` as ``output_dir/hang_rank_{r}.json`` atomically; return the path."""
    path = hang_file(output_dir, identity.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path, identity) as temporary:
        temporary.write_text(json.dumps(content, default=str))
    return path
