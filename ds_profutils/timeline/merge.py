"""``ds-profutils timeline``: the ranks' traces merged, by streaming, into one Chrome/Perfetto trace.

Each trace's ``ts`` is in microseconds from its own ``baseTimeNanoseconds``, and that base differs
between processes and hosts: every trace is first placed on one clock by its base.  Ranks on one host
share a clock, so their relative times are kept as recorded.  Hosts' clocks may differ (by
milliseconds with NTP, by anything without it), so each other host is shifted so that the end of the
last collective every rank recorded coincides with its end on the first rank's host: a collective
ends on all ranks together (the last one to arrive releases the others), whereas step starts differ
by exactly the delay a straggler causes, so aligning on them would hide it.

Two passes per trace, one event in memory at a time: the first reads the collectives' ends, threads
and link ids; the second writes every event with its rank as the process.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import IO, Any, Dict, List, Mapping, Optional, Sequence, Tuple

import orjson

from ..report.traces import TraceFormatError, iter_trace, trace_identity

__all__ = ["Alignment", "TraceScan", "align", "scan_trace", "write_timeline"]

# Events that end when the collective ends on every rank, best first: NCCL kernels on the device
# timeline (a host-side nccl:* range ends at the launch), gloo's synchronous host calls, and last
# the host-side ranges, for traces that have nothing better.
_FAMILIES = (("device NCCL kernels", lambda cat, name: cat == "kernel" and name.startswith("nccl")),
             ("gloo collectives", lambda cat, name: name.startswith("gloo:")),
             ("host collective ranges", lambda cat, name: name.startswith("nccl:") or name == "record_param_comms"))
_COLLECTIVE_STARTS = frozenset({"nccl", "gloo", "reco"})  # a cheap first test, for every event
_LINK_FIELDS = ("id", "bind_id")  # flow arrows; numbered from 0 in every trace, so shifted per rank
_NS_PER_US = 1000


@dataclass
class TraceScan:
    """What the first pass over one rank's trace found."""

    rank: int
    path: Path
    host: Optional[str] = None
    base_ns: Optional[int] = None
    world_size: Optional[int] = None
    events: int = 0
    error: Optional[str] = None  # the trace ends early: its events up to there are still merged
    threads: Dict[Tuple[Any, Any], str] = field(default_factory=dict)  # (pid, tid) -> thread name
    collectives: Dict[str, Dict[Tuple[str, int], float]] = field(default_factory=dict)  # family -> key -> end
    largest_link: int = -1
    main_pid: Optional[int] = None  # the profiled process (its other "processes" are devices and torch's own)


def _names(event: Mapping[str, Any], processes: Dict[Any, str], thread_names: Dict[Tuple[Any, Any], str]) -> None:
    name, args = event.get("name"), event.get("args") or {}
    if name == "process_name":
        processes[event.get("pid")] = str(args.get("name", ""))
    elif name == "thread_name":
        thread_names[(event.get("pid"), event.get("tid"))] = str(args.get("name", ""))


def scan_trace(path: Path, rank: int) -> TraceScan:
    """Pass one: host, clock base, threads, the ends of collectives (per family, by name and occurrence)."""
    scan = TraceScan(rank, path)
    processes: Dict[Any, str] = {}
    thread_names: Dict[Tuple[Any, Any], str] = {}
    starts: Dict[str, Dict[str, List[Tuple[float, float]]]] = {}
    try:
        for kind, item in iter_trace(path):
            if kind != "event":
                _read_header(scan, item)
                continue
            scan.events += 1
            if item.get("ph") == "M":
                _names(item, processes, thread_names)
                continue
            scan.threads.setdefault((item.get("pid"), item.get("tid")), "")
            for key in _LINK_FIELDS:
                value = item.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > scan.largest_link:
                    scan.largest_link = value
            name = item.get("name")
            if item.get("ph") == "X" and isinstance(name, str) and name[:4] in _COLLECTIVE_STARTS:
                category = str(item.get("cat", ""))
                family = next((label for label, belongs in _FAMILIES if belongs(category, name)), None)
                if family is not None:
                    ts = float(item["ts"])
                    starts.setdefault(family, {}).setdefault(name, []).append((ts, ts + float(item.get("dur", 0))))
    except (OSError, TraceFormatError, KeyError, TypeError, ValueError) as exc:
        scan.error = str(exc)
    for family, by_name in starts.items():
        scan.collectives[family] = {(name, index): end for name, spans in by_name.items()
                                    for index, (_, end) in enumerate(sorted(spans))}
    scan.main_pid = main_pid = min((pid for pid in processes if isinstance(pid, int)), default=None)
    for pid, tid in scan.threads:
        own = thread_names.get((pid, tid)) or f"thread {tid}"
        scan.threads[(pid, tid)] = own if pid == main_pid else f"{processes.get(pid) or pid}: {own}"
    return scan


def _read_header(scan: TraceScan, header: Mapping[str, Any]) -> None:
    """Host, world size and clock base from the head; the rank too, when the trace says (else the file name's)."""
    identity = trace_identity(header)
    if identity["host"] is not None:
        scan.host = str(identity["host"])
    if isinstance(identity["rank"], int):
        scan.rank = identity["rank"]
    if isinstance(identity["world_size"], int):
        scan.world_size = identity["world_size"]
    if identity["base_time_ns"] is not None:
        scan.base_ns = identity["base_time_ns"]


@dataclass
class Alignment:
    """How the traces were put on one clock: per rank the shift added to its ``ts`` (us), and how hosts were aligned."""

    base_ns: int
    shift_us: Dict[int, float]
    host_offset_us: Dict[str, float]
    family: Optional[str] = None
    collective: Optional[Tuple[str, int]] = None
    residual_us: Dict[str, float] = field(default_factory=dict)  # per host: median |end gap| over all common ones
    note: Optional[str] = None


def _common(scans: Sequence[TraceScan]) -> Tuple[Optional[str], List[Tuple[str, int]]]:
    """The best family of collectives every scan has, and the (name, occurrence) keys they share."""
    for family, _ in _FAMILIES:
        keys = None
        for scan in scans:
            found = set(scan.collectives.get(family, {}))
            keys = found if keys is None else keys & found
        if keys:
            return family, sorted(keys)
    return None, []


def align(scans: Sequence[TraceScan]) -> Alignment:
    """Each trace placed by its base (every scan has one); hosts other than the first rank's shifted onto
    its clock."""
    base = min(scan.base_ns for scan in scans)
    shift = {scan.rank: (scan.base_ns - base) / _NS_PER_US for scan in scans}
    hosts: Dict[Optional[str], TraceScan] = {}
    for scan in sorted(scans, key=lambda scan: scan.rank):
        hosts.setdefault(scan.host, scan)  # each host's lowest rank speaks for its clock
    alignment = Alignment(base, shift, {})
    if len(hosts) < 2:
        return alignment
    if None in hosts:
        alignment.note = "some traces do not name their host; their clocks are kept as recorded"
    named = {host: scan for host, scan in hosts.items() if host is not None}
    family, keys = _common(list(named.values()))
    if family is None:
        alignment.note = ("no collective was recorded by every host's traces; hosts' clocks are kept as recorded "
                          "(their bases applied)")
        return alignment
    reference = next(iter(named.values()))
    at = lambda scan, key: scan.collectives[family][key] + shift[scan.rank]  # noqa: E731
    last = max(keys, key=lambda key: at(reference, key))
    alignment.family, alignment.collective = family, last
    for host, speaker in named.items():
        offset = at(reference, last) - at(speaker, last)
        alignment.host_offset_us[host] = offset
        alignment.residual_us[host] = median(abs(at(reference, key) - at(speaker, key) - offset) for key in keys)
        for scan in scans:
            if scan.host == host:
                shift[scan.rank] += offset
    return alignment


def _metadata(rank: int, host: Optional[str], threads: Mapping[Tuple[Any, Any], int],
              names: Mapping[Tuple[Any, Any], str]) -> List[Dict[str, Any]]:
    """The process of a rank, named ``rank r (host)``, and its threads in their original order."""
    label = f"rank {rank} ({host})" if host else f"rank {rank}"
    events = [{"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": label}},
              {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}]
    for key, tid in threads.items():
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": names[key]}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}})
    return events


def _write_rank(out: IO[bytes], scan: TraceScan, shift_us: float, link_offset: int, first: bool) -> int:
    """Pass two for one trace: every event on the common clock, in its rank's process; returns events written."""
    # The profiled process's main thread first, then its other threads, then devices and torch's own rows.
    order = sorted(scan.threads, key=lambda key: (key[0] != scan.main_pid, key[1] != scan.main_pid))
    threads = {key: tid for tid, key in enumerate(order, 1)}
    written = 0
    separator = b"\n" if first else b",\n"
    for event in _metadata(scan.rank, scan.host, threads, scan.threads):
        out.write(separator + orjson.dumps(event))
        separator = b",\n"
    try:
        for kind, event in iter_trace(scan.path):
            if kind != "event" or event.get("ph") == "M":
                continue
            event["tid"] = threads.get((event.get("pid"), event.get("tid")), 0)
            event["pid"] = scan.rank
            if "ts" in event:
                event["ts"] = float(event["ts"]) + shift_us
            for key in _LINK_FIELDS:
                if isinstance(event.get(key), int) and not isinstance(event[key], bool):
                    event[key] += link_offset
            out.write(b",\n" + orjson.dumps(event))
            written += 1
    except TraceFormatError:
        pass  # scanned already: the events before the end are in
    return written


def write_timeline(scans: Sequence[TraceScan], alignment: Alignment, out: IO[bytes]) -> int:
    """The merged trace (Chrome JSON: ``traceEvents`` with one process per rank) into ``out``; events written."""
    out.write(b'{"traceEvents": [')
    written, link_offset, first = 0, 0, True
    for scan in sorted(scans, key=lambda scan: scan.rank):
        written += _write_rank(out, scan, alignment.shift_us[scan.rank], link_offset, first)
        link_offset += scan.largest_link + 1
        first = False
    summary = {"ranks": {scan.rank: {"host": scan.host, "file": scan.path.name, "events": scan.events,
                                     "shift_us": alignment.shift_us[scan.rank], "complete": scan.error is None}
                         for scan in scans},
               "hosts_aligned_on": None if alignment.collective is None else {
                   "family": alignment.family, "name": alignment.collective[0],
                   "occurrence": alignment.collective[1], "host_offset_us": alignment.host_offset_us,
                   "residual_us": alignment.residual_us}, "note": alignment.note}
    out.write(b'\n], "displayTimeUnit": "ms", "baseTimeNanoseconds": ' + str(alignment.base_ns).encode()
              + b', "ds_profutils": {"timeline": ' + orjson.dumps(summary, option=orjson.OPT_NON_STR_KEYS) + b"}}\n")
    return written
