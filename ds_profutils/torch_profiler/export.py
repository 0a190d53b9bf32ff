"""The run trace of one rank: its cycles' Chrome traces merged into one, and renaming events in a trace.

Every file is written under a temporary name beside its destination and renamed into place
(:func:`ds_profutils.outputs.atomic_path`), so a reader never sees half a trace.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, TextIO

from ..outputs import ProcessIdentity, atomic_path

__all__ = ["merge_traces", "rename_trace_events"]

# Integers that link events to each other inside one cycle's trace.  Every cycle numbers them from the
# start again, so the merged trace shifts each cycle's values past the previous cycles' to keep an
# arrow (flow event) or a CPU-op/kernel correlation from joining two cycles.
_LINK_FIELDS = ("id", "bind_id")
_LINK_ARGS = ("External id", "correlation")


def rename_trace_events(path: Path, old: str, new: str) -> None:
    """Rename every event called ``old`` in the Chrome trace at ``path`` (rewritten in place)."""
    with open(path, encoding="utf-8") as source:
        trace = json.load(source)
    for event in trace.get("traceEvents", []):
        if event.get("name") == old:
            event["name"] = new
    with open(path, "w", encoding="utf-8") as out:
        json.dump(trace, out)


def _shift_links(event: Dict[str, Any], offset: int) -> int:
    """Shift the linking integers of ``event`` by ``offset``; return the largest shifted value (or -1)."""
    largest = -1
    for holder, keys in ((event, _LINK_FIELDS), (event.get("args"), _LINK_ARGS)):
        if not isinstance(holder, dict):
            continue
        for key in keys:
            value = holder.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                holder[key] = value + offset
                largest = max(largest, value + offset)
    return largest


class _EventStream:
    """Writes events of successive cycles into one open ``traceEvents`` array."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._separator = "\n"
        self._seen_metadata: set = set()
        self._offset = 0

    def add_cycle(self, events: Sequence[Dict[str, Any]]) -> None:
        """Append one cycle; process/thread name records ("M") are written once for the whole run."""
        largest = self._offset - 1
        for event in events:
            if event.get("ph") == "M":
                key = (event.get("name"), event.get("pid"), event.get("tid"))
                if key in self._seen_metadata:
                    continue
                self._seen_metadata.add(key)
            else:
                largest = max(largest, _shift_links(event, self._offset))
            self._out.write(self._separator)
            self._out.write(json.dumps(event))
            self._separator = ",\n"
        self._offset = largest + 1


def merge_traces(cycle_traces: Sequence[Path],
                 destination: Path,
                 metadata: Mapping[str, Any],
                 identity: Optional[ProcessIdentity] = None) -> None:
    """Write the cycles' Chrome traces (at least one) as one trace at ``destination``.

    Top-level keys (``distributedInfo``, ``deviceProperties``, ...) come from the first cycle, then
    ``metadata`` is added; events of all cycles follow in order.  One cycle is in memory at a time.
    """
    with atomic_path(destination, identity) as temporary, open(temporary, "w") as out:
        stream = _EventStream(out)
        for index, path in enumerate(cycle_traces):
            with open(path) as source:
                trace = json.load(source)
            events = trace.pop("traceEvents", [])
            if index == 0:
                header = {k: v for k, v in trace.items() if k not in ("traceName", "trace_id")}
                header.update(metadata)
                # The header's keys, then the events array left open for the stream.
                out.write(json.dumps(header)[:-1] + (", " if header else "") + '"traceEvents": [')
            stream.add_cycle(events)
        out.write("\n]}\n")
