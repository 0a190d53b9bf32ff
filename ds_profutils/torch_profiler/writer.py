"""Everything one profiled run writes on one rank, written as each cycle ends, and what it says at the end.

When a cycle ends (the window is over, or the run ends inside it, however it ends) its trace is
exported to ``rank_{r}/``, its events are spliced into ``trace_rank_{r}.json``
(:class:`~.export.RunTrace`: only the new cycle's bytes are written), and the operator summary takes
in the cycle's events.  So a job killed later loses nothing already recorded, and the cycle in flight
is all an interruption has to write.  Building the summary from a large window takes seconds: on
interruption it is skipped, with a line saying so.

Restarts follow the records' rule.  A later run writing to the same directory continues its files
when both name their steps by an engine's global step: in the same process (a resumed
``trainer.train()``), or in a new process whose first step is above 0 (a job restarted from its
checkpoint), which takes up the earlier process's cycles from their own files in ``rank_{r}/`` (their
metadata says their steps).  Where the new run repeats global steps (its checkpoint is older than the
last step recorded), the latest wins: the cycles holding a step from the new run's first on are left
out of the run trace (their own files stay; the operator summary keeps what it took in).  Otherwise
(steps counted per call, a run starting from step 0, the run trace gone) the files start afresh.

A file that cannot be written is named in one ERROR line with the cause, whatever the exception (a
full disk, a failing export), and training goes on.  No signal handler runs while the files are
written (:mod:`.signals` holds them), so no exception of a program's handler is taken for a write's.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

from ..config import ProfilerConfig
from ..logging import log_dist, logger
from ..outputs import ProcessIdentity, atomic_path, cycle_dir, summary_file, trace_file
from .export import RunTrace, read_layout, rename_trace_events
from .summary import OperatorSummary

__all__ = ["RunWriter", "export_trace", "show_comms_summary"]

_ALL_RANKS = [-1]  # log_dist: every rank logs
_writers: Dict[Tuple[str, int], "RunWriter"] = {}  # (output_dir, rank) -> this process's last writer there


def export_trace(profile: Any, temporary: Path) -> None:
    """Export ``profile``'s trace to ``temporary`` (a cycle's, a capture's).  Kineto says a failed write (a full disk)
    on stderr only and leaves its own ``<temporary>.tmp`` and no trace: that is raised here, with the disk's state,
    and its file removed."""
    profile.export_chrome_trace(str(temporary))
    if temporary.exists():
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"{temporary}.tmp")
    full = shutil.disk_usage(temporary.parent).free == 0
    raise OSError(errno.ENOSPC if full else errno.EIO, "the trace exporter wrote no file" +
                  (f" ({os.strerror(errno.ENOSPC)})" if full else ""))


def _metadata_of(path: Path) -> Dict[str, Any]:
    """The ``ds_profutils`` metadata in a trace's head; empty where it has none or cannot be read."""
    try:
        metadata = read_layout(path).header.get("ds_profutils", {})
        metadata = json.loads(metadata) if isinstance(metadata, str) else metadata
    except (OSError, ValueError):  # not one of ours, or cut short
        return {}
    return metadata if isinstance(metadata, dict) else {}


def _cause(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _steps_text(entries: List[Dict[str, Any]]) -> str:
    ranges = [f"{first}-{last}" if first != last else f"{first}" for first, last in
              (entry["steps"] for entry in entries if entry["steps"])]
    return ", ".join(ranges) or "none"


class RunWriter:
    """The files of the runs with one set of settings on one rank: per-cycle traces, the run trace, the
    operator summary.  :meth:`of` gives the process's writer for a run."""

    @classmethod
    def of(cls, settings: ProfilerConfig, identity: ProcessIdentity, first_step: Optional[int]) -> "RunWriter":
        """The writer for a run whose first recorded step is global step ``first_step`` (None: steps counted
        per call): the one an earlier run in this process left in the same directory, if this run
        continues its files (see the module doc), else a new one."""
        key = (str(Path(settings.output_dir).resolve()), identity.rank)
        earlier = _writers.get(key)
        if (earlier is not None and first_step and earlier.last_global_step is not None
                and earlier.trace.path.exists()):
            earlier._supersede(first_step)
            return earlier
        writer = _writers[key] = cls(settings, identity)
        if earlier is None and first_step and writer.trace.path.exists():
            writer._take_up(first_step)
        return writer

    def _supersede(self, first_step: int) -> None:
        """Leave the cycles holding global step ``first_step`` or later out of the run trace (the latest
        run's steps win)."""
        dropped = {entry["trace"] for entry in self.cycles if entry["steps"] and entry["steps"][-1] >= first_step}
        if dropped:
            self.cycles = [entry for entry in self.cycles if entry["trace"] not in dropped]
            self.trace.drop(dropped)
            log_dist(f"profiler: global steps from {first_step} on are recorded again; the run trace leaves out "
                     f"the {len(dropped)} earlier cycle(s) that held them", ranks=_ALL_RANKS)

    def _take_up(self, first_step: int) -> None:
        """A new process resuming at global step ``first_step``: the earlier processes' cycles of earlier
        global steps, from their own files (newest last), go on in the run trace -- those of the run that
        trace holds (its ``run_id``; a job started afresh in the same directory left others there)."""
        self.run_id = _metadata_of(self.trace.path).get("run_id") or self.run_id
        found = []
        for path in sorted(cycle_dir(self.settings.output_dir, self.identity.rank).glob("*.pt.trace.json")):
            metadata = _metadata_of(path)
            if metadata.get("run_id", self.run_id) != self.run_id:
                continue  # another job's, before this run started the files afresh
            for entry in metadata.get("cycles", []):
                if metadata.get("step_numbering") == "global" and entry.get("steps"):
                    found.append({**entry, "trace": str(path)})
        kept = [entry for entry in found if entry["steps"][-1] < first_step]
        if kept:
            self.cycles = kept
            self.trace.cycles = [Path(entry["trace"]) for entry in kept]
            self.last_global_step = kept[-1]["steps"][-1]

    def __init__(self, settings: ProfilerConfig, identity: ProcessIdentity) -> None:
        self.settings = settings
        self.identity = identity
        self.trace = RunTrace(trace_file(settings.output_dir, identity.rank), identity)
        self.summary: Optional[OperatorSummary] = None
        if settings.summary_ranks is None or identity.rank in settings.summary_ranks:
            self.summary = OperatorSummary(settings.summary_sort_by, settings.summary_row_limit)
        self.summary_path: Optional[Path] = None
        self.cycles: List[Dict[str, Any]] = []  # every cycle whose own trace was written
        self._unmerged: List[Path] = []  # cycle traces written, not yet in the run trace (a failed splice)
        self.failed: List[Path] = []
        self.last_global_step: Optional[int] = None  # of the last cycle written; None: none, or steps per call
        self.run_id = uuid.uuid4().hex[:12]  # in every file's metadata: a restart goes on with this run's cycles

    @contextlib.contextmanager
    def _written(self, path: Path) -> Iterator[None]:
        """Log a failure to write ``path`` as one ERROR line; re-raise what is not an Exception."""
        try:
            yield
        except BaseException as exc:
            self.failed.append(path)
            logger.error("profiler: %s was not written (%s); training goes on", path, _cause(exc))
            logger.debug("profiler: the failed write of %s", path, exc_info=True)
            if not isinstance(exc, Exception):
                raise

    def save_cycle(self, profile: Any, path: Path, entry: Dict[str, Any], renames: Mapping[str, str],
                   interrupted: bool, metadata: Mapping[str, Any]) -> None:
        """Write a stopped cycle's trace to ``path``, then the run trace and the summary.

        ``renames`` maps event names as recorded to their names in the files (the tail range of a call
        that returned inside the window); ``entry`` describes the cycle in its own file's ``ds_profutils``
        metadata, ``metadata`` the run (the run trace's).
        """
        written = False
        with self._written(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(path, self.identity) as temporary:
                export_trace(profile, temporary)
                if renames:
                    try:
                        rename_trace_events(temporary, renames, self.identity)
                    except Exception as exc:  # the trace is whole, the tail keeps its step name
                        logger.error("profiler: %s keeps its step names as recorded (%s)", path, _cause(exc))
            written = True
        if written:
            self.cycles.append(entry)
            if entry["steps"]:
                global_numbers = metadata.get("step_numbering") == "global"
                self.last_global_step = entry["steps"][-1] if global_numbers else None
            self._unmerged.append(path)
            with self._written(self.trace.path):
                self.trace.add(self._unmerged, metadata)
                self._unmerged = []
        if self.summary is None:
            return
        if interrupted:
            logger.warning("profiler: the operator summary leaves out cycle %d: the run was interrupted, and "
                           "building it takes seconds a stopping job may not have", entry["cycle"])
            return
        path = summary_file(self.settings.output_dir, self.identity.rank)
        with self._written(path):
            self.summary.add_cycle(profile, renames)
            with atomic_path(path, self.identity) as temporary:
                temporary.write_text(self.summary.table(self.settings.peak_tflops) or "")
            self.summary_path = path

    def finish(self) -> None:
        """Say where the files went: a log line on every rank, and on the reporting rank a printout."""
        if not self.cycles:  # nothing recorded (run.py says so), or every export failed (each was logged)
            return
        output_dir, rank = self.settings.output_dir, self.identity.rank
        log_dist(f"profiler: {len(self.cycles)} cycle(s) recorded; run trace {self.trace.path}, per-cycle traces in "
                 f"{cycle_dir(output_dir, rank)}/ (open with TensorBoard or https://ui.perfetto.dev)", ranks=_ALL_RANKS)
        if rank != self.settings.reporting_rank:
            return
        try:
            print(self._printout(), flush=True)
        except Exception:  # stdout closed or a broken pipe: the files and the log line remain
            logger.debug("profiler: the end-of-run printout failed", exc_info=True)

    def _printout(self) -> str:
        output_dir, rank = self.settings.output_dir, self.identity.rank
        ranks = self.settings.ranks
        lines = [f"ds_profutils profiler: rank {rank} recorded steps {_steps_text(self.cycles)} "
                 f"({len(self.cycles)} cycle(s))"]
        if self.trace.cycles:
            lines.append(f"  run trace         {self.trace.path}   (open at https://ui.perfetto.dev)")
        lines.append(f"  per-cycle traces  {cycle_dir(output_dir, rank)}/   (tensorboard --logdir {output_dir})")
        if self.summary_path is not None:
            lines.append(f"  operator summary  {self.summary_path}")
        lines += [f"  not written       {path} (see the ERROR line)" for path in self.failed]
        lines.append(f"  every profiled rank r ({'all ranks' if ranks is None else f'ranks {ranks}'}) writes "
                     f"trace_rank_{{r}}.json and rank_{{r}}/ in {output_dir}")
        table = self.summary.table(self.settings.peak_tflops) if self.summary is not None else None
        if table:
            lines += ["", table]
        return "\n".join(lines)


def show_comms_summary(settings: ProfilerConfig, identity: ProcessIdentity) -> None:
    """Print DeepSpeed's comms logger summary at the normal end of a run, when that logger is on.

    ``deepspeed.comm.log_summary`` has barriers, so it is called on every rank, and only when every
    rank profiles: a rank left out by ``ranks`` never reaches this point, and must never be waited for.
    """
    from deepspeed import comm as dist
    from deepspeed.comm import comm as ds_comm

    if not getattr(ds_comm.comms_logger, "enabled", False):
        return
    ranks = settings.ranks
    if ranks is not None and not set(range(identity.world_size)) <= set(ranks):
        if identity.rank == settings.reporting_rank:
            logger.warning("profiler: comms_logger summary not shown: it has barriers every rank must reach, and "
                           "profiler.ranks leaves ranks out; call deepspeed.comm.log_summary() on every rank")
        return
    try:
        if dist.is_initialized():
            dist.log_summary()
        else:
            ds_comm.comms_logger.log_all()
    except Exception:
        logger.exception("profiler: the comms_logger summary failed; training goes on")
