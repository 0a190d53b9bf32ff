"""One step record being filled, for an engine of any ZeRO stage, and the engine's share of collectives.

A :class:`StepRecord` is what the recorder opens at a forward start: the fields read then, the
step's clocks, every collective of the step (given by :mod:`.collectives`), and, on ZeRO-3 with the
fetch profiler, what the step learned about fetches (:class:`ds_profutils.zero3.StepFetches`).
Nothing in it depends on ZeRO-3: without fetches a record holds the step time and its collectives.

A collective belongs to the engine whose forward, backward or step is running when it is issued
(actor and critic steps interleave in RLHF loops), told by :mod:`.hooks`; one issued outside every
engine's calls (a loss all-reduce in the program's loop) belongs to every engine recording then, as
no engine can be told from another there, and with none recording (between steps) it is a wait of every
engine's gap (``gap_collective_ns``).  :class:`EngineCollectives` is the engine's place in the
process-wide wrappers: its ``step`` is the record collectives go to, None while nothing is recorded.
"""
from __future__ import annotations

from functools import lru_cache
from time import perf_counter_ns
from typing import Any, Dict, List, Optional, Tuple

import orjson

from .._device_clock import Pair, pair_ns, pairs_clock
from ..units import rank_ranges
from ..zero3.fetches import fetch_wait_ms

__all__ = ["SIDE_STREAM_SUFFIX", "EngineCollectives", "MicroSteps", "StepRecord", "optimizer_step_due",
           "optimizer_step_taken"]

SIDE_STREAM_SUFFIX = "@side-stream"
"""Appended to a collective called from a stream other than the one the step's forward started on
(ZeRO-3's gradient reduce-scatter with ``overlap_comm`` runs in its own stream): its time inside the
collective is its own, and none of it is a stall of the compute stream."""
_NS_PER_MS = 1e6


class _Collective:
    """One collective op's calls in a step, on one kind of stream: blocking calls and async ones apart.

    Times are kept twice: the host's measure, and device intervals where there is a device clock.
    """

    __slots__ = ("count", "async_count", "blocking_ns", "async_ns", "blocking_pairs", "async_pairs")

    def __init__(self) -> None:
        self.count = self.async_count = self.blocking_ns = self.async_ns = 0
        self.blocking_pairs: List[Pair] = []
        self.async_pairs: List[Pair] = []


class StepRecord:
    """One record being filled: what was read at the forward start, and what its step measured."""

    def __init__(self, fields: Dict[str, Any], start_mark: Any, compute_stream: Any) -> None:
        self.fields = fields
        self.start_ns = self.end_ns = perf_counter_ns()
        self.start_mark, self.end_mark = start_mark, None
        self.compute_stream = compute_stream  # the stream the forward started on (device clock), else None
        self.forward_done = self.backward_done = self.step_done = False
        self.side_failed = False  # a side forward (no_grad, inside this micro step) raised and was not retried yet
        self.written = True  # False: measured for the live figures only, no line in the file
        self.ends_optimizer_step = False  # its engine.step() took an optimizer step
        self.collectives: Dict[tuple, _Collective] = {}
        self.fetches: Any = None  # ZeRO-3's StepFetches, once the step is finished
        self.step_pair: Optional[Pair] = None
        # further figures of an engine kind's own (a pipeline's instruction times): each has pairs() and
        # fields(step_ms), the record's fields made once its times are known
        self.parts: List[Any] = []
        self.sequences: Dict[tuple, List[int]] = {}  # per group (its ranks): the step's first and last sequence number
        self._host_timing: Optional[Dict[str, Any]] = None  # timing() once the step ended, where no device time comes

    def complete(self, closing: bool, step_due: bool = False) -> bool:
        """Whether this record holds a whole step: its ``step()`` returned, or its forward ended and no
        ``step()`` was to come -- an eval or no-grad forward, or a second forward started before one ``step()``
        (a micro step before the accumulation boundary, which ended when its backward returned).  At
        close, a train forward whose backward never returned was cut short (SIGTERM in its backward,
        an exception), and so was one whose backward returned at the boundary (``step_due``) without the
        optimizer step that was to follow (a hang or a signal between the two): not a whole step."""
        if self.step_done or (self.backward_done and not step_due):
            return True
        return self.forward_done and (not closing or self.fields["mode"] != "train")

    def awaits_backward(self) -> bool:
        """A train forward returned and neither its backward nor a ``step()`` came yet: a forward under ``no_grad``
        now (DPO's reference logits after the policy's forward) is part of this micro step, its time, collectives
        and fetches too (its FLOPs are not: no backward reaches it, as a teacher's forward)."""
        return self.forward_done and not (self.backward_done or self.step_done) and self.fields["mode"] == "train"

    def add_collective(self, op: str, stream: Any, is_async: bool, host_ns: int, pair: Optional[Pair]) -> None:
        """One collective of this step: ``host_ns`` and ``pair`` time it on its own stream (``stream``, the
        stream it was issued on; None on the host clock).  An async one is counted at its wait."""
        side = stream is not None and stream != self.compute_stream
        totals = self.collectives.get((op, side))
        if totals is None:
            totals = self.collectives[(op, side)] = _Collective()
        totals.count += 1
        if is_async:
            totals.async_count += 1
            totals.async_ns += host_ns
            if pair is not None:
                totals.async_pairs.append(pair)
        else:
            totals.blocking_ns += host_ns
            if pair is not None:
                totals.blocking_pairs.append(pair)

    def note_sequence(self, ranks: tuple, seq: int) -> None:
        """A collective of this step had sequence number ``seq`` on the group of ``ranks`` (ranks line up by it)."""
        span = self.sequences.get(ranks)
        if span is None:
            self.sequences[ranks] = [seq, seq]
        else:
            span[1] = seq

    def pairs(self) -> List[Pair]:
        """Every device interval the record waits for before it is written."""
        found = self.fetches.pairs() if self.fetches is not None else []
        for totals in self.collectives.values():
            found += totals.blocking_pairs + totals.async_pairs
        for part in self.parts:
            found += part.pairs()
        return found + ([self.step_pair] if self.step_pair is not None else [])

    def timing(self) -> Dict[str, Any]:
        """The record's step time and collectives, in ms, on the clock each was measured on.  Without device
        events (no start mark) they are final once the step ended: the first call's dict is returned again (the
        recorder asks for the totals, then for the line; neither may change it)."""
        if self._host_timing is not None:
            return self._host_timing
        step_ns = pair_ns(self.step_pair) if self.step_pair else self.end_ns - self.start_ns
        # On the host clock the time blocked in an async collective's wait() stalled the step as a blocking call does
        # (ZeRO-3's parameter all-gathers); fetch records, where on, count those waits as fetch waits already.
        async_exposed = self.start_mark is None and self.fetches is None
        entries = {}
        inside_total_ms = exposed_total_ms = 0.0
        for (op, side), totals in self.collectives.items():
            # intervals on the device clock where there are any, else the host's total (inline: a step's own time)
            blocking, in_flight = totals.blocking_pairs, totals.async_pairs
            blocking_ms = (sum(map(pair_ns, blocking)) if blocking else totals.blocking_ns) / _NS_PER_MS
            async_ms = (sum(map(pair_ns, in_flight)) if in_flight else totals.async_ns) / _NS_PER_MS
            inside_ms = blocking_ms + async_ms
            exposed_ms = 0.0 if side else blocking_ms + (async_ms if async_exposed else 0.0)
            inside_total_ms += inside_ms
            exposed_total_ms += exposed_ms
            pairs = totals.blocking_pairs + totals.async_pairs
            entries[op + SIDE_STREAM_SUFFIX if side else op] = {
                "count": totals.count, "async": totals.async_count, "time_ms": inside_ms,
                "exposed_ms": exposed_ms, "stream": "side" if side else "compute",
                "clock": pairs_clock(pairs) if pairs else "host"
            }
        timing = {
            "step_time_ms": step_ns / _NS_PER_MS,
            "collectives": entries,
            "collective_ms": inside_total_ms - (0.0 if self.start_mark is None else self._overlap_ns() / _NS_PER_MS),
            "collective_wait_ms": exposed_total_ms,
            "collective_seq": dict(zip(map(_group_key, self.sequences), self.sequences.values())),
        }
        if self.start_mark is None:
            self._host_timing = timing
        return timing

    def line(self, header: Dict[str, Any], first_fields: Dict[str, Any], device_clock: bool) -> bytes:
        """The record's JSONL line once its times are known: ``header`` (the file's fields), ``first_fields`` (the
        first record's own), then the step's."""
        record = {**header, **first_fields, **self.fields}
        events = self.fetches.entries() if self.fetches is not None else {}
        timing = self.timing()
        record["step_time_ms"] = timing["step_time_ms"]  # first of the timing's keys in the line (update keeps it)
        record["fetch_wait_ms"] = fetch_wait_ms(events) if events else 0  # as the sum of none
        record.update(timing)
        for part in self.parts:
            record.update(part.fields(record["step_time_ms"]))
        record["exposed_wait_ms"] = record["fetch_wait_ms"] + record["collective_wait_ms"]
        if device_clock:
            record["clock"] = pairs_clock(self.pairs())
        record["events"] = events
        # orjson: a record is built on the step's own time, and the stdlib's encoder was a quarter of it.
        return orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE | orjson.OPT_SERIALIZE_NUMPY)

    def _overlap_ns(self) -> float:
        """How much of the collectives' device intervals on this step's time axis overlap (a prefetch beside
        a side stream's reduce-scatter): counted once in ``collective_ms``, which so stays within the step.
        Intervals on the host clock are sequential on the host, and are left as they are (not called there)."""
        intervals = sorted((pair.offset_ns, pair.offset_ns + pair.device_ns) for totals in self.collectives.values()
                           for pair in totals.blocking_pairs + totals.async_pairs
                           if pair.offset_ns is not None and pair.resolved and pair.anchor is self.start_mark)
        overlap = 0.0
        reach = None
        for start, end in intervals:
            if reach is not None and start < reach:
                overlap += min(end, reach) - start
            reach = end if reach is None else max(reach, end)
        return overlap


@lru_cache(maxsize=None)
def _group_key(ranks: Tuple[int, ...]) -> str:
    """A group's key in ``collective_seq`` (``0-3,5``): the same few groups every step, made once each."""
    return rank_ranges(ranks, ",")


def optimizer_step_due(engine: Any) -> bool:
    """Whether the engine's next ``step()`` takes an optimizer step (DeepSpeed's accumulation boundary; Accelerate
    sets it per micro step); False where the engine cannot say."""
    try:
        return bool(engine.is_gradient_accumulation_boundary())
    except Exception:  # noqa: BLE001 - an engine without it: the record stays whole, as it was
        return False


def optimizer_step_taken(engine: Any, steps_before: Optional[int]) -> bool:
    """Whether the engine's ``global_steps`` moved from ``steps_before`` (read as a ``step()``, a pipeline's
    ``train_batch()``, started): that call took an optimizer step.  Also where it raised afterwards (DeepSpeed's monitor
    writes after the optimizer step): the step ended all the same, whatever the exception, since a program may catch an
    error, a KeyboardInterrupt or the profiler's SystemExit and go on, and every rank that goes on must have counted the
    same steps (the live exchange's schedule).  On the way out of an ending job the interval's exchange that this may
    start fails fast once the peers are gone (gloo), or is launched without waiting (an accelerator)."""
    return steps_before is not None and getattr(engine, "global_steps", None) != steps_before


class EngineCollectives:
    """One recorded engine's place in the collective wrappers (see the module doc)."""

    __slots__ = ("engine_id", "step", "gap_collective_ns")

    def __init__(self, engine: Any) -> None:
        self.engine_id = id(engine)  # what the hooks say is running; never the engine itself (kept alive)
        self.step: Optional[StepRecord] = None
        self.gap_collective_ns = 0  # time inside torch.distributed calls between steps, since last taken

    def take_gap_collective_ms(self) -> float:
        """The time inside the frameworks' ``torch.distributed`` collectives between steps since the last call
        (an optimizer step's end), in ms; the count starts again."""
        gap_ns, self.gap_collective_ns = self.gap_collective_ns, 0
        return gap_ns / _NS_PER_MS


class MicroSteps:
    """The engine's micro steps (train forwards with their backwards) numbered as they happen.

    DeepSpeed moves ``engine.micro_steps`` only in ``step()``, which Accelerate and the Trainer call at
    the accumulation boundary only, so its count would give every micro step of an optimizer step one
    number.  Counted from the global step instead (the same figure under DeepSpeed's own loop, and
    across attaches and resumes): the train forwards seen since the engine's global step last moved.
    """

    def __init__(self) -> None:
        self._of: Optional[int] = None  # the global step the count is of
        self._index = 0

    def next(self, engine: Any, train: bool) -> int:
        """The number of the forward starting now; only a train forward moves the count."""
        if engine.global_steps != self._of:
            self._of, self._index = engine.global_steps, 0
        number = engine.global_steps * engine.gradient_accumulation_steps() + self._index
        self._index += train
        return number

    def take_back(self) -> None:
        """The last train forward's micro step was cut short by an error: its number is the retry's."""
        self._index = max(self._index - 1, 0)
