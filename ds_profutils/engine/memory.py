"""How much memory each phase of a recorded step took, from the accelerator's own peak statistics.

At a phase's start the accelerator's peak statistics are reset (``reset_peak_memory_stats``), at its
end the peaks are read (``max_memory_allocated``, ``max_memory_reserved``): a few calls into the
allocator per step, no ``gc`` and no device synchronize (DeepSpeed's ``see_memory_usage`` does both).
Phases: forward (forward start to forward end), backward (forward end to the return of
``engine.backward()``), step (``engine.step()`` itself).

DeepSpeed's CPU accelerator answers with the process's resident set size, sampled when asked: on CPU
the figures are RSS at the phase boundaries, and the records say ``"source": "rss"``.  There the RSS
is read here, once per boundary, and a phase's peak is the larger of its two ends: the figures
DeepSpeed's CPU accelerator would give, for one read of ``/proc`` instead of three (its reset and two
peaks each read RSS afresh through a new ``psutil.Process``), and its peak statistics are left alone.
A step reads three boundaries, not five: the forward's end, the backward's end and the step's end.  A
phase starts where the one before it ended: the optimizer step's start is the backward's end reading (in
the engine's use ``engine.step()`` follows ``engine.backward()`` at once), the forward's start the last
step's end reading (what the loop allocates between steps and keeps is seen at the forward's end).  The
forward reads its start afresh where that reading is not the process's latest (another engine's step
read since) or a step went unmeasured between (``log_interval``), and on the first step after attach.
Each read is a syscall of several us, more right after a collective has switched the thread out, and a
read at a phase's start tells little the reading just before it does not.

The peak statistics are the accelerator's, shared with whoever else reads them: while memory figures
are on, ``max_memory_allocated()`` read by other code gives the peak since the last phase boundary
(``"memory": false`` in the section leaves them alone).  And others reset them: DeepSpeed's
``see_memory_usage`` (``memory_breakdown: true``) resets rank 0's peaks inside forward, backward and
step, so the peak read at the phase's end holds only what came after.  Such a step's record says
``"disturbed": true``.  It is told by the accelerator's ``reset_peak_memory_stats`` itself, wrapped
on the accelerator object while the figures are taken (our own resets call the method as it was):
every DeepSpeed reset goes through ``get_accelerator().reset_peak_memory_stats()``, so none is missed
there, where a figure test (a peak below what was allocated at the phase start) misses every reset
made after memory first grew.  A reset through ``torch.cuda`` directly is not seen.

On CUDA a boundary reads the statistics once, as torch keeps them (``memory_stats_as_nested_dict()``):
``max_memory_allocated()`` and ``max_memory_reserved()`` each build the whole dictionary and flatten it
in Python (about 160 calls a read), ``memory_stats()`` once.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Tuple

import psutil
import torch
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

__all__ = ["StepMemory", "rss_reader"]

_ABSENT = object()


class _StatmRss:
    """The process's RSS from ``/proc/self/statm``, read through one descriptor kept open for the process.

    What psutil reads (``memory_info().rss`` is statm's second field, in pages), without opening the file
    each time: profiled on a ZeRO-3 step, each read of a recorded step cost 60-200 us
    through psutil (an ``open`` of a ``/proc`` file is slow on virtual machines) and 6-9 us here.
    /proc/self is resolved when opened, so a forked child opens its own.
    """

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._fd = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
        self()  # fails here, not on a step, where statm reads differently
        os.register_at_fork(after_in_child=self._reopen)

    def _reopen(self) -> None:
        os.close(self._fd)
        self._fd = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)

    def __call__(self) -> int:
        return int(os.pread(self._fd, 128, 0).split()[1]) * self._page


_rss: Optional[Callable[[], int]] = None
_latest_reader: Optional[int] = None  # id() of the StepMemory whose RSS reading is the process's latest


def rss_reader() -> Callable[[], int]:
    """The cheapest RSS read this system has (one per process): statm where there is one, else psutil's."""
    global _rss
    if _rss is None:
        try:
            _rss = _StatmRss()
        except (AttributeError, OSError, IndexError, ValueError):  # no /proc (macOS), no os.pread (Windows)
            process = psutil.Process()
            _rss = lambda: process.memory_info().rss  # noqa: E731
    return _rss


def _cuda_peaks() -> Tuple[int, int]:
    """The current CUDA device's allocated and reserved peaks (0 before its allocator has run)."""
    stats = torch.cuda.memory_stats_as_nested_dict()
    return stats.get("allocated_bytes", _NONE)["all"]["peak"], stats.get("reserved_bytes", _NONE)["all"]["peak"]


_NONE = {"all": {"peak": 0}}


class StepMemory:
    """The peaks of one step's phases; ``record()`` is what goes into the step's record."""

    def __init__(self, accelerator: Any) -> None:
        self._accelerator = accelerator
        # RSS where the peaks are DeepSpeed's CPU accelerator's (a subclass keeping an allocator has its own)
        rss = getattr(type(accelerator), "max_memory_allocated", None) is CPU_Accelerator.max_memory_allocated
        self.source = "rss" if rss else "allocator"
        self._rss = rss_reader() if self.source == "rss" else None
        self._allocated: Dict[str, int] = {}  # per phase measured, its allocated peak
        self._reserved_peak = -1  # the step's reserved peak so far (-1: none measured)
        self._open: Optional[str] = None
        self._start_rss = 0
        self._ended_rss: Optional[int] = None  # RSS read where the last phase ended (the next one's start)
        self._disturbed = False
        self._one_read = accelerator.device_name() == "cuda"  # one read of the allocator gives both peaks
        if self._rss is None:
            self._reset = accelerator.reset_peak_memory_stats  # ours: as it was
            self._before = vars(accelerator).get("reset_peak_memory_stats", _ABSENT)
            accelerator.reset_peak_memory_stats = self._reset_by_others

    def _reset_by_others(self, *args: Any, **kwargs: Any) -> Any:
        """The accelerator's ``reset_peak_memory_stats`` while we take figures: a reset inside a phase of
        ours marks the step's figures disturbed."""
        if self._open is not None:
            self._disturbed = True
        return self._reset(*args, **kwargs)

    def close(self) -> None:
        """Give the accelerator its ``reset_peak_memory_stats`` back (a wrapper put over ours since stays,
        and ours in it counts nothing once closed)."""
        self._open = None
        if self._rss is None and vars(self._accelerator).get("reset_peak_memory_stats") == self._reset_by_others:
            if self._before is _ABSENT:
                del self._accelerator.reset_peak_memory_stats
            else:
                self._accelerator.reset_peak_memory_stats = self._before

    def begin(self, phase: str) -> None:
        """``phase`` starts now (ending the one open, if any)."""
        end_rss = self.end() if self._open is not None else None  # (a call fewer on the step path)
        if self._rss is None:
            self._reset()
        else:
            if end_rss is None:
                end_rss = self._ended_rss if self._ended_rss is not None and _latest_reader == id(self) else \
                    self._read_rss()
            self._start_rss = end_rss
        self._open = phase

    def end(self) -> Optional[int]:
        """End the open phase (if any); on RSS, returns the RSS read at its end (where a phase begun at once starts).
        One call for the whole boundary: it runs inside the step, where each call of ours costs microseconds."""
        phase, self._open = self._open, None
        if phase is None:
            return None
        rss = None
        if self._rss is None:
            accelerator = self._accelerator
            if self._one_read:
                allocated, reserved = _cuda_peaks()
            else:
                allocated, reserved = accelerator.max_memory_allocated(), accelerator.max_memory_reserved()
        else:
            rss = self._ended_rss = self._read_rss()
            allocated = reserved = max(self._start_rss, rss)  # DeepSpeed's CPU accelerator: reserved is RSS too
        self._allocated[phase] = allocated
        if reserved > self._reserved_peak:
            self._reserved_peak = reserved
        return rss

    def forget(self) -> None:
        """A step of the engine goes unmeasured: the next phase does not start from this object's last reading."""
        self._ended_rss = None

    def _read_rss(self) -> int:
        global _latest_reader
        _latest_reader = id(self)
        return self._rss()

    def record(self) -> Optional[Dict[str, Any]]:
        """The step's ``memory`` entry (None if no phase was measured), and a fresh start for the next step."""
        self.end()
        allocated, self._allocated = self._allocated, {}
        reserved, self._reserved_peak = self._reserved_peak, -1
        disturbed, self._disturbed = self._disturbed, False
        if not allocated:
            return None
        entry = {
            "source": self.source,
            "peak_allocated_bytes": max(allocated.values()),
            "peak_reserved_bytes": reserved,
            "phases": allocated,  # in the order they ran: forward, backward, step
        }
        if disturbed:
            entry["disturbed"] = True
        return entry
