"""One rank's records file, and the one behaviour for every way writing it can fail.

An output directory that cannot be created (a path under a file, a read-only mount), a file that cannot
be opened or written: on the rank concerned one line names the directory, the cause and what is already
on disk, and recording stops on that rank; training goes on, the step's figures still reach the live
metrics, the job's exit code is unchanged, no traceback.  A full disk (ENOSPC) pauses writing instead:
the records of the steps meanwhile are lost, writing resumes with the first one that fits again.  The file
holds whole lines only: a disk that fills in the middle of a record takes part of it (a short write, no
error yet), and that part is cut off again, so the next record does not start inside it; a file appended
to (a resume) that ends in such a part, left by a job that stopped before the disk had room again, has it
cut off first.

A resume into an output directory holding another job's records (a different ``model_numel``,
``world_size`` or ``job_config_hash`` in the file's last record) would append to them: that file is moved
aside to ``<name>.prev-<n>.jsonl``, which the readers' name pattern skips, and the job says so once.  The hash
leaves out what a resume of one job may change without changing its steps: the LR schedule (the Trainer
fills its length from ``max_steps``, raised to train on), logging, monitors and the profiling sections (an
earlier version hashed all of it, as ``engine_config_hash``: a key the other side lacks decides nothing).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional

from ..config import SECTIONS
from ..logging import log_dist, logger
from ..outputs import last_record

__all__ = ["JOB_KEYS", "NOT_THE_JOB", "RecordsFile", "config_hash"]

JOB_KEYS = ("model_numel", "world_size", "job_config_hash")
"""Header fields that tell one job from another (not the time: a resume starts later by design)."""


NOT_THE_JOB = ("scheduler", "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "tensorboard", "wandb",
               "csv_monitor", "comet", "comms_logger", "flops_profiler", *SECTIONS)
"""Top-level ds_config keys a resume may change without becoming another job (see the module doc)."""


def config_hash(engine: Any) -> Optional[str]:
    """A short hash of the engine's resolved ds_config (DeepSpeed's parsed dict) less :data:`NOT_THE_JOB`, None
    where it has none."""
    resolved = getattr(getattr(engine, "_config", None), "_param_dict", None)
    if not isinstance(resolved, dict):
        return None
    job = {key: value for key, value in resolved.items() if key not in NOT_THE_JOB}
    return hashlib.sha256(json.dumps(job, sort_keys=True, default=str).encode()).hexdigest()[:16]


class RecordsFile:
    """The JSONL file at ``path`` (unbuffered: one ``write`` per record).  ``what`` names the records as
    the job runs them ("step records", "step and ZeRO-3 fetch records") in its one line on failure."""

    def __init__(self, path: Path, what: str, rank: int) -> None:
        self.path = path
        self.what = what
        self.rank = rank
        self.failed = False  # recording is off on this rank
        self._file: Any = None
        self._size = 0  # the file's length: where a record cut short by a full disk is cut back to
        self._paused = False  # the disk was full at the last write

    @property
    def opened(self) -> bool:
        """Whether an open was tried (the file is open, or failed to open)."""
        return self._file is not None or self.failed

    def make_directory(self) -> None:
        """Create the output directory (at attach, so a later failure is not the first word about it)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._fail("cannot be created", exc)

    def open(self, append: bool) -> None:
        """Open for appending or start it afresh."""
        if self.failed:
            return
        try:
            self._file = open(self.path, "a+b" if append else "wb", buffering=0)  # a+: its end is read
            self._size = os.fstat(self._file.fileno()).st_size
            if append:
                self._end_on_a_whole_line()
        except OSError as exc:
            self._fail("cannot be written", exc)

    def _end_on_a_whole_line(self) -> None:
        """Cut off a record the disk had no room for the rest of (see the module doc), said once."""
        fd, whole = self._file.fileno(), self._size
        while whole and os.pread(fd, 1, whole - 1) != b"\n":
            chunk = os.pread(fd, min(whole, 1 << 16), max(whole - (1 << 16), 0))
            newline = chunk.rfind(b"\n")
            whole = whole - len(chunk) + newline + 1 if newline >= 0 else whole - len(chunk)
        if whole != self._size:
            os.ftruncate(fd, whole)
            logger.warning(f"ds_profutils: {self.path} ended in {self._size - whole} bytes of a record cut short "
                           "(a full disk); they are cut off, the records before them stay")
            self._size = whole

    def start(self, append: bool, resumed: bool, header: Mapping[str, Any]) -> Optional[Mapping[str, Any]]:
        """Open at a run's first forward: add to the file within this process (``append``) or on a resume
        (``resumed``, another job's file moved aside first), else start it afresh, saying so where it held
        records.  Returns the last record the run goes on from (None: it starts the file)."""
        if self.failed:  # its directory could not be made: said once, recording is off here
            return None
        last = last_record(self.path) if append or resumed else None
        if last is not None and not append and self.set_aside_other_job(last, header):
            last = None
        if last is None and not append and self.path.is_file() and self.path.stat().st_size > 0:
            log_dist(f"ds_profutils: {self.path} held records of an earlier run; this run starts at global step 0 "
                     "and replaces them", ranks=[-1])
        self.open(append=append or resumed)
        return last

    def set_aside_other_job(self, last: Mapping[str, Any], header: Mapping[str, Any]) -> bool:
        """Move the file aside when its ``last`` record is another job's than ``header`` says this one is (a
        key either side lacks decides nothing); True when it was moved."""
        differing = [f"{key} {last[key]} -> {header[key]}" for key in JOB_KEYS
                     if last.get(key) is not None and header.get(key) is not None and last[key] != header[key]]
        if not differing:
            return False
        number = 1
        while (aside := self.path.with_name(f"{self.path.stem}.prev-{number}.jsonl")).exists():
            number += 1
        try:
            self.path.rename(aside)
        except OSError as exc:
            self._fail("cannot be written", exc)
            return True
        logger.warning(f"ds_profutils: {self.path} held another job's records ({', '.join(differing)}); moved to "
                       f"{aside.name} (reports skip it unless named), this run starts the file afresh")
        return True

    def write(self, line: bytes) -> None:
        if self._file is None:
            return
        try:
            written = self._file.write(line)
            if written != len(line):  # the disk filled inside the record: the next write would say ENOSPC
                fd = self._file.fileno()
                os.ftruncate(fd, self._size)
                os.lseek(fd, self._size, os.SEEK_SET)  # a file started afresh writes at its position
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                if not self._paused:
                    self._paused = True
                    logger.warning(f"ds_profutils: {self.path.parent} is full ({exc.strerror}): {self.what} of rank "
                                   f"{self.rank} paused until space returns; training goes on")
                return
            self._fail("cannot be written", exc)
            return
        self._size += written
        if self._paused:
            self._paused = False
            logger.warning(f"ds_profutils: {self.path.parent} has space again: {self.what} of rank {self.rank} go on "
                           "(the steps in between are not recorded)")

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError:  # an unbuffered file has nothing left to flush; the records written are on disk
                pass

    def _fail(self, how: str, exc: OSError) -> None:
        """The one line, then recording off on this rank."""
        self.close()
        self.failed = True
        cause = exc.strerror or str(exc)
        logger.error(f"ds_profutils: output_dir {self.path.parent} {how} ({cause}): {self.what} are off on rank "
                     f"{self.rank}, training goes on; {self.on_disk()}")

    def on_disk(self) -> str:
        """What of the records is on disk, in words (a failure's line says it)."""
        try:
            size = self.path.stat().st_size if self.path.is_file() else 0
        except OSError:
            size = 0
        if size:
            return f"{self.path} keeps the {size:,} bytes of {self.what} written before"
        return f"no {self.what} of rank {self.rank} are on disk"
