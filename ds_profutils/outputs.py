"""Who this process is in the job, and the name of every file it writes.

Per-rank files are named by the GLOBAL rank, which is unique across hosts; the host goes inside the
files (trace metadata, each record).  Temporary and probe files also carry host, rank and pid: ranks
on several hosts (or containers) may share one output directory, and pids repeat across them.

Identity is read when a file is first named, not at import or decoration: under mpirun or SLURM,
torch.distributed is initialised later than a decorator is applied, and a rank that read its
identity too early would believe it is rank 0 of 1.  Sources, first found wins:
torch.distributed once initialised, then the variables of the launchers in ``LAUNCHER_VARIABLES``.

Nothing here imports torch, so the report can use the names: torch.distributed is asked only if the
program imported it (a module never imported cannot have been initialised).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

__all__ = [
    "BETWEEN_STEPS",
    "ENGINE_NAME",
    "HANG_SCHEMA",
    "LAUNCHER_VARIABLES",
    "MAIN_ENGINE",
    "ProcessIdentity",
    "STEP_RANGE_PREFIX",
    "atomic_path",
    "cycle_dir",
    "cycle_trace_file",
    "fetch_records_file",
    "fetch_records_files",
    "hang_file",
    "hang_files",
    "last_record",
    "memory_snapshot_file",
    "probe_writable",
    "process_identity",
    "summary_file",
    "trace_file",
    "trace_files",
]

LAUNCHER_VARIABLES: Tuple[Tuple[str, Optional[str], Optional[str]], ...] = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),  # torchrun, the deepspeed launcher
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),  # Open MPI
    ("PMIX_RANK", None, None),  # PMIx (its size has no standard variable)
    ("PMI_RANK", "PMI_SIZE", None),  # MPICH, Intel MPI
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),  # srun
)
"""(rank, world size, local rank) variables per launcher, in the order they are looked at."""

STEP_RANGE_PREFIX = "ProfilerStep#"
"""Each profiled step is a range ``ProfilerStep#N`` in a trace (torch's own name for it)."""

MAIN_ENGINE = "main"
"""The name of the first engine attached without a name; its records keep the plain file name."""
ENGINE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*")
"""Engine names: no underscore, so ``zero_fetch_{engine}_rank_{r}`` parses back unambiguously."""

_TRACE = "trace_rank_{rank}.json"
_SUMMARY = "summary_rank_{rank}.txt"
_FETCH_RECORDS = "zero_fetch_rank_{rank}.jsonl"
_ENGINE_FETCH_RECORDS = "zero_fetch_{engine}_rank_{rank}.jsonl"
_HANG = "hang_rank_{rank}.json"
_HANG_PATTERN = re.compile(r"hang_rank_(\d+)\.json")
HANG_SCHEMA = 1
"""The format of ``hang_rank_{r}.json`` (docs/hangs.md), written by the engine's hang watchdog, read by the
report: shared here so that neither imports the other."""
BETWEEN_STEPS = "between steps"
"""An engine's phase outside its forward, backward and step (the engine hooks keep it, hang files say it)."""
_TRACE_PATTERN = re.compile(r"trace_rank_(\d+)\.json(?:\.gz)?")  # a capture's may be gzip (trace_capture.gzip)
CAPTURE_REQUEST = "capture_request.json"
"""The request ``ds-profutils capture`` writes into a job's output_dir; rank 0 renames it when it takes it."""
CAPTURE_REFUSED = "capture_request.refused.json"
"""Where rank 0 says why it did not meet a request (``{"id", "reason", "written_at"}``)."""
CAPTURE_MANIFEST = "manifest.json"
"""What rank 0 writes into each ``capture_{S}/`` folder (docs/capture.md)."""
CAPTURE_DIR_PATTERN = re.compile(r"capture_(?:([A-Za-z0-9][A-Za-z0-9-]*)_)?(\d+)")
_FETCH_RECORDS_PATTERN = re.compile(r"zero_fetch_(?:([A-Za-z0-9][A-Za-z0-9-]*)_)?rank_(\d+)\.jsonl")


@dataclass(frozen=True)
class ProcessIdentity:
    """This process's place in the job; ``source`` says where the rank was read."""

    rank: int
    world_size: int
    local_rank: int
    host: str
    pid: int
    source: str

    @property
    def tag(self) -> str:
        """``host.rank.pid``: unique among every process writing into a shared directory."""
        return f"{self.host}.{self.rank}.{self.pid}"


def _initialised_process_group() -> Optional[object]:
    """torch.distributed, if the program imported it and initialised a default group."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None


def _integer(name: Optional[str]) -> Optional[int]:
    value = os.environ.get(name) if name else None
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def process_identity() -> ProcessIdentity:
    """Rank, world size, local rank, host and pid of this process, read now (see the module doc).

    Without torch.distributed: the rank of the first launcher in ``LAUNCHER_VARIABLES`` that set one
    (0 if none did); the world size and local rank of that launcher, else the first any launcher set,
    else the least world that holds the rank, and local rank 0.
    """
    host, pid = socket.gethostname(), os.getpid()
    family = next((names for names in LAUNCHER_VARIABLES if _integer(names[0]) is not None), None)
    preferred = [family] if family else []
    size = _first_set([names[1] for names in preferred + list(LAUNCHER_VARIABLES)])
    local = _first_set([names[2] for names in preferred + list(LAUNCHER_VARIABLES)])
    dist = _initialised_process_group()
    if dist is not None:
        return ProcessIdentity(dist.get_rank(), dist.get_world_size(), local or 0, host, pid, "torch.distributed")
    rank = _integer(family[0]) if family else 0
    source = family[0] if family else "default (no launcher variables)"
    return ProcessIdentity(rank, size if size is not None else rank + 1, local or 0, host, pid, source)


def _first_set(names: "list[Optional[str]]") -> Optional[int]:
    return next((value for name in names if (value := _integer(name)) is not None), None)


# ---- file names ------------------------------------------------------------------------------------


def trace_file(output_dir: os.PathLike | str, rank: int) -> Path:
    """The run's Chrome/Perfetto trace of one rank (every recorded cycle)."""
    return Path(output_dir) / _TRACE.format(rank=rank)


def cycle_dir(output_dir: os.PathLike | str, rank: int) -> Path:
    """One rank's per-cycle traces, as TensorBoard's profiler plugin reads them (worker ``rank_{r}``)."""
    return Path(output_dir) / f"rank_{rank}"


def cycle_trace_file(output_dir: os.PathLike | str, rank: int) -> Path:
    """A fresh name for one cycle's trace: a nanosecond stamp, so cycles and runs never clash."""
    return cycle_dir(output_dir, rank) / f"rank_{rank}.{time.time_ns()}.pt.trace.json"


def capture_dir(output_dir: os.PathLike | str, engine: str, first_step: int) -> Path:
    """One capture's folder: ``capture_{S}`` for the main engine, ``capture_{engine}_{S}`` for another."""
    name = f"capture_{first_step}" if engine == MAIN_ENGINE else f"capture_{engine}_{first_step}"
    return Path(output_dir) / name


def capture_trace_file(folder: os.PathLike | str, rank: int, gzip: bool) -> Path:
    """One rank's trace in a capture folder (``.json.gz`` with ``trace_capture.gzip``)."""
    return Path(folder) / (_TRACE.format(rank=rank) + (".gz" if gzip else ""))


def summary_file(output_dir: os.PathLike | str, rank: int) -> Path:
    """The operator summary of one rank."""
    return Path(output_dir) / _SUMMARY.format(rank=rank)


def fetch_records_file(output_dir: os.PathLike | str, rank: int | str, engine: str = MAIN_ENGINE) -> Path:
    """One engine's ZeRO-3 fetch records on one rank (or a placeholder such as ``"<r>"`` for messages)."""
    name = _FETCH_RECORDS if engine == MAIN_ENGINE else _ENGINE_FETCH_RECORDS
    return Path(output_dir) / name.format(engine=engine, rank=rank)


def hang_file(output_dir: os.PathLike | str, rank: int) -> Path:
    """What one rank writes when no optimizer step has ended for ``step_metrics.hang_timeout_s``."""
    return Path(output_dir) / _HANG.format(rank=rank)


def hang_files(directory: Path) -> Dict[int, Path]:
    """``{rank: path}`` of the hang files in ``directory``."""
    return _rank_files(directory, _HANG_PATTERN)


def memory_snapshot_file(output_dir: os.PathLike | str, rank: int, global_step: Optional[int] = None) -> Path:
    """The allocator history of one rank: written where memory ran out, or (``global_step``) after that step."""
    suffix = "" if global_step is None else f"_step_{global_step}"
    return Path(output_dir) / f"memory_snapshot_rank_{rank}{suffix}.pickle"


def trace_files(directory: Path) -> Dict[int, Path]:
    """``{rank: path}`` of the run traces in ``directory``."""
    return _rank_files(directory, _TRACE_PATTERN)


def _rank_files(directory: Path, pattern: "re.Pattern[str]") -> Dict[int, Path]:
    """``{rank: path}`` of the files in ``directory`` whose name ``pattern`` matches (its group 1: the rank)."""
    matches = ((pattern.fullmatch(path.name), path) for path in directory.iterdir())
    return dict(sorted((int(match.group(1)), path) for match, path in matches if match))


def fetch_records_files(directory: Path) -> Dict[str, Dict[int, Path]]:
    """``{engine: {rank: path}}`` of the fetch records in ``directory``."""
    found: Dict[str, Dict[int, Path]] = {}
    for path in directory.iterdir():
        match = _FETCH_RECORDS_PATTERN.fullmatch(path.name)
        if match:
            found.setdefault(match.group(1) or MAIN_ENGINE, {})[int(match.group(2))] = path
    return {engine: dict(sorted(ranks.items())) for engine, ranks in sorted(found.items())}


# ---- writing ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def atomic_path(destination: Path, identity: Optional[ProcessIdentity] = None) -> Iterator[Path]:
    """Yield a temporary path beside ``destination``; rename it onto ``destination`` if the block succeeds.

    A reader (TensorBoard polling the directory, a job killed mid-write) never sees half a file.  On
    failure the temporary file is removed and the destination is left as it was.
    """
    tag = (identity or process_identity()).tag
    temporary = destination.with_name(f".{destination.name}.{tag}.tmp")
    try:
        yield temporary
        os.replace(temporary, destination)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)


def probe_writable(directory: Path, identity: Optional[ProcessIdentity] = None) -> None:
    """Create ``directory`` and write a probe file in it, so a bad output directory fails before training.

    Raises OSError with the reason.
    """
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".write_probe.{(identity or process_identity()).tag}"
    probe.write_bytes(b"")
    probe.unlink()


def last_record(path: Path) -> Optional[dict]:
    """The last whole record of ``path`` (None for no file, or none readable in its last 64 KiB)."""
    try:
        with open(path, "rb") as file:
            file.seek(0, os.SEEK_END)
            file.seek(max(file.tell() - (1 << 16), 0))
            lines = file.read().split(b"\n")
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # empty, cut at the chunk's start, or a kill's half line
        if isinstance(record, dict):
            return record
    return None
