"""Reading one engine's per-rank fetch records: one pass per file, running totals, nothing raised.

A 1024-rank job writes gigabytes of records, so each file is read once, line by line, with orjson,
keeping running totals per event and collective and five numbers per global step: memory grows with
ranks x steps, never with the size of a record.  Records of one global step (one per micro step
with gradient accumulation) are added up.  A torn last line (a killed job) marks the file
incomplete; a bad line is a problem of that file; both are skipped.  Large runs are read in parallel
processes: parsing is the bottleneck.

Records without ``"schema"`` come from an older ds_profutils: read best effort (the fetch wait from
their events, no collective wait) and counted as such.
"""
from __future__ import annotations

import math
import multiprocessing
import os
from array import array
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import orjson

__all__ = ["BYTES", "COUNT", "FETCH_WAIT_EVENTS", "MAX", "MIN", "NUMEL", "TIME", "FileRecords", "read_all", "read_records"]

FETCH_WAIT_EVENTS = ("forward_fetch_wait", "backward_fetch_wait")
_PROBLEMS_SHOWN = 5  # per file; the rest are counted
_PARALLEL_BYTES = 64 * 2**20  # below this, starting processes costs more than it saves

# Event totals, one list per (mode, event) for speed: count, numel, bytes (None once a record lacks
# them), time_ms, min_ms, max_ms.
COUNT, NUMEL, BYTES, TIME, MIN, MAX = range(6)


@dataclass
class FileRecords:
    """What one ``zero_fetch_*rank_{r}.jsonl`` says.

    Per train global step (in file order): step time, fetch wait and blocking-collective wait, each
    the sum over the step's records.  Totals per (mode, event) and per collective over train records.
    """

    engine: str
    rank: int
    path: str
    hosts: Dict[str, int] = field(default_factory=dict)
    world_size: int = 0
    recording_ranks: Optional[Tuple[int, ...]] = None  # the run's "ranks" setting; None: every rank
    modes: Dict[str, int] = field(default_factory=dict)
    clocks: Dict[str, int] = field(default_factory=dict)  # clock of step_time_ms and the waits: records
    old_format: int = 0  # records without "schema"
    comms_logger: int = 0  # records written while DeepSpeed's comms logger was on
    events: Dict[Tuple[str, str], List[Any]] = field(default_factory=dict)
    units: Dict[str, Optional[str]] = field(default_factory=dict)
    collectives: Dict[str, List[float]] = field(default_factory=dict)  # op -> [count, time_ms]
    global_steps: array = field(default_factory=lambda: array("q"))
    step_ms: array = field(default_factory=lambda: array("d"))
    fetch_wait_ms: array = field(default_factory=lambda: array("d"))
    collective_wait_ms: array = field(default_factory=lambda: array("d"))
    problems: List[str] = field(default_factory=list)
    problem_count: int = 0
    torn: bool = False

    @property
    def complete_records(self) -> int:
        return sum(self.modes.values())

    def problem(self, message: str) -> None:
        self.problem_count += 1
        if len(self.problems) < _PROBLEMS_SHOWN:
            self.problems.append(message)

    def add(self, record: Mapping[str, Any]) -> None:
        """Fold one record in.  One that is not a fetch record raises (KeyError, TypeError, ValueError,
        AttributeError) before anything changes."""
        mode = str(record["mode"]) if "mode" in record else "train"
        events = record["events"]
        staged = [(name, int(entry["count"]), int(entry["numel"]), entry.get("bytes"), float(entry["time_ms"]),
                   entry.get("min_ms"), entry.get("max_ms"), entry.get("numel_unit")) for name, entry in events.items()]
        old = "schema" not in record
        if mode == "train":
            step = int(record["global_step"])
            times = (float(record["step_time_ms"]),
                     _fetch_wait(events) if old else float(record["fetch_wait_ms"]),
                     0.0 if old else float(record["collective_wait_ms"]))
            collectives = [] if old else [(op, int(entry["count"]), float(entry["time_ms"]))
                                          for op, entry in record["collectives"].items()]
        recording = record.get("recording_ranks")
        recording = None if recording is None else tuple(int(rank) for rank in recording)
        world_size = int(record.get("world_size", 0))
        # Nothing below raises for a record that got this far.
        if mode == "train":
            self._add_step(step, times)
            for op, count, time_ms in collectives:
                totals = self.collectives.get(op)
                if totals is None:
                    self.collectives[op] = [count, time_ms]
                else:
                    totals[0] += count
                    totals[1] += time_ms
        for name, count, numel, nbytes, time_ms, min_ms, max_ms, unit in staged:
            totals = self.events.get((mode, name))
            if totals is None:
                totals = self.events[(mode, name)] = [0, 0, 0, 0.0, math.inf, -math.inf]
                self.units[name] = unit
            totals[COUNT] += count
            totals[NUMEL] += numel
            totals[BYTES] = None if nbytes is None or totals[BYTES] is None else totals[BYTES] + nbytes
            totals[TIME] += time_ms
            if min_ms is not None and min_ms < totals[MIN]:
                totals[MIN] = min_ms
            if max_ms is not None and max_ms > totals[MAX]:
                totals[MAX] = max_ms
        self.recording_ranks = recording
        self.world_size = max(self.world_size, world_size)
        self.modes[mode] = self.modes.get(mode, 0) + 1
        host = str(record.get("host", "?"))
        self.hosts[host] = self.hosts.get(host, 0) + 1
        clock = "host (old format)" if old else str(record.get("clock", "host"))
        self.clocks[clock] = self.clocks.get(clock, 0) + 1
        self.old_format += old
        self.comms_logger += record.get("comms_logger") is True

    def _add_step(self, step: int, times: Tuple[float, float, float]) -> None:
        steps = self.global_steps
        columns = (self.step_ms, self.fetch_wait_ms, self.collective_wait_ms)
        if steps and steps[-1] == step:  # another micro step of the same optimizer step
            index = len(steps) - 1
        elif steps and steps[-1] > step and step in steps:  # out of order: rare, so a scan is fine
            index = steps.index(step)
        else:
            steps.append(step)
            for column, value in zip(columns, times):
                column.append(value)
            return
        for column, value in zip(columns, times):
            column[index] += value


def _fetch_wait(events: Mapping[str, Any]) -> float:
    """An old-format record's fetch wait: the summed time of its fetch-wait events."""
    return sum(float(events[name]["time_ms"]) for name in FETCH_WAIT_EVENTS if name in events)


def read_records(path: Path, engine: str, rank: int) -> FileRecords:
    """One file, line by line; bad lines are counted as problems, a torn last line marks it ``torn``."""
    records = FileRecords(engine, rank, str(path))
    loads = orjson.loads
    with open(path, "rb") as source:
        for number, line in enumerate(source, 1):
            try:
                record = loads(line)
            except orjson.JSONDecodeError:
                if not line.strip():
                    continue
                if not line.endswith(b"\n"):
                    records.torn = True
                else:
                    records.problem(f"line {number}: not JSON, skipped")
                continue
            try:
                records.add(record)
            except (KeyError, TypeError, ValueError, AttributeError):
                records.problem(f"line {number}: not a fetch record, skipped")
    return records


def _read_one(job: Tuple[Path, str, int]) -> FileRecords:
    return read_records(*job)


def read_all(files: Mapping[str, Mapping[int, Path]]) -> List[FileRecords]:
    """Every file of ``{engine: {rank: path}}``, in parallel processes when there is enough to read."""
    jobs = [(path, engine, rank) for engine, ranks in files.items() for rank, path in ranks.items()]
    workers = min(len(jobs), os.cpu_count() or 1)
    if (workers < 2 or "fork" not in multiprocessing.get_all_start_methods()
            or sum(path.stat().st_size for path, _, _ in jobs) < _PARALLEL_BYTES):
        return [_read_one(job) for job in jobs]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_read_one, jobs, chunksize=max(1, len(jobs) // (4 * workers))))

