"""What a step record says about ZeRO-3 fetch events: one entry per event name (docs/zero_fetch.md).

DeepSpeed's count and numel (with the unit its coordinator counts in), bytes, and the durations in ms
on the clock they were measured on.  The fetch profiler builds the host-clock entries; the recorder
rebuilds the fetch waits on the device clock once their device times are known.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from .._device_clock import Pair, pair_ns, pairs_clock
from .._stats import DurationStats

__all__ = ["DEVICE_TIMED", "NUMEL_UNITS", "device_entry", "event_entry"]

NUMEL_UNITS: Dict[str, str] = {
    "forward_fetch_submit": "shard",
    "forward_fetch_wait": "shard",
    "backward_fetch_submit": "shard",
    "backward_fetch_wait": "shard",
    "forward_prefetch_submit": "full",
    "backward_prefetch_submit": "full",
    "forward_all_gather": "full",
    "backward_all_gather": "full",
}
"""What DeepSpeed 0.19's coordinator counts as an event's numel.

Fetch and wait events count this rank's shard (``partition_numel``); prefetch and all-gather events
count the whole parameters (``ds_numel``).  Records name the unit so nobody adds the two.
"""

DEVICE_TIMED = frozenset({"forward_fetch_wait", "backward_fetch_wait"})
"""Events timed on the device clock where there is one: the waits the compute stream sees."""

_NS_PER_MS = 1e6
_PERCENTILES = {"p50_ms": 50, "p95_ms": 95}


def event_entry(name: str, count: int, numel: int, dropped: int, durations: DurationStats, clock: str,
                element_size: Optional[int]) -> Dict[str, Any]:
    """One event's record entry: DeepSpeed's count and numel, bytes, and the durations in ms on ``clock``."""
    total, low, high = durations.figures()
    entry: Dict[str, Any] = {
        "count": count,
        "numel": numel,
        "numel_unit": NUMEL_UNITS.get(name),
        "bytes": None if element_size is None else numel * element_size,
        "time_ms": total / _NS_PER_MS,
        "min_ms": None if low is None else low / _NS_PER_MS,
        "max_ms": None if high is None else high / _NS_PER_MS,
    }
    for key, value in zip(_PERCENTILES, durations.percentiles(*_PERCENTILES.values())):
        entry[key] = None if value is None else value / _NS_PER_MS
    entry["dropped"] = dropped
    entry["clock"] = clock
    return entry


def device_entry(name: str, host: Dict[str, Any], pairs: List[Pair], element_size: Optional[int]) -> Dict[str, Any]:
    """Event ``name``'s entry on the device clock: its device intervals (the host's measure of each whose
    device time is not known), with the host's total kept as ``host_time_ms``."""
    durations = DurationStats(name)
    for pair in pairs:
        durations.add(pair_ns(pair))
    entry = event_entry(name, host["count"], host["numel"], host["dropped"], durations, pairs_clock(pairs),
                        element_size)
    entry["host_time_ms"] = host["time_ms"]
    return entry
