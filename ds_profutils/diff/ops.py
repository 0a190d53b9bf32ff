"""Self time per operator of one Chrome trace, read as a stream in bounded memory.

An operator's self time is its duration less that of the operators inside it (``aten::linear`` less
its ``aten::addmm``): inclusive times count a parent and its children alike, so a change deep in the
tree would show on every ancestor.  Nesting is per thread (``pid``, ``tid``).  Events of a thread
come in start order in torch's traces; each thread's events pass through a reorder window of
``REORDER_WINDOW`` events, so local disorder is put right, and then through a stack of the ranges
still open.  Memory is the window and the stack per thread and one total per operator name, never
the trace: a 100 MB trace is read in the memory of a small one.  An event that comes later than the
window can put right (``late``) is counted as a top-level range.

The events counted are the report's operator categories (:data:`ds_profutils.report.traces.OP_CATEGORIES`), less the
``ProfilerStep#N`` ranges (a step holds everything else).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Tuple

from ..outputs import STEP_RANGE_PREFIX
from ..report.traces import OP_CATEGORIES, iter_trace

__all__ = ["REORDER_WINDOW", "SelfTimes", "self_times"]

REORDER_WINDOW = 4096
"""Events held per thread so that ones written a little out of start order are still nested right."""

Key = Tuple[str, str]  # (category, name)


@dataclass
class SelfTimes:
    """Per operator (category, name): calls and self time (ms) over the whole trace."""

    ops: Dict[Key, List[float]] = field(default_factory=dict)  # key -> [count, self ms]
    late: int = 0  # events that came after the reorder window had passed their start

    def add(self, key: Key, self_us: float) -> None:
        totals = self.ops.get(key)
        if totals is None:
            self.ops[key] = [1, self_us / 1e3]
        else:
            totals[0] += 1
            totals[1] += self_us / 1e3


class _Thread:
    """One thread's reorder window and open ranges: ``[end, key, children's time, duration]`` each."""

    def __init__(self) -> None:
        self.window: List[Tuple[float, float, int, Key]] = []  # (start, -duration, arrival, key): parents first
        self.open: List[List[Any]] = []
        self.released = float("-inf")  # start of the last event taken out of the window

    def close_until(self, start: float, totals: SelfTimes) -> None:
        """Finish the open ranges that end by ``start``."""
        while self.open and self.open[-1][0] <= start:
            end, key, children, duration = self.open.pop()
            totals.add(key, duration - children)

    def place(self, start: float, duration: float, key: Key, totals: SelfTimes) -> None:
        """One event in start order: a child of the innermost range still open at its start, if any."""
        self.close_until(start, totals)
        if self.open:
            parent = self.open[-1]
            parent[2] += min(duration, parent[0] - start)  # a child that overruns its parent is clipped
        self.open.append([start + duration, key, 0.0, duration])


def self_times(path: Path) -> SelfTimes:
    """Calls and self time per operator over the trace at ``path``; raises what :func:`.traces.iter_trace`
    raises for a file that is not a whole trace."""
    totals = SelfTimes()
    threads: Dict[Tuple[Any, Any], _Thread] = {}
    arrival = 0
    for kind, event in iter_trace(path):
        if kind != "event" or event.get("ph") != "X":
            continue
        category, name = event.get("cat", ""), event.get("name", "")
        if category not in OP_CATEGORIES or name.startswith(STEP_RANGE_PREFIX):
            continue
        start, duration = float(event.get("ts", 0.0)), float(event.get("dur", 0.0))
        thread = threads.get((event.get("pid"), event.get("tid")))
        if thread is None:
            thread = threads[(event.get("pid"), event.get("tid"))] = _Thread()
        if start < thread.released:  # the window has moved past it: its parent may be finished already
            totals.late += 1
            totals.add((category, name), duration)
            continue
        arrival += 1
        heapq.heappush(thread.window, (start, -duration, arrival, (category, name)))
        if len(thread.window) > REORDER_WINDOW:
            _release(thread, totals)
    for thread in threads.values():
        while thread.window:
            _release(thread, totals)
        thread.close_until(float("inf"), totals)
    return totals


def _release(thread: _Thread, totals: SelfTimes) -> None:
    start, negative_duration, _, key = heapq.heappop(thread.window)
    thread.released = start
    thread.place(start, -negative_duration, key, totals)
