"""Which host each chosen rank runs on, for rank 0's ``manifest.json`` (``hosts``): each rank writes its capture
trace on its own host, so on several hosts the manifest must say where to fetch each rank's trace.

Host names are strings and the interval exchange carries floats; an all-gather of names at attach would be a new
sync point (a user may attach on a subset of ranks, and a collective there would hang the job).  So no
collective: each rank sets its host under its global rank in torch.distributed's default store once at attach
(:func:`publish_host`: one request to the store's server, waiting for no other rank), and rank 0 reads the
chosen ranks' keys when it writes a manifest (:class:`HostDirectory`): ``check`` first, which answers at once
whether a key is there, and ``get`` only for a key that is, so a missing key never waits the store's timeout
(it reads as null).  A chosen rank took part in the exchange that decided its capture, after its attach, so its
key is there unless its own publishing failed.  Failures are said once and never raised into the step.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from ...logging import logger
from ...outputs import ProcessIdentity

__all__ = ["HOST_KEY", "HostDirectory", "publish_host"]

HOST_KEY = "ds_profutils/host/{rank}"
"""The default store's key for a global rank's host name (one per process; every engine sets the same value)."""


def _default_store() -> Optional[Any]:
    """The store of torch.distributed's default group (None without one).  torch names no public getter for it;
    ``_get_default_store`` is the one torch's own code uses."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


def publish_host(identity: ProcessIdentity) -> None:
    """Set this rank's host in the default store (at attach, on every rank that may be chosen); a failure is one
    WARNING here and a null host in rank 0's manifests, training goes on."""
    try:
        store = _default_store()
        if store is not None:
            store.set(HOST_KEY.format(rank=identity.rank), identity.host)
    except Exception as exc:  # noqa: BLE001 - never into the user's attach
        logger.warning(f"ds_profutils: this rank's host could not be set in torch.distributed's store "
                       f"({type(exc).__name__}: {exc}); capture manifests will show null as its host")


class HostDirectory:
    """Rank 0's hosts of the ranks it lists: its own known at once, the others read from the default store and
    kept once found (a host does not change while the job runs)."""

    def __init__(self, identity: ProcessIdentity) -> None:
        self._known: Dict[int, str] = {identity.rank: identity.host}
        self._failed = False  # reading failed once: said, and not tried again

    def hosts(self, ranks: Sequence[int]) -> Dict[str, Optional[str]]:
        """``{str(rank): host}`` for ``ranks``, null where the host is not known (its key missing, no
        torch.distributed, or reading failed)."""
        missing = [rank for rank in ranks if rank not in self._known]
        if missing and not self._failed:
            try:
                self._read(missing)
            except Exception as exc:  # noqa: BLE001 - never into the step
                self._failed = True
                logger.warning(f"ds_profutils: the hosts of ranks {missing} could not be read from torch.distributed's "
                               f"store ({type(exc).__name__}: {exc}); capture manifests show null for them")
        return {str(rank): self._known.get(rank) for rank in ranks}

    def _read(self, ranks: Sequence[int]) -> None:
        store = _default_store()
        if store is None:
            return
        keys = [HOST_KEY.format(rank=rank) for rank in ranks]
        if store.check(keys):  # all there (the usual case): two requests for any number of ranks
            values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(key) for key in keys]
            self._known.update((rank, value.decode("utf-8", "replace")) for rank, value in zip(ranks, values))
            return
        for rank, key in zip(ranks, keys):
            if store.check([key]):  # answers at once; a get of a missing key would wait the store's timeout
                self._known[rank] = store.get(key).decode("utf-8", "replace")
