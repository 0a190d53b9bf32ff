"""A snapshot of the allocator's history where memory runs out, and at the steps asked for.

torch's CUDA caching allocator can record every allocation and free with its Python stack, in a ring
of at most ``max_entries`` entries (``torch.cuda.memory._record_memory_history``), and write it out
(``_dump_snapshot``) as a pickle that PyTorch's memory visualizer reads
(https://pytorch.org/memory_viz, or ``python -m torch.cuda._memory_viz trace_plot FILE -o FILE.html``).
:class:`MemorySnapshots` switches the history on when ``attach`` applies the ``memory_snapshot``
section, and writes ``memory_snapshot_rank_{r}_step_{N}.pickle`` when global step N of an engine ends
(``at_steps``) and ``memory_snapshot_rank_{r}.pickle`` when an out-of-memory error passes through the
engine's forward, backward, step or own work (a save; ``on_oom``); the error then goes on unchanged.

The allocator history is one per process, whatever the number of engines.  Accelerators other than
CUDA keep none: there the section does nothing, and the start says so in one line.
:class:`StepSnapshots` is what the engine's hooks tell (its steps and errors).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Protocol

from ..config import MemorySnapshotConfig
from ..logging import logger, warning_once
from ..outputs import ProcessIdentity, atomic_path, memory_snapshot_file
from .hooks import Listener

__all__ = ["AllocatorHistory", "MemorySnapshots", "StepSnapshots", "cuda_allocator_history", "is_out_of_memory"]


class AllocatorHistory(Protocol):
    """Where an allocator's history is switched on and written (CUDA's, or a test's stand-in)."""

    def start(self, max_entries: int) -> None:
        ...

    def dump(self, path: Path) -> None:
        ...

    def stop(self) -> None:
        ...


class _CudaAllocatorHistory:
    """torch's CUDA caching allocator history, with Python stacks."""

    def start(self, max_entries: int) -> None:
        import torch

        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                                 max_entries=max_entries)

    def dump(self, path: Path) -> None:
        import torch

        torch.cuda.memory._dump_snapshot(str(path))

    def stop(self) -> None:
        import torch

        torch.cuda.memory._record_memory_history(enabled=None)


def cuda_allocator_history(accelerator: Any) -> Optional[AllocatorHistory]:
    """The allocator history of ``accelerator``, or None (after one line saying so) where it keeps none."""
    name = accelerator.device_name()
    if name == "cuda":
        return _CudaAllocatorHistory()
    warning_once(f"memory_snapshot: the {name!r} accelerator keeps no allocator history (CUDA's does); "
                 "no memory snapshot is written")
    return None


def is_out_of_memory(exc: BaseException) -> bool:
    """An accelerator's out-of-memory error (torch's type, or the message other allocators raise)."""
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or (isinstance(exc, RuntimeError) and "out of memory" in str(exc))


class MemorySnapshots:
    """The allocator history of this process while an engine with the section is attached.

    Several engines share the process's history: the first one attached starts it, the last one
    closed stops it (the recording costs the allocator a little on every allocation).
    """

    _users = 0

    def __init__(self, settings: MemorySnapshotConfig, identity: ProcessIdentity, history: AllocatorHistory) -> None:
        self.settings = settings
        self.identity = identity
        self._history = history
        self._closed = False
        if MemorySnapshots._users == 0:
            history.start(settings.max_entries)
        MemorySnapshots._users += 1

    def step_ended(self, global_step: int) -> None:
        """Global step ``global_step`` finished: write the history if it is one of ``at_steps``."""
        if global_step in self.settings.at_steps:
            self._write(memory_snapshot_file(self.settings.output_dir, self.identity.rank, global_step))

    def failed(self, exc: BaseException) -> None:
        """An error passes through the engine: write the history if it is an out-of-memory error."""
        if self.settings.on_oom and is_out_of_memory(exc):
            self._write(memory_snapshot_file(self.settings.output_dir, self.identity.rank))

    def _write(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(path, self.identity) as temporary:
                self._history.dump(temporary)
        except Exception as exc:  # the snapshot is worth less than the job (or than the error in flight)
            logger.error("memory_snapshot: %s was not written (%s: %s)", path, type(exc).__name__, exc)
            return
        logger.warning("memory_snapshot: wrote %s (open it at https://pytorch.org/memory_viz)", path)

    def close(self) -> None:
        """This engine no longer needs the history; the last one stops it."""
        if self._closed:
            return
        self._closed = True
        MemorySnapshots._users -= 1
        if MemorySnapshots._users == 0:
            try:
                self._history.stop()
            except Exception as exc:
                logger.error("memory_snapshot: stopping the allocator history failed (%s)", exc)


class StepSnapshots(Listener):
    """The memory snapshots as the engine's steps and errors reach them."""

    def __init__(self, snapshots: MemorySnapshots) -> None:
        self.snapshots = snapshots

    def optimizer_step_ended(self, global_step: int) -> None:
        self.snapshots.step_ended(global_step)

    def failed(self, exc: BaseException) -> None:
        self.snapshots.failed(exc)

    def stop_after_error(self, exc: Exception) -> None:
        logger.error("memory_snapshot: stopped after an error (%s: %s); training goes on", type(exc).__name__, exc)
        self.snapshots.close()  # the allocator's history (a stack per allocation) must not run on unread
