"""Step times and top operations of a Chrome trace, read as a stream.

A torch trace of a few steps is tens of MB; loading it whole (``json.load``, or a trace-analysis
library's DataFrame) costs seconds and several times the file size in memory.  This reader decodes
one event of ``traceEvents`` at a time and keeps only running totals, so memory stays flat whatever
the trace's size.  Top-level keys (``distributedInfo``) are read too.  ds_profutils writes a run
trace one event per line: such a line is parsed whole by orjson; anything else (torch's
pretty-printed per-cycle traces) by the C JSON scanner, which finds where an event ends.
"""
from __future__ import annotations

import gzip
import json
import re
from statistics import median
from pathlib import Path
from typing import IO, Any, Dict, Iterator, List, Mapping, Optional, Tuple

import orjson

from ..outputs import STEP_RANGE_PREFIX

__all__ = ["OP_CATEGORIES", "TraceFormatError", "iter_trace", "summarize_trace", "trace_identity"]

_CHUNK = 1 << 20
_EVENTS_KEY = re.compile(r'"traceEvents"\s*:\s*\[')
_SKIP = re.compile(r"[\s,]*")
# Categories whose events are operations worth ranking (torch's names for them).
OP_CATEGORIES = frozenset({"cpu_op", "kernel", "gpu_memcpy", "gpu_memset", "user_annotation", "gpu_user_annotation"})
_DEVICE_STEP_CATEGORY = "gpu_user_annotation"
_US_PER_MS = 1e3


def trace_identity(header: Mapping[str, Any]) -> Dict[str, Any]:
    """Who wrote a trace, from its head: rank, world size and host (ds_profutils' metadata first, then
    torch's ``distributedInfo``), the clock base (wall-clock ns at the profiler's start), and ``ours``,
    the ds_profutils metadata itself ({} in a trace of another tool)."""
    ours = header.get("ds_profutils") if isinstance(header.get("ds_profutils"), Mapping) else {}
    torch_info = header.get("distributedInfo") if isinstance(header.get("distributedInfo"), Mapping) else {}
    base = header.get("baseTimeNanoseconds")
    return {"rank": ours.get("rank", torch_info.get("rank")), "host": ours.get("host"),
            "world_size": ours.get("world_size", torch_info.get("world_size")),
            "base_time_ns": base if isinstance(base, int) else None, "ours": ours}


class TraceFormatError(ValueError):
    """The file is not a Chrome trace with a ``traceEvents`` array (or it ends early)."""


class _CutGzip:
    """A gzip trace read as text, where a stream cut short (the job killed while writing) reads as its end:
    the events before the cut stay usable, and :func:`iter_trace` says the trace is truncated."""

    def __init__(self, path: Path) -> None:
        self._source: IO[str] = gzip.open(path, "rt", encoding="utf-8")

    def read(self, size: int = -1) -> str:
        try:
            return self._source.read(size)
        except (EOFError, gzip.BadGzipFile):
            return ""

    def __enter__(self) -> "_CutGzip":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._source.close()


def open_trace(path: Path) -> Any:
    """A trace opened as text: ``trace_rank_{r}.json``, or a capture's ``.json.gz`` (trace_capture.gzip)."""
    return _CutGzip(path) if path.name.endswith(".gz") else open(path, encoding="utf-8")


def iter_trace(path: Path) -> Iterator[Tuple[str, Any]]:
    """Yield ``("head", dict)`` of the top-level keys before ``traceEvents``, ``("event", event)`` for each
    trace event, then ``("header", dict)`` of every other top-level key (before and after the events).

    A trace that ends early raises :class:`TraceFormatError` after its last complete event: what
    came before (the head too, where torch and ds_profutils put ``baseTimeNanoseconds``) is usable.
    """
    decoder = json.JSONDecoder()
    with open_trace(path) as source:
        buffer = source.read(_CHUNK)
        match = _EVENTS_KEY.search(buffer)
        while match is None:
            more = source.read(_CHUNK)
            if not more:
                raise TraceFormatError("no \"traceEvents\" array")
            buffer += more
            match = _EVENTS_KEY.search(buffer)
        head, position = buffer[:match.start()], match.end()
        yield "head", _header(head, "")
        while True:
            position = _SKIP.match(buffer, position).end()
            if position < len(buffer) and buffer[position] == "]":
                break
            end = buffer.find("\n", position)
            if end > 0:
                line = buffer[position:end].rstrip().rstrip(",")
                # A line that is one whole object is one event (JSON strings hold no raw newline).
                if line.startswith("{") and line.endswith("}"):
                    try:
                        event = orjson.loads(line)
                    except orjson.JSONDecodeError:
                        pass  # not a whole event on its own line: the scanner below finds its end
                    else:
                        position = end
                        yield "event", event
                        continue
            try:
                event, position = decoder.raw_decode(buffer, position)
            except json.JSONDecodeError:
                more = source.read(_CHUNK)
                if not more:
                    raise TraceFormatError("the trace ends inside \"traceEvents\" (truncated?)") from None
                buffer = buffer[position:] + more
                position = 0
                continue
            yield "event", event
        tail = buffer[position + 1:] + source.read()
    yield "header", _header(head, tail)


def _header(head: str, tail: str) -> Dict[str, Any]:
    """The top-level keys around ``traceEvents``; malformed surroundings just give fewer keys."""
    header: Dict[str, Any] = {}
    head = head.rstrip().rstrip(",")
    if head.lstrip().startswith("{") and head.strip() != "{":
        try:
            header.update(json.loads(head + "}"))
        except json.JSONDecodeError:
            pass
    tail = tail.strip().lstrip(",")
    if tail.rstrip().endswith("}") and tail.strip() != "}":
        try:
            header.update(json.loads("{" + tail))
        except json.JSONDecodeError:
            pass
    return header


def summarize_trace(path: Path, top: int = 10) -> Dict[str, Any]:
    """Profiler steps (``ProfilerStep#N`` durations) and the ``top`` operations by total time.

    Times are inclusive (an op's children count in it), in ms.  Ranges of the same N (one per micro
    step when ``step_profiler(engine)`` numbers steps by the engine's optimizer steps) add up to one
    step.  ``rank`` comes from the trace's ``ds_profutils`` metadata, else its ``distributedInfo``;
    ``step_numbering`` is ``"global"`` when N is the engine's global step (only then does the report
    put the trace's step time beside the records').  A trace cut short (a job killed mid-write) is
    summarized up to the cut, as ``timeline`` merges it, and ``incomplete`` says why (None: read to its end);
    a file with no ``traceEvents`` array raises :class:`TraceFormatError`.
    """
    steps: Dict[int, float] = {}
    ops: Dict[Tuple[str, str], List[float]] = {}
    events = 0
    header: Optional[Dict[str, Any]] = None
    cut: Optional[str] = None
    reader = iter_trace(path)
    while True:
        try:
            kind, item = next(reader)
        except StopIteration:
            break
        except TraceFormatError as exc:
            if header is None:  # not a trace at all: no "traceEvents" array
                raise
            cut = str(exc)  # cut short (a killed job): its events up to the cut are summarized
            break
        if kind != "event":
            header = item
            continue
        events += 1
        if item.get("ph") != "X":
            continue
        name = item.get("name", "")
        duration = float(item.get("dur", 0.0))
        category = item.get("cat", "")
        if name.startswith(STEP_RANGE_PREFIX):
            # On a GPU, torch also draws each step on the device timeline (gpu_user_annotation): the
            # host range is the step.
            if category != _DEVICE_STEP_CATEGORY:
                number = _step_number(name)
                steps[number] = steps.get(number, 0.0) + duration / _US_PER_MS
            continue
        if category in OP_CATEGORIES:
            totals = ops.get((category, name))
            if totals is None:
                ops[(category, name)] = [1, duration]
            else:
                totals[0] += 1
                totals[1] += duration
    ranked = sorted(ops.items(), key=lambda item: item[1][1], reverse=True)[:top]
    identity = trace_identity(header or {})
    ours = identity.pop("ours")
    return {
        "file": str(path),
        "incomplete": cut,
        **identity,
        "step_numbering": ours.get("step_numbering"),
        # null: every rank was profiled; absent: the trace does not say (an older ds_profutils)
        **({"profiled_ranks": ours["profiled_ranks"]} if "profiled_ranks" in ours else {}),
        "events": events,
        "steps": [{"step": step, "ms": ms} for step, ms in sorted(steps.items())],
        "step_ms": {
            "median": median(steps.values()),
            "max": max(steps.values())
        } if steps else None,
        "top_ops": [{
            "name": name,
            "cat": category,
            "count": count,
            "total_ms": total / _US_PER_MS
        } for (category, name), (count, total) in ranked],
    }


def _step_number(name: str) -> int:
    try:
        return int(name[len(STEP_RANGE_PREFIX):])
    except ValueError:
        return -1
