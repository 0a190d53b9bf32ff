"""Chrome traces handled as bytes: renaming events, and the run trace grown by one cycle at a time.

A 100 MB trace (250k events) takes 8 s to ``json.load`` on this project's machine and as long again
to dump, more than an interrupted rank has before the launcher's SIGKILL.  Everything here streams
the file in chunks and edits the few things it must with regular expressions, relying only on JSON
itself: a string value never holds a raw newline or an unescaped quote, so ``"name": "..."`` and
``"id": 12`` are found by byte patterns and never inside another value.  Chunks are cut before an
event begins (``\\n  {``, kineto's layout) or at least at a newline, so no pattern is ever split.

Every file is written under a temporary name beside its destination and renamed into place
(:func:`ds_profutils.outputs.atomic_path`), so a reader never sees half a trace.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

from ..outputs import ProcessIdentity, atomic_path

__all__ = ["MergedTrace", "TraceLayout", "read_layout", "rename_trace_events"]

_CHUNK = 8 << 20
_EVENT_START = b"\n  {"  # where kineto begins each event; chunks are cut just before it
_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
# Integers that link events inside one cycle's trace (flow arrows, CPU op to kernel).  Every cycle
# numbers them from the start again, so each cycle's are shifted past the previous cycles' values.
_LINK = re.compile(rb'"(id|bind_id|External id|correlation)": ?(\d+)')
# A process/thread name record ("M") and the comma after it: written once per run.  One that does
# not match (another layout) is kept, which costs a repeated name, never a broken file.
_NAME_RECORD = re.compile(rb'\{\s*"ph": "M",\s*"name": ("[^"\\]*"),(?:\s*"ts": [^,\n]*,)?\s*"pid": ([^,\n]*),'
                          rb'\s*"tid": ([^,\n]*),\s*"args": \{[^{}]*\}\s*\}\s*,')
# Keys of one file that do not describe the merged run.
_PER_FILE_KEYS = ("traceName", "trace_id", "ds_profutils")
_TAIL_READ = 1 << 16

Check = Callable[[], None]
"""Called between chunks; raises to abandon the write (the interruption deadline)."""


def _no_check() -> None:
    pass


@dataclass(frozen=True)
class TraceLayout:
    """Where a Chrome trace's events array lies, and its other top-level keys (all small)."""

    header: Dict[str, Any]
    events_start: int  # just after "traceEvents": [
    events_end: int  # the closing ]


def read_layout(path: Path) -> TraceLayout:
    """Find the events array of the trace at ``path`` reading only its first and last bytes.

    Raises ValueError when the file is not a JSON object with a ``traceEvents`` array.
    """
    size = path.stat().st_size
    with open(path, "rb") as source:
        head, found = b"", None
        while found is None and len(head) < size:
            head += source.read(_TAIL_READ)
            found = _EVENTS_KEY.search(head)
        if found is None:
            raise ValueError(f"{path}: no traceEvents array")
        header = json.loads(head[:found.start()].rstrip().rstrip(b",") + b"}")
        source.seek(max(0, size - _TAIL_READ))
        tail_start = source.tell()
        tail = source.read()
    for position in range(len(tail) - 1, -1, -1):  # the last "]" that only top-level keys follow
        if tail[position] != ord("]"):
            continue
        rest = tail[position + 1:].strip()
        if rest == b"}" or (rest.startswith(b",") and _is_object(b"{" + rest[1:])):
            end = tail_start + position
            if end >= found.end():
                return TraceLayout(header, found.end(), end)
    raise ValueError(f"{path}: the traceEvents array is not closed")


def _is_object(text: bytes) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _chunks(source: BinaryIO, start: int, end: int, check: Check) -> Iterator[bytes]:
    """Bytes ``[start, end)`` of ``source`` in pieces cut before an event starts (or at a newline)."""
    source.seek(start)
    remaining, carry = end - start, b""
    while remaining > 0:
        check()
        data = source.read(min(_CHUNK, remaining))
        if not data:
            raise ValueError("the trace file shrank while it was read")
        remaining -= len(data)
        data = carry + data
        if remaining:
            cut = data.rfind(_EVENT_START)
            cut = cut if cut > 0 else data.rfind(b"\n") + 1
            data, carry = data[:cut], data[cut:]
        else:
            carry = b""
        yield data
    if carry:
        yield carry


def rename_trace_events(path: Path,
                        renames: Mapping[str, str],
                        identity: Optional[ProcessIdentity] = None,
                        check: Check = _no_check) -> None:
    """Rename every event called ``old`` to ``new`` for each pair of ``renames``, in place (atomically)."""
    pairs = [(b'"name": ' + json.dumps(old).encode(), b'"name": ' + json.dumps(new).encode())
             for old, new in renames.items()]
    with atomic_path(path, identity) as temporary, open(path, "rb") as source, open(temporary, "wb") as out:
        for chunk in _chunks(source, 0, path.stat().st_size, check):
            for old, new in pairs:
                chunk = chunk.replace(old, new)
            out.write(chunk)


class _EventCopier:
    """Copies one cycle's events: link ids shifted by ``offset``, name records already written dropped."""

    def __init__(self, offset: int, seen: Set[Tuple[bytes, bytes, bytes]]) -> None:
        self.offset = offset
        self.largest = offset - 1
        self.seen = seen

    def _shift(self, match: "re.Match[bytes]") -> bytes:
        value = int(match.group(2)) + self.offset
        if value > self.largest:
            self.largest = value
        return b'"%s": %d' % (match.group(1), value)

    def _once(self, match: "re.Match[bytes]") -> bytes:
        key = match.group(1, 2, 3)
        if key in self.seen:
            return b""
        self.seen.add(key)
        return match.group(0)

    def copy(self, source: BinaryIO, layout: TraceLayout, out: BinaryIO, separator: bytes, check: Check) -> bool:
        """Write the events (after ``separator`` when there are any); True if any were written."""
        wrote = False
        for chunk in _chunks(source, layout.events_start, layout.events_end, check):
            chunk = _LINK.sub(self._shift, _NAME_RECORD.sub(self._once, chunk))
            if not wrote:
                if not chunk.strip():
                    continue
                out.write(separator)
                wrote = True
            out.write(chunk)
        return wrote


def _copy_bytes(source: BinaryIO, out: BinaryIO, count: int, check: Check) -> None:
    while count > 0:
        check()
        data = source.read(min(_CHUNK, count))
        if not data:
            raise ValueError("the run trace shrank while it was copied")
        out.write(data)
        count -= len(data)


class MergedTrace:
    """One rank's run trace (``trace_rank_{r}.json``), brought up to date as each cycle ends.

    With one cycle it is that cycle's file, hard-linked.  With more, it is the previous run trace's
    bytes up to the end of its events, the new cycle's events (link ids shifted past the previous
    cycles', name records not repeated), and ``metadata`` as the ``ds_profutils`` key.  Only a chunk
    is in memory at a time; the state kept between cycles changes only once a new file is in place.
    """

    def __init__(self, path: Path, identity: ProcessIdentity) -> None:
        self.path = path
        self._identity = identity
        self._cycles: List[Path] = []
        self._events_end: Optional[int] = None  # None: the file is still the first cycle's own
        self._has_events = False
        self._next_link_id = 0
        self._seen: Set[Tuple[bytes, bytes, bytes]] = set()

    @property
    def cycles(self) -> int:
        """How many cycles the file on disk holds."""
        return len(self._cycles)

    def add(self, cycle_traces: Sequence[Path], metadata: Mapping[str, Any], check: Check = _no_check) -> None:
        """Make the run trace hold ``cycle_traces`` too, in order (``metadata`` describes the whole run)."""
        check()
        if not self._cycles and len(cycle_traces) == 1:
            with atomic_path(self.path, self._identity) as temporary:
                try:
                    os.link(cycle_traces[0], temporary)
                except OSError:  # a file system without hard links
                    shutil.copyfile(cycle_traces[0], temporary)
            self._cycles.append(cycle_traces[0])
            return
        seen, next_id, has_events = set(self._seen), self._next_link_id, self._has_events
        with atomic_path(self.path, self._identity) as temporary, open(temporary, "wb") as out:
            if self._events_end is None:  # the file is still one cycle's own: begin with that cycle's header
                todo = [*self._cycles, *cycle_traces]
                header = {key: value for key, value in read_layout(todo[0]).header.items() if key not in _PER_FILE_KEYS}
                out.write(json.dumps(header)[:-1].encode() + (b", " if header else b"") + b'"traceEvents": [')
            else:
                with open(self.path, "rb") as previous:
                    _copy_bytes(previous, out, self._events_end, check)
                todo = list(cycle_traces)
            for cycle_trace in todo:
                copier = _EventCopier(next_id, seen)
                with open(cycle_trace, "rb") as source:
                    wrote = copier.copy(source, read_layout(cycle_trace), out, b"," if has_events else b"", check)
                has_events = has_events or wrote
                next_id = copier.largest + 1
            events_end = out.tell()
            out.write(b'\n],\n"ds_profutils": ' + json.dumps(dict(metadata)).encode() + b"}\n")
        self._cycles += cycle_traces
        self._events_end, self._has_events = events_end, has_events
        self._next_link_id, self._seen = next_id, seen
