"""Which files of a run directory are read, and which are missing, torn, ending early, beyond the world or an
earlier run's: what the report, the diff and the timeline say about a directory before its figures.

:func:`read_all` reads every record file (in parallel processes when there is enough to read: parsing is the
bottleneck); the rest name what is left out and why, so the report summarises instead of failing.
"""
from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..outputs import fetch_records_files, trace_files
from .records import FileRecords, read_records

__all__ = ["beyond_world", "directory_problem", "earlier_run", "ending_early", "found_unreadable", "newest_world_size",
           "read_all", "trace_gaps", "where_to_look", "world_of"]

_PARALLEL_BYTES = 64 * 2**20  # below this, starting processes costs more than it saves


def directory_problem(directory: Path) -> Optional[str]:
    """Why ``directory`` cannot be a run's output_dir (None: it can): absent, or a file."""
    if directory.is_dir():
        return None
    if directory.exists():
        return f"{directory} is a file, not a directory: name the run's output_dir"
    return f"{directory}: no such directory"


def newest_world_size(files: Iterable[Tuple[Path, Optional[float], Optional[int]]]) -> Optional[int]:
    """The world size of the newest of ``(path, wall-clock seconds inside it, world size)``: this run's (an
    output_dir is often reused).  The time inside the file, not its mtime, which a copy changes."""
    newest = max(((written if written else path.stat().st_mtime, size) for path, written, size in files if size),
                 default=None)
    return None if newest is None else newest[1]


def earlier_run(world_size: Optional[int], world: Optional[int]) -> Optional[str]:
    """Why a file written with ``world_size`` ranks is left out of a run of ``world``; None if it is this run's
    (or does not say)."""
    if world_size in (None, 0, world):
        return None
    return f"left out: an earlier run's file (world size {world_size}; this run's is {world})"


def ending_early(kind: str, steps: Mapping[int, Tuple[Path, Sequence[int]]],
                  engine: Optional[str] = None) -> List[Dict[str, Any]]:
    """Ranks whose files stop before the others' (a rank killed first, a write given up at the deadline)."""
    last = {rank: (path, max(numbers)) for rank, (path, numbers) in steps.items() if numbers}
    end = max((step for _, step in last.values()), default=None)
    return [{"kind": kind, "engine": engine, "rank": rank, "file": path.name,
             "reason": f"ends at step {step}; the other ranks' go on to step {end}"}
            for rank, (path, step) in sorted(last.items()) if step < end]


def trace_gaps(found: Mapping[int, Path], traces: Mapping[int, Any], incomplete: List[Dict[str, Any]]) -> None:
    """Traces missing (the profiler's "ranks" setting, as the traces record it, says which ranks should
    have one) or ending before the others'."""
    expected = set()
    for summary in traces.values():
        if "profiled_ranks" in summary and summary["world_size"]:
            expected |= set(summary["profiled_ranks"] or range(summary["world_size"]))
    for rank in sorted(expected - set(found)):
        incomplete.append({"kind": "trace", "engine": None, "rank": rank, "file": None, "reason": "no file"})
    incomplete += ending_early("trace", {rank: (found[rank], [step["step"] for step in summary["steps"]])
                                          for rank, summary in traces.items()})


def where_to_look(directory: Path) -> str:
    """A hint for a directory with nothing to report: its subdirectories that hold outputs, if any."""
    runs = sorted(sub.name for sub in directory.iterdir()
                  if sub.is_dir() and (fetch_records_files(sub) or trace_files(sub)))
    if runs:
        return f"its subdirectories {', '.join(runs)} hold runs: name one of them"
    return ("is \"step_metrics\" (or, on ZeRO-3, \"partitioned_param_profiler\") enabled with this output_dir, and "
            "did ds_profutils.attach(engine) run?")


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


def world_of(files: Sequence[FileRecords]) -> int:
    """The run's world size: the largest recorded in a file with complete records (or its highest such rank + 1).
    Files without a record (a leftover, an empty file of a rank beyond the world) do not widen it; with no
    complete record anywhere, the highest rank + 1."""
    complete = [records for records in files if records.complete_records]
    if not complete:
        return max((records.rank for records in files), default=-1) + 1
    return max([records.world_size for records in complete] + [max(records.rank for records in complete) + 1])


def beyond_world(records: FileRecords, world: int) -> Optional[str]:
    """Why a file without a complete record of a rank outside the world is left out (None: it is not such a file)."""
    if records.complete_records or records.rank < world:
        return None
    try:
        empty = Path(records.path).stat().st_size == 0
    except OSError:
        empty = False
    return f"{'empty' if empty else 'no complete record'}, rank beyond world_size {world}: ignored"


def found_unreadable(files: Sequence[FileRecords], shown: int = 3) -> str:
    """What a directory with nothing readable holds: how many record files, none with a complete record, the first
    few named (``nothing readable`` names what it found, never ``()``)."""
    if not files:
        return "no record files"
    names = [Path(records.path).name for records in sorted(files, key=lambda records: records.rank)]
    more = f", ... {len(names) - shown:,} more" if len(names) > shown else ""
    return f"{len(files):,} record file{'' if len(files) == 1 else 's'} without a complete record ({', '.join(names[:shown])}{more})"
