"""The one small all-gather per monitoring interval that gives every rank every rank's packed row.

Every rank calls :meth:`IntervalGather.exchange` at the same optimizer-step boundary (LiveMetrics is fed
on every rank, including ranks that write no records and ranks whose recorder failed), so the exchange
sits at the same place in every rank's sequence of collectives.  It runs on the engine's data-parallel
group (``group``; None is the default group), not blindly on the default group: an engine trained on a
subset of the world would otherwise wait for ranks that never come.  It is an all-gather, not a gather to
rank 0, so every rank holds the same rows and takes the same decisions from them (:mod:`.interval`).

Where the process group's tensors live on the accelerator (NCCL and the like), reading the result on
the host would wait for all work queued before it: a host-device synchronize on the step path.  So
there the all-gather is launched asynchronously, its result copied into pinned host memory behind it on
the stream, an event recorded, and the rows read at a later interval once the event says they are there
(figures an interval late, never a wait): interval k's rows are read at the latest at the boundary of
k + 2 (:data:`DEFERRED_LAG`), long after they were complete, so every rank has them there and a decision
taken from them takes effect on every rank at that same boundary.  On gloo the tensors are host tensors
and the result is read at once; ``defer=True`` takes the deferred path on gloo too
(``work.is_completed()`` in place of the event), which is how the deferred bookkeeping is tested without
a device.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Deque, List, Optional, Sequence, Tuple, Union

import torch

__all__ = ["DEFERRED_LAG", "IntervalGather", "Rows", "exchange_group"]

Rows = List[List[float]]
"""Every rank's packed interval, row r from the group's rank r (the same rows on every rank)."""
DEFERRED_LAG = 2
"""On the deferred path interval k's rows are read (waited for, if need be) at the boundary of k + 2."""


def exchange_group(engine: Any) -> Any:
    """The engine's data-parallel group as our exchange takes it: None (the default group) where it spans
    the whole world, as DeepSpeed's clone of the world group does for a plain data-parallel job."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = getattr(engine, "seq_data_parallel_group", None) or getattr(engine, "data_parallel_group", None)
    if group is None or dist.get_process_group_ranks(group) == list(range(dist.get_world_size())):
        return None
    return group


def _group_device(group: Any) -> torch.device:
    """Where the group's collectives take their tensors: the host on gloo, else the accelerator."""
    import torch.distributed as dist

    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


class _Pending:
    """One launched all-gather whose rows are read once complete; ``label`` travels with it.

    ``work`` is None for one that ran synchronously; ``outputs`` the gathered host tensors or the pinned
    host copy of the stacked rows; ``event`` marks that copy; ``index`` counts the exchanges.
    """

    def __init__(self, index: int, label: Any, work: Any, outputs: Union[torch.Tensor, List[torch.Tensor]],
                 event: Any = None) -> None:
        self.index, self.label, self.work, self.outputs, self.event = index, label, work, outputs, event

    def ready(self) -> bool:
        if self.event is not None:
            return self.event.query()
        return self.work is None or self.work.is_completed()

    def rows(self, block: bool) -> Rows:
        """The gathered rows; ``block`` waits for them (two intervals after their launch, and at close)."""
        if self.event is not None:
            if block:
                self.event.synchronize()
        elif self.work is not None:
            self.work.wait()  # complete already unless blocking: surfaces a failed exchange as an error
        stacked = self.outputs if isinstance(self.outputs, torch.Tensor) else torch.stack(self.outputs)
        return stacked.tolist()


class IntervalGather:
    """All-gathers each interval's packed figures over ``group`` (None: the default group).

    Without an initialized ``torch.distributed`` (one process) there is no exchange: the rows are this
    process's own.  ``device`` overrides where the tensors go (default: the group's device); ``defer``
    whether the result is read later (default: when that device is not the host).  ``ranks`` are the
    global ranks of the group's rows.
    """

    def __init__(self, device: Optional[torch.device] = None, defer: Optional[bool] = None,
                 group: Any = None) -> None:
        import torch.distributed as dist

        self._distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self._distributed else 0
        self.world_size = dist.get_world_size(group) if self._distributed else 1
        self.ranks = (list(range(self.world_size)) if not self._distributed or group is None else
                      dist.get_process_group_ranks(group))
        self.device = device or (_group_device(group) if self._distributed else torch.device("cpu"))
        self.defer = self.device.type != "cpu" if defer is None else defer
        self.lag = DEFERRED_LAG if self.defer else 0
        self._pending: Deque[_Pending] = deque()
        self._launched = 0

    @property
    def launched(self) -> int:
        """How many exchanges were launched: the index the next one gets."""
        return self._launched

    def due(self) -> List[Tuple[int, Any, Rows]]:
        """The exchanges that must be read before the next is launched, waited for if need be: on the
        deferred path, those launched ``lag`` intervals before it (long complete on every rank)."""
        done = []
        while self._pending and self._pending[0].index <= self._launched - self.lag:
            pending = self._pending.popleft()
            done.append((pending.index, pending.label, pending.rows(block=True)))
        return done

    def exchange(self, values: Sequence[float], label: Any) -> List[Tuple[int, Any, Rows]]:
        """Launch this interval's all-gather; return ``(index, label, rows)`` of every exchange now complete,
        oldest first (call :meth:`due` first).  All ranks must call it at the same step boundary."""
        index = self._launched
        self._launched += 1
        if not self._distributed:
            return [(index, label, [list(values)])]
        self._pending.append(self._launch(index, values, label))
        done = []
        while self._pending and (not self.defer or self._pending[0].ready()):
            pending = self._pending.popleft()
            done.append((pending.index, pending.label, pending.rows(block=False)))
        return done

    def finish(self) -> List[Tuple[int, Any, Rows]]:
        """Wait for the exchanges still in flight and return them (at close: no new collective is started,
        since the other ranks may be closing at another point)."""
        done = [(pending.index, pending.label, pending.rows(block=True)) for pending in self._pending]
        self._pending.clear()
        return done

    def _launch(self, index: int, values: Sequence[float], label: Any) -> _Pending:
        import torch.distributed as dist

        # non_blocking from pageable memory stages the few bytes and returns: no wait for queued work
        local = torch.tensor(values, dtype=torch.float64).to(self.device, non_blocking=True)
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        work = dist.all_gather(gathered, local, group=self.group, async_op=self.defer)
        if not self.defer or self.device.type == "cpu":
            return _Pending(index, label, work if self.defer else None, gathered)
        work.wait()  # on an accelerator group: the current stream waits for the exchange, not the host
        host = torch.empty((self.world_size, local.numel()), dtype=torch.float64, pin_memory=True)
        host.copy_(torch.stack(gathered), non_blocking=True)
        event = torch.Event(device=self.device)
        event.record()
        return _Pending(index, label, work, host, event)
