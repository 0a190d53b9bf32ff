"""``ds-profutils timeline DIR -o FILE.json``: what it prints (the merge itself is :mod:`.merge`).

stdout says what was written and how the clocks were aligned; stderr names the traces that end early
(their events up to there are merged) or cannot be placed on a clock (left out).
"""
from __future__ import annotations

import argparse
import os
import sys

from ..outputs import atomic_path, trace_files
from ..report.run_files import directory_problem, earlier_run, newest_world_size
from .merge import align, scan_trace, write_timeline

__all__ = ["run"]


def _error(message: str) -> None:
    print(f"ds-profutils timeline: {message}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Merge the traces in ``args.directory`` into ``args.output``; 1 when there is nothing to merge."""
    directory = args.directory
    problem = directory_problem(directory)
    if problem is not None:
        _error(problem)
        return 1
    traces = trace_files(directory)
    if any(os.path.exists(args.output) and os.path.samefile(args.output, path) for path in traces.values()):
        _error(f"{args.output} is one of the traces it merges; name another file with -o")
        return 1
    scans = [scan_trace(path, rank) for rank, path in traces.items()]
    world = newest_world_size((scan.path, (scan.base_ns or 0) / 1e9, scan.world_size) for scan in scans)
    for scan in [scan for scan in scans if earlier_run(scan.world_size, world)]:
        scans.remove(scan)
        _error(f"rank {scan.rank}: {scan.path.name}: {earlier_run(scan.world_size, world)}")
    for scan in scans:
        if scan.error is not None:
            _error(f"rank {scan.rank}: {scan.path.name} ends early ({scan.error}); its events up to there are merged")
        if scan.base_ns is None:
            _error(f"rank {scan.rank}: {scan.path.name} has no baseTimeNanoseconds before its end, so it cannot "
                   "be placed on the common clock; left out")
    placed = [scan for scan in scans if scan.base_ns is not None]
    if not placed:
        _error(f"{directory}: no trace to merge (trace_rank_*.json with a baseTimeNanoseconds)")
        return 1
    alignment = align(placed)
    try:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(args.output) as temporary, open(temporary, "wb") as out:
            events = write_timeline(placed, alignment, out)
    except OSError as exc:
        _error(f"cannot write {args.output}: {exc.strerror}")
        return 1
    print(f"{args.output}: {events:,} events of {len(placed)} ranks, one process per rank "
          f"({os.path.getsize(args.output) / 2**20:,.1f} MB); open it in https://ui.perfetto.dev")
    if alignment.collective is not None:
        name, occurrence = alignment.collective
        print(f"hosts aligned on the end of {name} #{occurrence} ({alignment.family}), the last collective every "
              "host recorded; ranks of one host keep their clock:")
        for host, offset in alignment.host_offset_us.items():
            print(f"  {host}: shifted {offset / 1000:+.3f} ms; other common collectives then end "
                  f"{alignment.residual_us[host] / 1000:.3f} ms apart (median)")
    elif alignment.note:
        print(alignment.note)
    return 0
