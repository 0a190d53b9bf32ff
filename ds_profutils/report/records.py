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

# Event totals, one list per mode and event: count, numel, bytes (None once a record lacks them),
# time_ms, min_ms, max_ms (inf and -inf until an event is timed).
COUNT, NUMEL, BYTES, TIME, MIN, MAX = range(6)
_INF = math.inf

# What is counted per record, as one key: mode, host, clock, old format, comms logger on.
Kind = Tuple[str, str, str, bool, bool]


@dataclass
class FileRecords:
    """What one ``zero_fetch_*rank_{r}.jsonl`` says.

    Per train global step (in file order): step time, fetch wait and blocking-collective wait, each
    the sum over the step's records.  Totals per mode and event, and per collective over train records.
    """

    engine: str
    rank: int
    path: str
    world_size: int = 0
    last_time: float = 0.0  # wall-clock seconds of the latest record (its forward's start)
    recording_ranks: Optional[Tuple[int, ...]] = None  # the run's "ranks" setting; None: every rank
    kinds: Dict[Kind, int] = field(default_factory=dict)  # records of each kind
    events: Dict[str, Dict[str, List[Any]]] = field(default_factory=dict)  # mode -> event -> totals
    units: Dict[str, Optional[str]] = field(default_factory=dict)
    collectives: Dict[str, List[float]] = field(default_factory=dict)  # op -> [count, time_ms]
    global_steps: array = field(default_factory=lambda: array("q"))
    step_ms: array = field(default_factory=lambda: array("d"))
    fetch_wait_ms: array = field(default_factory=lambda: array("d"))
    collective_wait_ms: array = field(default_factory=lambda: array("d"))
    peak_allocated_bytes: array = field(default_factory=lambda: array("d"))  # NaN: no "memory" in the records
    problems: List[str] = field(default_factory=list)
    problem_count: int = 0
    torn: bool = False
    _recording_seen: Any = field(default=None, repr=False)  # the last recording_ranks list, as read

    def _count(self, index: int) -> Dict[Any, int]:
        counts: Dict[Any, int] = {}
        for kind, records in self.kinds.items():
            counts[kind[index]] = counts.get(kind[index], 0) + records
        return counts

    @property
    def modes(self) -> Dict[str, int]:
        return self._count(0)

    @property
    def hosts(self) -> Dict[str, int]:
        return self._count(1)

    @property
    def clocks(self) -> Dict[str, int]:
        """Records per clock of their step time and waits."""
        return self._count(2)

    @property
    def old_format(self) -> int:
        """Records without ``"schema"``."""
        return self._count(3).get(True, 0)

    @property
    def comms_logger(self) -> int:
        """Records written while DeepSpeed's comms logger was on."""
        return self._count(4).get(True, 0)

    @property
    def complete_records(self) -> int:
        return sum(self.kinds.values())

    def problem(self, message: str) -> None:
        self.problem_count += 1
        if len(self.problems) < _PROBLEMS_SHOWN:
            self.problems.append(message)

    def add(self, record: Mapping[str, Any]) -> None:
        """Fold one record in.  One that is not a fetch record raises (KeyError, TypeError, ValueError,
        AttributeError) before anything changes: every value is read and checked first, then stored.

        This is the report's hot loop (a gigabyte is ~400k records of 8 events): arithmetic with 0
        checks a number where a conversion would cost a call, and one dict counts each kind of record.
        """
        mode = record.get("mode", "train")
        events = record["events"]
        staged = []
        for name, entry in events.items():
            nbytes, low, high = entry.get("bytes"), entry.get("min_ms"), entry.get("max_ms")
            staged.append((name, entry["count"] + 0, entry["numel"] + 0, None if nbytes is None else nbytes + 0,
                           entry["time_ms"] + 0.0, _INF if low is None else low + 0.0,
                           -_INF if high is None else high + 0.0, entry.get("numel_unit")))
        old = "schema" not in record
        if mode == "train":
            step = record["global_step"]
            if type(step) is not int:
                raise TypeError(f"global_step {step!r}")
            memory = record.get("memory")
            peak = math.nan if memory is None else memory["peak_allocated_bytes"] + 0.0
            if old:
                times = (record["step_time_ms"] + 0.0, _fetch_wait(events), 0.0)
                collectives: List[Tuple[str, int, float]] = []
            else:
                times = (record["step_time_ms"] + 0.0, record["fetch_wait_ms"] + 0.0,
                         record["collective_wait_ms"] + 0.0)
                collectives = [(op, entry["count"] + 0, entry["time_ms"] + 0.0)
                               for op, entry in record["collectives"].items()]
        world_size = record.get("world_size", 0) + 0
        recording = record.get("recording_ranks")
        changed = recording is not None and recording != self._recording_seen
        recording_ranks = tuple(int(rank) for rank in recording) if changed else None
        kind = (str(mode), str(record.get("host", "?")), "host (old format)" if old else str(record.get("clock", "host")),
                old, record.get("comms_logger") is True)
        # Nothing below raises for a record that got this far.
        if mode == "train":
            self._add_step(step, times, peak)
            for op, count, time_ms in collectives:
                found = self.collectives.get(op)
                if found is None:
                    self.collectives[op] = [count, time_ms]
                else:
                    found[0] += count
                    found[1] += time_ms
        by_name = self.events.get(mode)
        if by_name is None:
            by_name = self.events[mode] = {}
        for name, count, numel, nbytes, time_ms, low, high, unit in staged:
            totals = by_name.get(name)
            if totals is None:
                totals = by_name[name] = [0, 0, 0, 0.0, _INF, -_INF]
                self.units[name] = unit
            totals[COUNT] += count
            totals[NUMEL] += numel
            totals[BYTES] = None if nbytes is None or totals[BYTES] is None else totals[BYTES] + nbytes
            totals[TIME] += time_ms
            if low < totals[MIN]:
                totals[MIN] = low
            if high > totals[MAX]:
                totals[MAX] = high
        if world_size > self.world_size:
            self.world_size = world_size
        written = record.get("time")
        if type(written) is float and written > self.last_time:
            self.last_time = written
        if changed:
            self.recording_ranks, self._recording_seen = recording_ranks, recording
        self.kinds[kind] = self.kinds.get(kind, 0) + 1

    def _add_step(self, step: int, times: Tuple[float, float, float], peak: float) -> None:
        """Times of a step's records add up; its memory peak is the highest of them."""
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
            self.peak_allocated_bytes.append(peak)
            return
        for column, value in zip(columns, times):
            column[index] += value
        if peak == peak and not self.peak_allocated_bytes[index] >= peak:  # NaN (no memory) never wins
            self.peak_allocated_bytes[index] = peak


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

