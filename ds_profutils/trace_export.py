"""One rank's profiler files: where they go, how they are written, and the merged run trace.

Layout under ``output_dir`` (names carry the global rank only; the host is recorded inside):

* ``rank_{r}/rank_{r}.{ns}.pt.trace.json``: one trace per recorded cycle, named the way the
  TensorBoard profiler plugin reads them (worker ``rank_{r}``, span ``{ns}``);
* ``trace_rank_{r}.json``: every cycle of the run in one Chrome/Perfetto trace;
* ``summary_rank_{r}.txt``: the operator table, on the ranks configured to write one.

Every file is written under a hidden temporary name beside its destination and renamed into place,
so a reader (TensorBoard polling the directory, a job killed mid-write) never sees half a trace.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Mapping, Sequence, TextIO

__all__ = ["TraceFiles", "atomic_path", "merge_traces", "probe_writable", "rename_trace_events"]

# Integers that link events to each other inside one cycle's trace.  Every cycle numbers them from the
# start again, so the merged trace shifts each cycle's values past the previous cycles' to keep an
# arrow (flow event) or a CPU-op/kernel correlation from joining two cycles.
_LINK_FIELDS = ("id", "bind_id")
_LINK_ARGS = ("External id", "correlation")


@contextlib.contextmanager
def atomic_path(destination: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``destination``; rename it onto ``destination`` if the block succeeds.

    On failure the temporary file is removed and the destination is left as it was.
    """
    temporary = destination.with_name(f".{destination.name}.{os.getpid()}.tmp")
    try:
        yield temporary
        os.replace(temporary, destination)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)


class TraceFiles:
    """The output paths of one global rank."""

    def __init__(self, output_dir: os.PathLike | str, rank: int) -> None:
        self.output_dir = Path(output_dir)
        self.rank = rank
        self.cycle_dir = self.output_dir / f"rank_{rank}"
        self.merged_trace = self.output_dir / f"trace_rank_{rank}.json"
        self.summary = self.output_dir / f"summary_rank_{rank}.txt"

    def new_cycle_trace(self) -> Path:
        """A fresh path for the next cycle's trace (a nanosecond stamp, so cycles and runs never clash)."""
        self.cycle_dir.mkdir(parents=True, exist_ok=True)
        return self.cycle_dir / f"rank_{self.rank}.{time.time_ns()}.pt.trace.json"


def probe_writable(directory: Path) -> None:
    """Create ``directory`` and write a probe file in it, so a bad ``output_dir`` fails before training.

    Raises OSError with the reason.
    """
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".write_probe.{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()


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


def merge_traces(cycle_traces: Sequence[Path], destination: Path, metadata: Mapping[str, Any]) -> None:
    """Write the cycles' Chrome traces (at least one) as one trace at ``destination``.

    Top-level keys (``distributedInfo``, ``deviceProperties``, ...) come from the first cycle, then
    ``metadata`` is added; events of all cycles follow in order.  One cycle is in memory at a time.
    """
    with atomic_path(destination) as temporary, open(temporary, "w") as out:
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
