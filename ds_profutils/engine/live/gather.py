"""The one small gather per monitoring interval that brings every rank's figures to rank 0.

Every rank calls :meth:`IntervalGather.exchange` at the same optimizer-step boundary (the recorder
calls LiveMetrics on every rank, including ranks that write no records), so the gather sits at the same
place in every rank's sequence of collectives on the default group.

Where the process group's tensors live on the accelerator (NCCL and the like), reading the result on
the host would wait for all work queued before it: a host-device synchronize on the step path.  So
there the gather is launched asynchronously, its result copied into pinned host memory behind it on the
stream, an event recorded, and the rows read at a later interval once the event says they are there
(figures an interval late, never a wait).  On gloo the tensors are host tensors and the gather's
result is read at once; ``defer=True`` takes the deferred path on gloo too (``work.is_completed()``
in place of the event), which is how the deferred bookkeeping is tested without a device.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Deque, List, Optional, Sequence, Tuple, Union

import torch

__all__ = ["IntervalGather", "Rows"]

Rows = List[List[float]]
"""Every rank's packed interval, row r from rank r (rank 0 only; other ranks get none)."""


def _group_device() -> torch.device:
    """Where the default group's collectives take their tensors: the host on gloo, else the accelerator."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


class _Pending:
    """One launched gather whose rows are read once complete; ``label`` travels with it.

    ``work`` is None for a gather that ran synchronously; ``outputs`` rank 0's gather list (host
    tensors) or the pinned host copy of the stacked rows, None on other ranks; ``event`` marks that copy.
    """

    def __init__(self, label: Any, work: Any, outputs: Union[None, torch.Tensor, List[torch.Tensor]],
                 event: Any = None) -> None:
        self.label, self.work, self.outputs, self.event = label, work, outputs, event

    def ready(self) -> bool:
        if self.event is not None:
            return self.event.query()
        return self.work is None or self.work.is_completed()

    def rows(self, block: bool) -> Optional[Rows]:
        """The gathered rows (None on ranks other than 0); ``block`` waits for them (at close only)."""
        if self.event is not None:
            if block:
                self.event.synchronize()
        elif self.work is not None:
            self.work.wait()  # complete already unless blocking: surfaces a failed gather as an error
        if self.outputs is None:
            return None
        stacked = self.outputs if isinstance(self.outputs, torch.Tensor) else torch.stack(self.outputs)
        return stacked.tolist()


class IntervalGather:
    """Gathers each interval's packed figures to rank 0 over the default process group.

    Without an initialized ``torch.distributed`` (one process) there is no gather: the rows are this
    process's own.  ``device`` overrides where the tensors go (default: the group's device); ``defer``
    whether the result is read later (default: when that device is not the host).
    """

    def __init__(self, device: Optional[torch.device] = None, defer: Optional[bool] = None) -> None:
        import torch.distributed as dist

        self._distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._distributed else 0
        self.world_size = dist.get_world_size() if self._distributed else 1
        self.device = device or (_group_device() if self._distributed else torch.device("cpu"))
        self.defer = self.device.type != "cpu" if defer is None else defer
        self._pending: Deque[_Pending] = deque()

    def exchange(self, values: Sequence[float], label: Any) -> List[Tuple[Any, Optional[Rows]]]:
        """Launch this interval's gather; return ``(label, rows)`` of every gather now complete, oldest
        first (rows None on ranks other than 0).  All ranks must call it at the same step boundary."""
        if not self._distributed:
            return [(label, [list(values)])]
        self._pending.append(self._launch(values, label))
        done = []
        while self._pending and (not self.defer or self._pending[0].ready()):
            pending = self._pending.popleft()
            done.append((pending.label, pending.rows(block=False)))
        return done

    def finish(self) -> List[Tuple[Any, Optional[Rows]]]:
        """Wait for the gathers still in flight and return them (at close: no new collective is started,
        since the other ranks may be closing at another point)."""
        done = [(pending.label, pending.rows(block=True)) for pending in self._pending]
        self._pending.clear()
        return done

    def _launch(self, values: Sequence[float], label: Any) -> _Pending:
        import torch.distributed as dist

        # non_blocking from pageable memory stages the few bytes and returns: no wait for queued work
        local = torch.tensor(values, dtype=torch.float64).to(self.device, non_blocking=True)
        gathered = [torch.empty_like(local) for _ in range(self.world_size)] if self.rank == 0 else None
        work = dist.gather(local, gathered, dst=0, async_op=self.defer)
        if not self.defer:
            return _Pending(label, None, gathered)
        if gathered is None or self.device.type == "cpu":
            return _Pending(label, work, gathered)
        work.wait()  # on an accelerator group: the current stream waits for the gather, not the host
        host = torch.empty((self.world_size, local.numel()), dtype=torch.float64, pin_memory=True)
        host.copy_(torch.stack(gathered), non_blocking=True)
        event = torch.Event(device=self.device)
        event.record()
        return _Pending(label, work, host, event)
