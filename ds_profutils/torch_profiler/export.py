"""Chrome traces handled as bytes: the run trace grown by one cycle at a time, and the one rename.

A 100 MB trace (250k events) takes 8 s to ``json.load`` on this project's machine and as long again
to dump, more than an interrupted rank has before the launcher's SIGKILL.  Everything here streams
the file in chunks and edits the few things it must with regular expressions, relying only on JSON
itself: a string value never holds a raw newline or an unescaped quote, so ``"name": "..."`` and
``"id": 12`` are found by byte patterns and never inside another value.  Chunks are cut before an
event begins (``\\n  {``, kineto's layout) or at least at a newline, so no pattern is ever split.

A file written whole goes under a temporary name beside its destination and is renamed into place
(:func:`ds_profutils.outputs.atomic_path`), so a reader never sees half of it; the run trace's later
cycles are spliced in place (:class:`RunTrace` says what a kill in the middle leaves).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

from ..outputs import ProcessIdentity, atomic_path

__all__ = ["RunTrace", "TraceLayout", "read_layout", "rename_trace_events"]

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
_CLOSING = b"\n]}\n"  # the run trace's end: fixed, so a splice rewrites two of its bytes


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


def _chunks(source: BinaryIO, start: int, end: int) -> Iterator[bytes]:
    """Bytes ``[start, end)`` of ``source`` in pieces cut before an event starts (or at a newline)."""
    source.seek(start)
    remaining, carry = end - start, b""
    while remaining > 0:
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


def rename_trace_events(path: Path, renames: Mapping[str, str], identity: Optional[ProcessIdentity] = None) -> None:
    """Rename every event called ``old`` to ``new`` for each pair of ``renames``, in place (atomically).

    The profiler's one rewrite: torch fixes a range's name when the range opens, and when
    ``step_profiler()`` opens step N's range nothing can tell that the call will return before step N
    ends; so the last cycle of a call that returns inside a window is written with that range renamed.
    """
    pairs = [(b'"name": ' + json.dumps(old).encode(), b'"name": ' + json.dumps(new).encode())
             for old, new in renames.items()]
    with atomic_path(path, identity) as temporary, open(path, "rb") as source, open(temporary, "wb") as out:
        for chunk in _chunks(source, 0, path.stat().st_size):
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

    def copy(self, source: BinaryIO, layout: TraceLayout, out: BinaryIO, separator: bytes) -> bool:
        """Write the events (after ``separator`` when there are any); True if any were written."""
        wrote = False
        for chunk in _chunks(source, layout.events_start, layout.events_end):
            chunk = _LINK.sub(self._shift, _NAME_RECORD.sub(self._once, chunk))
            if not wrote:
                if not chunk.strip():
                    continue
                out.write(separator)
                wrote = True
            out.write(chunk)
        return wrote


class RunTrace:
    """One rank's run trace (``trace_rank_{r}.json``), grown in place by each cycle: flat cost per cycle.

    Layout: the first cycle's head (its per-file keys left out, ``ds_profutils`` = the run's metadata),
    every cycle's events in order (link ids shifted past the earlier cycles', each process/thread name
    record once), then a fixed closing ``\n]}\n``.  The file is written whole, under a temporary name,
    for the first cycle (or again if someone else changed it); after that each cycle is *spliced* in:

    1. the cycle's events and a new closing are appended after the old closing (the file is now the
       previous trace followed by bytes a JSON parser calls trailing data);
    2. the old closing's ``]}`` is overwritten with two spaces (one 2-byte write), which makes the new
       events part of the array.

    Only the new cycle's bytes are written, so cycle 50 costs what cycle 1 does.  A process killed in
    step 1 (SIGKILL, or the deadline of :mod:`.watchdog`) leaves every earlier cycle whole, followed by
    a cut copy of the new one: ``ds-profutils report`` and ``timeline`` read up to the old closing
    (the earlier cycles); ``json.load`` and Perfetto refuse the trailing bytes; the new cycle's own
    file is whole.  A write that fails (a full disk) is undone before the error goes on.
    """

    def __init__(self, path: Path, identity: ProcessIdentity) -> None:
        self.path = path
        self._identity = identity
        self.cycles: List[Path] = []  # the cycle traces the file holds, in order
        self._closing_at: Optional[int] = None  # offset of the closing
        self._state: Optional[Tuple[int, int]] = None  # (inode, size) of the file as this object left it
        self._has_events = False
        self._next_link_id = 0
        self._seen: Set[Tuple[bytes, bytes, bytes]] = set()

    def add(self, cycle_traces: Sequence[Path], metadata: Mapping[str, Any]) -> None:
        """Make the run trace hold ``cycle_traces`` too, in order; ``metadata`` is the run's (its head)."""
        if self._state is not None and self._unchanged():
            self._splice(cycle_traces)
        else:
            self._write_whole([*self.cycles, *cycle_traces], metadata)

    def drop(self, cycle_traces: Set[str]) -> None:
        """Leave the cycles at these paths out: the next :meth:`add` writes the file whole from the rest."""
        self.cycles = [path for path in self.cycles if str(path) not in cycle_traces]
        self._state = None

    def _unchanged(self) -> bool:
        try:
            stat = os.stat(self.path)
        except OSError:
            return False
        return (stat.st_ino, stat.st_size) == self._state

    def _copy_cycles(self, cycle_traces: Sequence[Path], out: BinaryIO, seen: Set[Tuple[bytes, bytes, bytes]],
                     next_id: int, has_events: bool) -> Tuple[int, bool]:
        """Copy the events of ``cycle_traces`` to ``out``; returns the next free link id and whether any events
        are in the array now."""
        for cycle_trace in cycle_traces:
            copier = _EventCopier(next_id, seen)
            with open(cycle_trace, "rb") as source:
                wrote = copier.copy(source, read_layout(cycle_trace), out, b"," if has_events else b"")
            has_events = has_events or wrote
            next_id = copier.largest + 1
        return next_id, has_events

    def _write_whole(self, cycle_traces: Sequence[Path], metadata: Mapping[str, Any]) -> None:
        seen: Set[Tuple[bytes, bytes, bytes]] = set()
        header = {key: value for key, value in read_layout(cycle_traces[0]).header.items()
                  if key not in _PER_FILE_KEYS}
        header["ds_profutils"] = dict(metadata)
        with atomic_path(self.path, self._identity) as temporary, open(temporary, "wb") as out:
            out.write(json.dumps(header)[:-1].encode() + b', "traceEvents": [')
            next_id, has_events = self._copy_cycles(cycle_traces, out, seen, 0, False)
            closing_at = out.tell()
            out.write(_CLOSING)
        stat = os.stat(self.path)
        self._commit(cycle_traces, closing_at, (stat.st_ino, stat.st_size), next_id, has_events, seen, replace=True)

    def _splice(self, cycle_traces: Sequence[Path]) -> None:
        seen = set(self._seen)
        old_closing, old_size = self._closing_at, self._state[1]
        with open(self.path, "r+b") as out:
            try:
                out.seek(old_size)
                next_id, has_events = self._copy_cycles(cycle_traces, out, seen, self._next_link_id, self._has_events)
                closing_at = out.tell()
                out.write(_CLOSING)
                out.flush()
                size = out.tell()
                os.pwrite(out.fileno(), b"  ", old_closing + 1)  # the old "]}" becomes whitespace
            except BaseException:
                with contextlib.suppress(OSError):
                    out.truncate(old_size)
                raise
            inode = os.fstat(out.fileno()).st_ino
        self._commit(cycle_traces, closing_at, (inode, size), next_id, has_events, seen, replace=False)

    def _commit(self, cycle_traces: Sequence[Path], closing_at: int, state: Tuple[int, int], next_id: int,
                has_events: bool, seen: Set[Tuple[bytes, bytes, bytes]], replace: bool) -> None:
        """The file now holds ``cycle_traces`` (all of them if ``replace``, else after the earlier ones)."""
        self.cycles = list(cycle_traces) if replace else [*self.cycles, *cycle_traces]
        self._closing_at, self._state = closing_at, state
        self._next_link_id, self._has_events, self._seen = next_id, has_events, seen
