"""Collectives the frameworks issue through ``torch.distributed`` directly, timed while an engine is attached.

Not every wait of a DeepSpeed job passes through ``deepspeed.comm``: the transformers Trainer all-gathers
``num_items_in_batch`` after loading a step's batches, Accelerate's ``gather`` and ``reduce`` call
``torch.distributed`` themselves.  The ranks that loaded their batches early wait there, between steps, for
the one that loads late: without these calls the wait reads as a slow input pipeline on every rank and no rank
arrives last.  So for the life of the collective wrappers (:mod:`.collectives`) the ``torch.distributed``
functions below are wrapped in the module (callers look them up there at call time) and each call:

* takes its group's next sequence number (:mod:`.hangs.sequence`), as every collective of ours does;
* is handed, with its host time, to the ``on_call`` given at install: inside an engine's forward, backward or
  step it is that step's collective, between steps it adds to the engines' ``gap_collective_ms``.

Calls made inside one of our wrappers (``deepspeed.comm``'s backend calls ``torch.distributed`` itself: the
per-thread count :data:`handing_on`) are that collective's own and pass through untouched; calls from ds_profutils'
own code (the live figures' exchange) are counted for the sequence numbers but not timed: they are not the job's
waits.  Which frames are ours is told here (:func:`inside_ours`); a wrapper
waiting for the job's call inside it is not ours at that moment.
"""
from __future__ import annotations

import dis
import sys
import threading
from types import CodeType, FrameType
from typing import Any, Callable, Dict, FrozenSet, Optional

from .hangs.sequence import call_started, collective_ended

__all__ = ["OURS", "PASSING_ON", "TORCH_GROUP_POSITION", "TorchCollectives", "handing_on", "inside_ours",
           "passes_on"]

TORCH_GROUP_POSITION: Dict[str, int] = {
    "all_reduce": 2, "all_gather": 2, "all_gather_into_tensor": 2, "reduce_scatter": 3, "reduce_scatter_tensor": 3,
    "broadcast": 2, "reduce": 3, "gather": 3, "scatter": 3, "all_to_all": 2, "all_to_all_single": 4, "barrier": 0,
    "all_gather_object": 2, "gather_object": 3, "broadcast_object_list": 2, "scatter_object_list": 3,
    "monitored_barrier": 0,
}
"""The ``torch.distributed`` collectives wrapped (torch 2.x), and where each takes its ``group`` positionally."""


class _HandingOn(threading.local):
    depth = 0  # every thread starts at 0


handing_on = _HandingOn()
"""``depth``: how many of our collective wrappers hand the job's call on, on this thread, now: a ``torch.distributed``
call made while it is above 0 is that call's own (``deepspeed.comm``'s backend calling torch) and passes through.
Each wrapper raises it as the first statement of the ``try`` around its hand-off and lowers it as the first of the
``finally``, with no call between either and the block's edge: CPython runs a signal handler only as a function
starts, as a call into C returns or as a loop jumps back, so an exception a handler raises (a KeyboardInterrupt the
program catches to go on) never leaves it up for good, where every later call would pass through uncounted."""
OURS = "ds_profutils."
"""Calls from modules of this package are ours (the live exchange), not the job's."""
PASSING_ON: Dict[CodeType, FrozenSet[int]] = {}
"""Our wrappers around the job's own calls (its collectives, here and in :mod:`.collectives`): each one's code, and
the lines where it hands the job's call on (:func:`passes_on`)."""


def passes_on(wrapper: Callable[..., Any], *callees: str) -> None:
    """Note ``wrapper`` in :data:`PASSING_ON`: the lines where it loads one of ``callees`` (the names it holds the
    job's call under, called on that line) hand the call on; its other lines are its own bookkeeping."""
    code = wrapper.__code__
    if code in PASSING_ON:  # every op's wrapper shares its code: read once
        return
    starts, line, lines = dict(dis.findlinestarts(code)), code.co_firstlineno, set()
    for instruction in dis.get_instructions(code):
        line = starts.get(instruction.offset) or line
        if instruction.opname.startswith("LOAD") and instruction.argval in callees:
            lines.add(line)
    PASSING_ON[code] = frozenset(lines)


def _ours(frame: FrameType) -> bool:
    """Whether ``frame`` runs a module of this package."""
    return frame.f_globals.get("__name__", "").startswith(OURS)


def inside_ours(frame: Optional[FrameType]) -> bool:
    """Whether ds_profutils' own code runs from ``frame`` (the innermost) out: a frame of this package's, but for a
    wrapper of :data:`PASSING_ON` on a line that hands the job's call on, with only the job's code (and such
    wrappers) inside it: it just waits for the job's call (the program's collective between steps, a peer late).
    None of our state is half updated there, so a signal's grace ending there may end an engine's profiler run
    there (:mod:`.engine_driven`)."""
    passing = False  # the frames inside this one are the job's code and wrappers passing it on
    while frame is not None:
        if not _ours(frame):
            passing = True
        elif not (passing and frame.f_lineno in PASSING_ON.get(frame.f_code, ())):
            return True
        frame = frame.f_back
    return False


class TorchCollectives:
    """The wrappers on ``torch.distributed``'s collectives; ``on_call(op, host_ns)`` gets each timed call."""

    def __init__(self, on_call: Callable[[str, int], None]) -> None:
        import torch.distributed as dist

        self._module = dist
        self._on_call = on_call
        self._before: Dict[str, Any] = {}
        self._wrappers: Dict[str, Callable[..., Any]] = {}
        for op, position in TORCH_GROUP_POSITION.items():
            original = getattr(dist, op, None)
            if original is not None:
                self._before[op] = original
                self._wrappers[op] = self._wrap(op, original, position)
                setattr(dist, op, self._wrappers[op])

    def _wrap(self, op: str, original: Callable[..., Any], position: int) -> Callable[..., Any]:
        name = f"torch.distributed.{op}"

        def counted(*args: Any, **kwargs: Any) -> Any:
            if handing_on.depth:
                return original(*args, **kwargs)
            from_ours = _ours(sys._getframe(1))
            collective = call_started(op, args, kwargs, position)
            try:
                handing_on.depth += 1
                return original(*args, **kwargs)
            finally:
                handing_on.depth -= 1
                host_ns = collective_ended(collective) - collective.started_ns  # the marker's ends are the call's
                if not from_ours:
                    self._on_call(name, host_ns)

        passes_on(counted, "original")
        counted.__wrapped__ = original  # type: ignore[attr-defined]
        counted.__name__ = counted.__qualname__ = op
        counted.__doc__ = original.__doc__
        return counted

    def remove(self) -> None:
        """Put the functions back; one wrapped again by someone else since keeps ours in its chain."""
        for op, wrapper in self._wrappers.items():
            if getattr(self._module, op, None) is wrapper:
                setattr(self._module, op, self._before[op])
        self._wrappers = {}
