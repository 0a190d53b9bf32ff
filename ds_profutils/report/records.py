"""Reading one engine's per-rank fetch records: one pass per file, running totals, nothing raised.

A 1024-rank job writes gigabytes of records, so each file is read once, line by line, with orjson,
keeping running totals per event and collective and seven numbers per global step: memory grows with
ranks x steps, never with the size of a record.  Records of one global step (one per micro step
with gradient accumulation) are added up (their memory peaks: the largest).  A torn last line (a killed job) marks the file
incomplete; a bad line is a problem of that file; both are skipped.  Large runs are read in parallel
processes: parsing is the bottleneck.

A resumed run (restarted from a checkpoint earlier than its last recorded step) writes global steps
again: a train record whose ``global_step`` is lower than the one before it, or whose ``"segment"``
differs from the one before it, starts a new *segment*.  Each global step is then taken from the latest
segment that has it (all its micro steps there); the file is read a second time, skipping the records
of earlier segments (``superseded``), so no two runs' figures are ever added.  Only files with a
restart pay the second pass; to decide it, the first keeps each segment's first and last step.

Optional fields of later writers, read where present (null or absent: NaN here): ``iteration_ms`` and
``gap_ms`` (on the record whose micro step ended with ``engine.step()``, with ``gap_collective_ms``, the part
of the gap inside the frameworks' own ``torch.distributed`` collectives, and ``eval_ms`` and ``save_ms``, its parts
inside eval forwards and checkpoint saves), ``flops``, ``tokens`` and
``samples`` (of the micro step, summed over the step), ``ds_config`` (the engine's effective values, on a
file's first record), ``prefetch.in_flight_waited``, ``model_numel`` and ``peak_tflops`` (the latest given),
``profiler_active`` (the step ran in the torch profiler's active window), ``memory.disturbed`` (the
step's peaks were reset between our boundaries: kept apart from the peaks that are trusted).

Schema 3 adds the time inside collectives (``collective_ms``), memory peaks and ZeRO-3's live
parameters, trace-cache invalidations and prefetch hits; schema 2 records lack them (NaN or None
here).  Records without ``"schema"`` come from an older ds_profutils: read best effort (the fetch
wait from their events, no collective wait) and counted as such.
"""
from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import orjson

__all__ = ["BYTES", "COUNT", "FETCH_WAIT_EVENTS", "MAX", "MIN", "NUMEL", "TIME", "FileRecords", "read_records"]

FETCH_WAIT_EVENTS = ("forward_fetch_wait", "backward_fetch_wait")
_PROBLEMS_SHOWN = 5  # per file; the rest are counted

# Event totals, one list per mode and event: count, numel, bytes (None once a record lacks them),
# time_ms, min_ms, max_ms (inf and -inf until an event is timed).
COUNT, NUMEL, BYTES, TIME, MIN, MAX = range(6)
_INF, _NAN = math.inf, math.nan
_NO_INSIDE = (_NAN, )  # a step's time inside collectives where the record lacks it (schema 2 or older)
_NO_PEAKS = (_NAN, _NAN)  # a step's peak allocated and reserved bytes where the record has no memory figures
# optional per-record figures, added up per step where present (compute_ms, p2p_ms, bubble_ms: a pipeline stage's,
# docs/pipeline.md)
_STEP_EXTRAS = ("iteration_ms", "gap_ms", "flops", "tokens", "samples", "compute_ms", "p2p_ms", "bubble_ms",
                "gap_collective_ms", "eval_ms", "save_ms", "load_ms")

# What is counted per record, as one key: mode, host, clock, old format, comms logger on, memory source
# (None: no memory figures), time inside collectives recorded.
Kind = Tuple[str, str, str, bool, bool, Optional[str], bool]


@dataclass
class FileRecords:
    """What one ``zero_fetch_*rank_{r}.jsonl`` says.

    Per train global step (in file order): step time, fetch wait, blocking-collective wait and time inside
    collectives, each the sum over the step's records; peak allocated and reserved bytes, the largest of
    them.  Totals per mode and event, and per collective over train records.  Over every record: the most
    live parameters, the trace-cache invalidations and the prefetch hits and waits (None until a record
    has them).
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
    collectives: Dict[str, List[float]] = field(default_factory=dict)  # op -> [count, time_ms, exposed_ms]
    global_steps: array = field(default_factory=lambda: array("q"))
    step_ms: array = field(default_factory=lambda: array("d"))
    fetch_wait_ms: array = field(default_factory=lambda: array("d"))
    collective_wait_ms: array = field(default_factory=lambda: array("d"))
    collective_ms: array = field(default_factory=lambda: array("d"))  # NaN: not recorded (schema 2)
    peak_allocated_bytes: array = field(default_factory=lambda: array("d"))  # NaN: no memory figures
    peak_reserved_bytes: array = field(default_factory=lambda: array("d"))
    iteration_ms: array = field(default_factory=lambda: array("d"))  # NaN: not recorded (earlier writers)
    gap_ms: array = field(default_factory=lambda: array("d"))
    flops: array = field(default_factory=lambda: array("d"))  # model FLOPs of the step's train micro steps
    tokens: array = field(default_factory=lambda: array("d"))  # tokens of the step's train micro steps
    samples: array = field(default_factory=lambda: array("d"))
    compute_ms: array = field(default_factory=lambda: array("d"))  # a pipeline stage's forward and backward
    p2p_ms: array = field(default_factory=lambda: array("d"))  # its send and receive instructions
    bubble_ms: array = field(default_factory=lambda: array("d"))  # p2p_ms and the time outside instructions
    load_ms: array = field(default_factory=lambda: array("d"))  # its LoadMicroBatch instructions (its data iterator)
    gap_collective_ms: array = field(default_factory=lambda: array("d"))  # of gap_ms: inside torch.distributed calls
    eval_ms: array = field(default_factory=lambda: array("d"))  # of gap_ms: inside eval and no-grad forwards
    save_ms: array = field(default_factory=lambda: array("d"))  # of gap_ms: inside engine.save_checkpoint()
    pipe_stage: Optional[int] = None  # a PipelineEngine's stage of this rank (None: no pipeline)
    pipe_stages: Optional[int] = None
    micro_batches: Optional[int] = None  # of the latest pipeline train record
    disturbed: array = field(default_factory=lambda: array("b"))  # 1: a peak reset between our boundaries
    profiler_steps: set = field(default_factory=set)  # global steps recorded as in the profiler's active window
    model_numel: Optional[int] = None
    peak_tflops: Optional[float] = None
    segment: int = 0  # segments begun so far (0: the run never went back to an earlier step)
    superseded: int = 0  # train records of a step that a later segment recorded again (skipped)
    spans: List[List[int]] = field(default_factory=list)  # per segment, its first and last global step
    known_spans: Optional[List[List[int]]] = None  # the first pass's spans, given for the second
    peak_phase: Optional[str] = None  # the phase of the highest train peak (forward, backward, step)
    live_params_max: Optional[int] = None
    max_live_parameters: Optional[int] = None  # the engine's stage3_max_live_parameters, as last recorded
    trace_cache_invalidations: Optional[int] = None
    prefetch_hits: Optional[int] = None
    prefetch_waited: Optional[int] = None
    prefetch_in_flight_waited: Optional[int] = None  # prefetched elements not complete when needed
    ds_config: Dict[str, Any] = field(default_factory=dict)  # the engine's effective values, as last recorded
    problems: List[str] = field(default_factory=list)
    problem_count: int = 0
    torn: bool = False
    _recording_seen: Any = field(default=None, repr=False)  # the last recording_ranks list, as read
    _peak_seen: float = field(default=-_INF, repr=False)  # the highest train record's peak allocated bytes
    _last_step: Optional[int] = field(default=None, repr=False)  # the previous train record's global step
    _segment_mark: Any = field(default=None, repr=False)  # the previous train record's "segment" field

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
    def memory_sources(self) -> Dict[Optional[str], int]:
        """Records per source of their memory figures ("allocator", "rss"; None: none recorded)."""
        return self._count(5)

    @property
    def without_collective_ms(self) -> int:
        """Train records without the time inside collectives (schema 2 or older)."""
        return sum(records for kind, records in self.kinds.items() if kind[0] == "train" and not kind[6])

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
        memory = record.get("memory")
        inside = record.get("collective_ms")
        phase = None
        if mode == "train":
            step = record["global_step"]
            if type(step) is not int:
                raise TypeError(f"global_step {step!r}")
            if old:
                times = (record["step_time_ms"] + 0.0, _fetch_wait(events), 0.0)
                collectives: List[Tuple[str, int, float, float]] = []
            else:
                times = (record["step_time_ms"] + 0.0, record["fetch_wait_ms"] + 0.0,
                         record["collective_wait_ms"] + 0.0)
                collectives = [(op, entry["count"] + 0, entry["time_ms"] + 0.0, entry.get("exposed_ms", _NAN) + 0.0)
                               for op, entry in record["collectives"].items()]
            times += _NO_INSIDE if inside is None else (inside + 0.0, )
            peaks = _NO_PEAKS if memory is None else (memory["peak_allocated_bytes"] + 0.0,
                                                      memory["peak_reserved_bytes"] + 0.0)
            disturbed = memory is not None and memory.get("disturbed") is True
            if peaks[0] > self._peak_seen and not disturbed:
                phase = _peak_phase(memory)
            extras = tuple(_NAN if record.get(key) is None else record[key] + 0.0 for key in _STEP_EXTRAS)
            mark = record.get("segment")
            restart = self._last_step is not None and (step < self._last_step or mark != self._segment_mark)
            segment = self.segment + restart
        live, limit = record.get("live_params_max"), record.get("max_live_parameters")
        invalidations = record.get("trace_cache_invalidations")
        if live is not None or limit is not None or invalidations is not None:  # schema 3
            live, limit, invalidations = (None if value is None else value + 0 for value in (live, limit, invalidations))
        prefetch = record.get("prefetch")
        if prefetch is not None:
            in_flight = prefetch.get("in_flight_waited")
            prefetch = (prefetch["hits"] + 0, prefetch["waited"] + 0, None if in_flight is None else in_flight + 0)
        world_size = record.get("world_size", 0) + 0
        recording = record.get("recording_ranks")
        changed = recording is not None and recording != self._recording_seen
        recording_ranks = tuple(int(rank) for rank in recording) if changed else None
        kind = (str(mode), str(record.get("host", "?")), "host (old format)" if old else str(record.get("clock", "host")),
                old, record.get("comms_logger") is True, None if memory is None else str(memory["source"]),
                inside is not None)
        model_numel, peak = record.get("model_numel"), record.get("peak_tflops")
        model_numel, peak = (None if model_numel is None else int(model_numel)), (None if peak is None else float(peak))
        stage = record.get("pipe_stage")
        if stage is not None:
            stage = (int(stage), int(record["pipe_stages"]), int(record.get("micro_batches") or 0))
        # Nothing below raises for a record that got this far.
        if mode == "train":
            self.segment, self._last_step, self._segment_mark = segment, step, mark
            if restart or not self.spans:
                self.spans.append([step, step])
            elif step > self.spans[-1][1]:
                self.spans[-1][1] = step
            if self.known_spans is not None and any(first <= step <= last
                                                    for first, last in self.known_spans[segment + 1:]):
                self.superseded += 1  # a later segment recorded this step again: its records are the step's
                return
            self._add_step(step, times + extras, peaks, disturbed)
            if stage is not None:
                self.pipe_stage, self.pipe_stages, self.micro_batches = stage
            if record.get("profiler_active") is True:
                self.profiler_steps.add(step)
            if peaks[0] > self._peak_seen and not disturbed:
                self._peak_seen, self.peak_phase = peaks[0], phase
            for op, count, time_ms, exposed_ms in collectives:
                found = self.collectives.get(op)
                if found is None:
                    self.collectives[op] = [count, time_ms, exposed_ms]
                else:
                    found[0] += count
                    found[1] += time_ms
                    found[2] += exposed_ms
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
        if live is not None and (self.live_params_max is None or live > self.live_params_max):
            self.live_params_max = live
        if limit is not None:
            self.max_live_parameters = limit
        if invalidations is not None:
            self.trace_cache_invalidations = (self.trace_cache_invalidations or 0) + invalidations
        if prefetch is not None:
            self.prefetch_hits = (self.prefetch_hits or 0) + prefetch[0]
            self.prefetch_waited = (self.prefetch_waited or 0) + prefetch[1]
            if prefetch[2] is not None:
                self.prefetch_in_flight_waited = (self.prefetch_in_flight_waited or 0) + prefetch[2]
        if type(record.get("ds_config")) is dict:
            self.ds_config = record["ds_config"]
        if model_numel is not None:
            self.model_numel = model_numel
        if peak is not None:
            self.peak_tflops = peak
        if world_size > self.world_size:
            self.world_size = world_size
        written = record.get("time")
        if type(written) is float and written > self.last_time:
            self.last_time = written
        if changed:
            self.recording_ranks, self._recording_seen = recording_ranks, recording
        self.kinds[kind] = self.kinds.get(kind, 0) + 1

    def _add_step(self, step: int, times: Tuple[float, ...], peaks: Tuple[float, float], disturbed: bool) -> None:
        """Fold one train record into its global step: the times added up (the optional figures, NaN where a
        record lacks them, added where present), the peaks the larger, disturbed if any record was."""
        steps = self.global_steps
        summed = (self.step_ms, self.fetch_wait_ms, self.collective_wait_ms, self.collective_ms)
        present = (self.iteration_ms, self.gap_ms, self.flops, self.tokens, self.samples, self.compute_ms, self.p2p_ms,
                   self.bubble_ms, self.gap_collective_ms, self.eval_ms, self.save_ms, self.load_ms)
        largest = (self.peak_allocated_bytes, self.peak_reserved_bytes)
        if steps and steps[-1] == step:  # another micro step of the same optimizer step
            index = len(steps) - 1
        elif steps and steps[-1] > step and step in steps:  # out of order: rare, so a scan is fine
            index = steps.index(step)
        else:
            steps.append(step)
            for column, value in zip(summed + present + largest, times + peaks):
                column.append(value)
            self.disturbed.append(disturbed)
            return
        for column, value in zip(summed, times):
            column[index] += value
        for column, value in zip(present, times[len(summed):]):
            if value == value:
                column[index] = value if column[index] != column[index] else column[index] + value
        for column, value in zip(largest, peaks):
            if value > column[index] or column[index] != column[index]:  # NaN: none before
                column[index] = value
        if disturbed:
            self.disturbed[index] = True

    def restarted(self) -> bool:
        """Whether the file went back to an earlier step (a resumed run): it needs a second pass."""
        return self.segment > 0 and self.known_spans is None


def _peak_phase(memory: Mapping[str, Any]) -> Optional[str]:
    """The phase (forward, backward, step) whose peak is the record's: where the memory went."""
    phases = memory.get("phases") or {}
    return max(phases, key=lambda name: phases[name] + 0) if phases else None


def _fetch_wait(events: Mapping[str, Any]) -> float:
    """An old-format record's fetch wait: the summed time of its fetch-wait events."""
    return sum(float(events[name]["time_ms"]) for name in FETCH_WAIT_EVENTS if name in events)


def read_records(path: Path, engine: str, rank: int, known_spans: Optional[List[List[int]]] = None) -> FileRecords:
    """One file, line by line; bad lines are counted as problems, a torn last line marks it ``torn``.  A file
    that went back to an earlier step is read again, each step from its latest segment."""
    records = FileRecords(engine, rank, str(path), known_spans=known_spans)
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
    if records.restarted():
        return read_records(path, engine, rank, records.spans)
    return records


