"""Reading a run's per-rank fetch records: one pass per file, running totals, nothing raised.

Files are read once, line by line, keeping running totals per event and four numbers per step, so a
gigabyte of records takes seconds.  A truncated last line (a killed job) or a bad line is noted as
a problem of that rank and skipped.  Large runs are read in parallel processes: JSON parsing is the
bottleneck.
"""
from __future__ import annotations

import json
import math
import multiprocessing
import os
from array import array
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

__all__ = ["ALL_GATHER_EVENTS", "FETCH_WAIT_EVENTS", "EventTotals", "RankRecords", "read_all"]

FETCH_WAIT_EVENTS = ("forward_fetch_wait", "backward_fetch_wait")
ALL_GATHER_EVENTS = ("forward_all_gather", "backward_all_gather")
_PROBLEMS_SHOWN = 5  # per file; the rest are counted
_PARALLEL_BYTES = 64 * 2**20  # below this, starting processes costs more than it saves


@dataclass
class EventTotals:
    """One event's totals on one rank, over every record of one mode."""

    unit: Optional[str]
    count: int = 0
    numel: int = 0
    bytes: Optional[int] = 0
    time_ms: float = 0.0
    min_ms: float = math.inf
    max_ms: float = 0.0


@dataclass
class RankRecords:
    """What one rank's file says: event totals per (mode, event) and, per train step, four numbers."""

    rank: int
    hosts: Set[str] = field(default_factory=set)
    world_size: int = 0
    recording_ranks: Optional[Tuple[int, ...]] = None  # the run's "ranks" setting; None: every rank
    modes: Dict[str, int] = field(default_factory=dict)
    events: Dict[Tuple[str, str], EventTotals] = field(default_factory=dict)
    steps: array = field(default_factory=lambda: array("q"))
    global_steps: array = field(default_factory=lambda: array("q"))
    fetch_wait_ms: array = field(default_factory=lambda: array("d"))
    all_gather_ms: array = field(default_factory=lambda: array("d"))
    step_ms: array = field(default_factory=lambda: array("d"))
    problems: List[str] = field(default_factory=list)
    problem_count: int = 0

    def _time_columns(self) -> Tuple[array, ...]:
        return self.step_ms, self.fetch_wait_ms, self.all_gather_ms

    def problem(self, message: str) -> None:
        self.problem_count += 1
        if len(self.problems) < _PROBLEMS_SHOWN:
            self.problems.append(message)

    def add(self, record: Mapping[str, Any]) -> None:
        """Fold one record in; one that is not a fetch record raises (KeyError, TypeError, ValueError,
        AttributeError) before anything changes."""
        mode = str(record.get("mode", "train"))
        events = record["events"]
        staged = [(name, int(entry["count"]), int(entry["numel"]), _optional_int(entry.get("bytes")),
                   float(entry["time_ms"]), float(entry["min_ms"]), float(entry["max_ms"]), entry.get("numel_unit"))
                  for name, entry in events.items()]
        world_size = int(record.get("world_size", 0))
        recording_ranks = record.get("recording_ranks")
        recording_ranks = None if recording_ranks is None else tuple(int(rank) for rank in recording_ranks)
        if mode == "train":
            step, global_step = int(record.get("micro_step", record.get("step"))), int(record["global_step"])
            times = (float(record["step_time_ms"]), _time_of(events, FETCH_WAIT_EVENTS),
                     _time_of(events, ALL_GATHER_EVENTS))
            if self.steps and self.steps[-1] == step:  # another forward before step(): the same step
                for column, value in zip(self._time_columns(), times):
                    column[-1] += value
            else:
                self.steps.append(step)
                self.global_steps.append(global_step)
                for column, value in zip(self._time_columns(), times):
                    column.append(value)
        self.recording_ranks = recording_ranks
        self.modes[mode] = self.modes.get(mode, 0) + 1
        self.hosts.add(str(record.get("host", "?")))
        self.world_size = max(self.world_size, world_size)
        for name, count, numel, nbytes, time_ms, min_ms, max_ms, unit in staged:
            totals = self.events.get((mode, name))
            if totals is None:
                totals = self.events[(mode, name)] = EventTotals(unit)
            totals.count += count
            totals.numel += numel
            totals.bytes = None if nbytes is None or totals.bytes is None else totals.bytes + nbytes
            totals.time_ms += time_ms
            if min_ms < totals.min_ms:
                totals.min_ms = min_ms
            if max_ms > totals.max_ms:
                totals.max_ms = max_ms


def _optional_int(value: Any) -> Optional[int]:
    return None if value is None else int(value)


def _time_of(events: Mapping[str, Any], names: Sequence[str]) -> float:
    """Summed time_ms of those of ``names`` that occurred in a record."""
    total = 0.0
    for name in names:
        entry = events.get(name)
        if entry is not None:
            total += float(entry["time_ms"])
    return total


def _read_records(path: Path, rank: int) -> RankRecords:
    records = RankRecords(rank)
    with open(path, "rb") as source:
        for number, line in enumerate(source, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                what = "not JSON" if line.endswith(b"\n") else "incomplete last line (job stopped mid-write?)"
                records.problem(f"line {number}: {what}, skipped")
                continue
            try:
                records.add(record)
            except (KeyError, TypeError, ValueError, AttributeError):
                records.problem(f"line {number}: not a fetch record, skipped")
    return records


def read_all(files: Mapping[int, Path]) -> List[RankRecords]:
    """Every rank's file, in parallel processes when there is enough to read: JSON parsing is the bottleneck."""
    workers = min(len(files), os.cpu_count() or 1)
    if (workers < 2 or "fork" not in multiprocessing.get_all_start_methods()
            or sum(path.stat().st_size for path in files.values()) < _PARALLEL_BYTES):
        return [_read_records(path, rank) for rank, path in files.items()]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_read_records, files.values(), files.keys()))


