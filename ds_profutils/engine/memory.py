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

The peak statistics are the accelerator's, shared with whoever else reads them: while memory figures
are on, ``max_memory_allocated()`` read by other code gives the peak since the last phase boundary
(``"memory": false`` in the section leaves them alone).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional

import psutil

__all__ = ["PHASES", "StepMemory"]

PHASES = ("forward", "backward", "step")


class _StatmRss:
    """The process's RSS from ``/proc/self/statm``, read through one descriptor kept open for the process.

    What psutil reads (``memory_info().rss`` is statm's second field, in pages), without opening the file
    each time: profiled on a ZeRO-3 step, the five reads a recorded step makes cost 60-200 us each
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


def _rss_reader() -> Callable[[], int]:
    """The cheapest RSS read this system has (one per process): statm where there is one, else psutil's."""
    global _rss
    if _rss is None:
        try:
            _rss = _StatmRss()
        except (AttributeError, OSError, IndexError, ValueError):  # no /proc (macOS), no os.pread (Windows)
            process = psutil.Process()
            _rss = lambda: process.memory_info().rss  # noqa: E731
    return _rss


class StepMemory:
    """The peaks of one step's phases; ``record()`` is what goes into the step's record."""

    def __init__(self, accelerator: Any) -> None:
        self._accelerator = accelerator
        self.source = "rss" if accelerator.device_name() == "cpu" else "allocator"
        self._rss = _rss_reader() if self.source == "rss" else None
        self._phases: Dict[str, tuple] = {}
        self._open: Optional[str] = None
        self._start_rss = 0

    def begin(self, phase: str) -> None:
        """``phase`` starts now (ending the one open, if any)."""
        end_rss = self._end()
        if self._rss is None:
            self._accelerator.reset_peak_memory_stats()
        else:
            self._start_rss = end_rss if end_rss is not None else self._rss()
        self._open = phase

    def end(self) -> None:
        """The open phase ends now."""
        self._end()

    def _end(self) -> Optional[int]:
        """End the open phase; on RSS, the RSS read at its end (where a phase begun at once starts)."""
        phase, self._open = self._open, None
        if phase is None:
            return None
        if self._rss is None:
            accelerator = self._accelerator
            self._phases[phase] = (accelerator.max_memory_allocated(), accelerator.max_memory_reserved())
            return None
        rss = self._rss()
        peak = max(self._start_rss, rss)
        self._phases[phase] = (peak, peak)  # DeepSpeed's CPU accelerator: reserved is RSS too
        return rss

    def record(self) -> Optional[Dict[str, Any]]:
        """The step's ``memory`` entry (None if no phase was measured), and a fresh start for the next step."""
        self.end()
        phases, self._phases = self._phases, {}
        if not phases:
            return None
        return {
            "source": self.source,
            "peak_allocated_bytes": max(allocated for allocated, _ in phases.values()),
            "peak_reserved_bytes": max(reserved for _, reserved in phases.values()),
            "phases": {phase: phases[phase][0] for phase in PHASES if phase in phases},
        }
