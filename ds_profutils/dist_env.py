"""Which process this is in the job: global rank, world size, host.

Per-rank output files must be named by the GLOBAL rank, which is unique across nodes.  torch.distributed
knows it once initialized; before that the launcher's ``RANK``/``WORLD_SIZE`` environment does.
``LOCAL_RANK`` is never used: it repeats on every node, so files from two nodes would collide.
"""
from __future__ import annotations

import os
import socket

__all__ = ["distributed_initialized", "global_rank", "hostname", "world_size"]


def distributed_initialized() -> bool:
    """True once torch.distributed has a default process group."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def global_rank() -> int:
    """This process's global rank: torch.distributed's, else the launcher's ``RANK``, else 0."""
    if distributed_initialized():
        import torch.distributed as dist

        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """The number of ranks in the job: torch.distributed's, else the launcher's ``WORLD_SIZE``, else 1."""
    if distributed_initialized():
        import torch.distributed as dist

        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def hostname() -> str:
    """The host name recorded inside outputs (file names carry only the rank)."""
    return socket.gethostname()
