"""Per group, a sequence number for each collective and the collective each rank is inside now.

A hung job's ranks can be lined up only where each rank says how far it got on each group: the n-th
collective a rank issues on a group is the n-th of every other member (collectives on one group run in
one order on all of its ranks), so a rank waiting inside collective n of a group while another member has
issued only n-1 there names that member as the one that never arrived.  Our collective wrappers
(``deepspeed.comm``'s backend in :mod:`..collectives`, the ``torch.distributed`` functions in
:mod:`..torch_collectives`, and pipeline p2p) call :func:`collective_started` before the call and
:func:`collective_ended` after it, always while an engine is attached: a dict lookup and a few attribute
writes per collective.  The hang watchdog's thread reads :func:`progress` without a lock: it only reads
attributes the wrappers write whole, so it never waits for the step path, nor the step path for it.

A group is known by its ranks (a tuple of global ranks): two process groups over the same ranks (DeepSpeed's
data-parallel group and the world) share a counter, which every member advances alike.  Pipeline p2p: call
``collective_started("send", (a, b), nbytes)`` (or ``"recv"``) with the pair's ranks sorted, so both ends count on
one key, and ``collective_ended`` after the call; an ``async_op`` handle's ``wait()`` goes between
:func:`collective_resumed` and ``collective_ended``.
"""
from __future__ import annotations

import time
from time import perf_counter_ns
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["Collective", "GroupProgress", "call_started", "collective_ended", "collective_resumed",
           "collective_started", "group_ranks", "progress", "tensor_bytes"]


class GroupProgress:
    """How far this rank got on one group: ``seq`` collectives issued, the one inside now, the last ended."""

    __slots__ = ("ranks", "seq", "current", "last")

    def __init__(self, ranks: Tuple[int, ...]) -> None:
        self.ranks = ranks
        self.seq = 0
        self.current: Optional[Collective] = None
        self.last: Optional[Collective] = None


class Collective:
    """One collective a rank issued: its name, group (ranks), sequence number there, bytes, and when it started
    and ended (``perf_counter_ns``: one clock read at each end, on the step path; :meth:`as_dict` gives wall-clock
    seconds, comparable across hosts roughly; ``ended_ns`` None while inside it).  Made as it starts: it takes the
    group's next sequence number and is the one this rank is inside now (:func:`collective_started`)."""

    __slots__ = ("name", "group", "ranks", "seq", "nbytes", "started_ns", "ended_ns")

    def __init__(self, name: str, group: GroupProgress, nbytes: Optional[int]) -> None:
        group.seq += 1
        self.name, self.group, self.ranks, self.seq, self.nbytes = name, group, group.ranks, group.seq, nbytes
        self.started_ns = perf_counter_ns()
        self.ended_ns: Optional[int] = None
        group.current = self

    def as_dict(self) -> Dict[str, Any]:
        ended = self.ended_ns  # read once: the training thread may resume it meanwhile (an async wait)
        return {"name": self.name, "group": list(self.ranks), "seq": self.seq, "bytes": self.nbytes,
                "since": wall_time(self.started_ns), "ended": None if ended is None else wall_time(ended)}


def wall_time(ns: int) -> float:
    """``time.time()`` at the ``perf_counter_ns()`` reading ``ns`` (read now, so a clock step since is not in it)."""
    return time.time() - (perf_counter_ns() - ns) / 1e9


_by_ranks: Dict[Tuple[int, ...], GroupProgress] = {}
_by_group: Dict[Any, GroupProgress] = {}  # the group objects seen (None: the default group), resolved once


def group_ranks(group: Any) -> Tuple[int, ...]:
    """The global ranks of ``group``: a process group, None (the default group) or a tuple of ranks already."""
    if isinstance(group, tuple):
        return group
    import torch.distributed as dist

    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _first_seen(group: Any) -> GroupProgress:
    """The progress of a group met for the first time (two groups over the same ranks share one)."""
    try:
        ranks = group_ranks(group)
    except Exception:  # noqa: BLE001 - a group torch cannot tell (no process group): counted, never raised
        return _by_ranks.setdefault((), GroupProgress(()))
    found = _by_group[group] = _by_ranks.setdefault(ranks, GroupProgress(ranks))
    return found


def tensor_bytes(args: tuple, kwargs: Optional[Dict[str, Any]] = None) -> Optional[int]:
    """The bytes of the largest tensor among a collective's first two arguments (its input and output), or None.
    ``deepspeed.comm`` passes them by keyword to the backend (``output_tensor=``, ``input_tensor=``): then the first
    two given."""
    largest = None
    for value in args[:2] if len(args) >= 2 or not kwargs else (*args, *kwargs.values())[:2]:
        size = getattr(value, "nbytes", None)
        if isinstance(size, int) and (largest is None or size > largest):
            largest = size
    return largest


def collective_started(name: str, group: Any, nbytes: Optional[int]) -> Collective:
    """A collective called ``name`` starts on ``group`` (a process group, None for the default, or a ranks tuple
    such as a pipeline p2p pair): it takes the group's next sequence number and is the one this rank is inside
    now.  Give it to :func:`collective_ended` once the call returns (raising or not)."""
    return Collective(name, _by_group.get(group) or _first_seen(group), nbytes)


def call_started(name: str, args: tuple, kwargs: Dict[str, Any], group_position: int) -> Collective:
    """:func:`collective_started` for a collective called with ``args`` and ``kwargs``: its group the ``group``
    argument (``group_position`` its place among the positional ones; absent: the default group), its bytes
    :func:`tensor_bytes`.  One call of ours where a wrapper runs inside a step (each costs microseconds there)."""
    group = kwargs["group"] if "group" in kwargs else args[group_position] if len(args) > group_position else None
    return Collective(name, _by_group.get(group) or _first_seen(group), tensor_bytes(args, kwargs))


def collective_ended(collective: Collective) -> int:
    """``collective``'s call returned (on the thread that started it): it is the group's last ended, and this
    rank is inside it no more.  Returns when (``perf_counter_ns``): the end of the call's host time.

    CPython runs a signal handler as a function starts and as a call into C returns; an exception one raises (a
    KeyboardInterrupt the program catches to go on) can cut this short.  Raised as it starts, the group's
    ``current`` stays on this collective until the group's next one; whether the thread is inside one of our
    wrappers' calls is the wrappers' own count (:data:`..torch_collectives.handing_on`), kept where no handler
    runs.  Raised as the clock read returns, the collective has ended already, provisionally at its
    start: a wrapper's ``finally`` that ends a collective its timed call did not (``ended_ns`` None) does not
    end it again."""
    collective.ended_ns = collective.started_ns
    group_progress = collective.group
    group_progress.last = collective
    if group_progress.current is collective:
        group_progress.current = None
    ended = collective.ended_ns = perf_counter_ns()
    return ended


def collective_resumed(collective: Collective) -> None:
    """This rank waits for ``collective`` again (an ``async_op`` collective's ``wait()``, launched earlier): it is
    the one the rank is inside until the next :func:`collective_ended`; its sequence number stays."""
    collective.group.current = collective
    collective.ended_ns = None


def progress() -> List[GroupProgress]:
    """Every group this process issued collectives on (read from another thread: a copy of the list)."""
    for _ in range(3):
        try:
            return list(_by_ranks.values())
        except RuntimeError:  # changed size while copied (a first collective on a new group): read again
            continue
    return []
