"""torch.profiler's step schedule, expressed as the windows it records.

torch's ``schedule(skip_first, wait, warmup, active, repeat)`` answers "what now?" for one step at a
time, which makes the profiler look at every step.  The same schedule written as a list of windows
(first warmup step, first active step, first step after) tells the profiler when the next thing
happens, so the steps in between are a counter compare and nothing else.

The semantics are torch's exactly: ``skip_first`` steps, then cycles of ``wait`` + ``warmup`` +
``active`` steps, ``repeat`` cycles (0: until the run ends).  Step numbers start at 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..exceptions import InvalidArgumentError

__all__ = ["ProfilerSchedule", "Window"]


@dataclass(frozen=True)
class Window:
    """One cycle's recording: warm up on ``[warmup_start, active_start)``, record ``[active_start, stop)``."""

    cycle: int
    warmup_start: int
    active_start: int
    stop: int


@dataclass(frozen=True)
class ProfilerSchedule:
    """The schedule of the ``"profiler"`` section, validated once when built."""

    skip_first: int = 0
    wait: int = 0
    warmup: int = 0
    active: int = 1
    repeat: int = 0

    def __post_init__(self) -> None:
        bounds = {"skip_first": 0, "wait": 0, "warmup": 0, "active": 1, "repeat": 0}
        bad = [f"{name}={getattr(self, name)!r} (need an int >= {low})" for name, low in bounds.items()
               if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int)
               or getattr(self, name) < low]
        if bad:
            raise InvalidArgumentError(f"invalid profiler schedule: {', '.join(bad)}")

    @property
    def cycle_length(self) -> int:
        return self.wait + self.warmup + self.active

    def window(self, cycle: int) -> Optional[Window]:
        """The ``cycle``-th window (from 0), or None once ``repeat`` cycles are done."""
        if self.repeat and cycle >= self.repeat:
            return None
        warmup_start = self.skip_first + cycle * self.cycle_length + self.wait
        active_start = warmup_start + self.warmup
        return Window(cycle, warmup_start, active_start, active_start + self.active)

