"""One engine's memory, per rank: peaks of the train steps, ZeRO-3's live parameters, where a peak jumped.

Schema 3 records carry the step's peak allocated and reserved bytes (the accelerator's allocator, or
the process RSS on DeepSpeed's CPU accelerator), the most parameter elements ZeRO-3 held gathered
against ``stage3_max_live_parameters``, trace-cache invalidations and prefetch hits.  The readers keep
two numbers per rank and step (the peaks) and running totals for the rest, so this adds nothing that
grows with the size of the records.

A step whose record says ``memory.disturbed`` (its peaks were reset between ds_profutils' boundaries,
e.g. by DeepSpeed's ``memory_breakdown``, so they cover part of the step only) is counted and marked,
and left out of each rank's peak, the highest rank, the imbalance and the jumps.  A jump that starts in
the torch profiler's active window or the step after it is marked ``during_profiler``: the profiler's
own buffers, not a leak.

A jump is a step whose peak rose more than ``JUMP_SHARE`` over the rank's usual level, the median of
its earlier steps (once there are ``JUMP_BASELINE_STEPS`` of them: the first steps allocate the
optimizer's state), counted once per rise: a tensor kept alive from step 3 on is one jump, at step 3,
whether the run ends at step 5 or 500; a leak is one jump, where it passes 10%.  The median over the
whole run would hide a rise that lasts more than half of it.
"""
from __future__ import annotations

import heapq
import math
from bisect import insort
from statistics import median
from array import array
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

from .records import FileRecords

__all__ = ["JUMP_BASELINE_STEPS", "JUMP_SHARE", "JUMPS_KEPT", "carries_memory", "jump_rule", "memory_report", "rises"]

JUMP_SHARE = 0.10
"""A step's peak is a jump when it is more than this share over the median of the rank's earlier steps ..."""
JUMP_BASELINE_STEPS = 3
"""... once there are at least this many of them."""
JUMPS_KEPT = 10_000
"""``memory.jumps`` keeps at most this many per engine, the largest rises (a run whose peaks swing by more
than 10% step after step has one every few steps and rank); ``jump_count`` has them all."""


def jump_rule() -> str:
    """The jump rule in words, as the report prints it."""
    return (f"a jump is a train step whose peak allocated bytes are more than {JUMP_SHARE:.0%} over the median of "
            f"the rank's earlier steps, once it has {JUMP_BASELINE_STEPS} of them; once per rise")


def rises(values: Sequence[float]) -> Iterator[Tuple[int, float]]:
    """(index, baseline) of each value that starts a rise of more than ``JUMP_SHARE`` over the median of the
    values before it (the baseline); NaN values (steps without memory figures) are skipped."""
    earlier: List[float] = []  # sorted
    above = False
    for index, value in enumerate(values):
        if value != value:
            continue
        if len(earlier) >= JUMP_BASELINE_STEPS:
            middle = len(earlier) // 2
            baseline = earlier[middle] if len(earlier) % 2 else (earlier[middle - 1] + earlier[middle]) / 2
            over = value > (1 + JUMP_SHARE) * baseline
            if over and not above:
                yield index, baseline
            above = over
        insort(earlier, value)


def carries_memory(records: FileRecords) -> bool:
    """Whether any record of the file has a memory figure (schema 3)."""
    return (any(source is not None for source in records.memory_sources) or records.live_params_max is not None
            or records.trace_cache_invalidations is not None or records.prefetch_hits is not None)


def _present(values: Sequence[float]) -> List[float]:
    return [value for value in values if value == value]


def _bytes(value: Optional[float]) -> Optional[int]:
    return None if value is None else int(value)


def _trusted(records: FileRecords, column: array) -> array:
    """``column`` (a peak per step) with the disturbed steps' values NaN (left out)."""
    if not any(records.disturbed):
        return column
    return array("d", (math.nan if disturbed else value for value, disturbed in zip(column, records.disturbed)))


def _rank_memory(records: FileRecords, peaks: array, jumps: int) -> Dict[str, Any]:
    allocated = _present(peaks)
    reserved = _present(_trusted(records, records.peak_reserved_bytes))
    peak = max(allocated, default=None)
    disturbed = [value for value, flag in zip(records.peak_allocated_bytes, records.disturbed) if flag and value == value]
    sources = sorted(str(source) for source in records.memory_sources if source is not None)
    live, limit = records.live_params_max, records.max_live_parameters
    hits, waited = records.prefetch_hits, records.prefetch_waited
    return {
        "source": "+".join(sources) or None,
        "peak_allocated_bytes": _bytes(peak),
        "peak_step": None if peak is None else records.global_steps[peaks.index(peak)],
        "peak_phase": records.peak_phase,
        "median_peak_allocated_bytes": _bytes(median(allocated)) if allocated else None,
        "peak_reserved_bytes": _bytes(max(reserved, default=None)),
        "median_peak_reserved_bytes": _bytes(median(reserved)) if reserved else None,
        "live_params_max": live,
        "max_live_parameters": limit,
        "live_params_share": live / limit if live is not None and limit else None,
        "trace_cache_invalidations": records.trace_cache_invalidations,
        "prefetch_hits": hits,
        "prefetch_waited": waited,
        "prefetch_hit_rate": hits / (hits + waited) if hits is not None and waited is not None and hits + waited else None,
        "jumps": jumps,
        "disturbed_steps": sum(records.disturbed),
        "disturbed_peak_allocated_bytes": _bytes(max(disturbed, default=None)),
    }


def memory_report(files: Sequence[FileRecords], profiled: Mapping[int, Set[int]]) -> Optional[Dict[str, Any]]:
    """The engine's memory tables (``memory`` in ``--json``); None when no record carries memory figures.
    ``profiled``: per rank, the global steps its torch profiler was active in."""
    files = [records for records in files if carries_memory(records)]
    if not files:
        return None
    kept: List[Tuple[float, int, int, float, float, bool]] = []  # a heap of (rise, rank, step, peak, baseline, profiler's)
    jump_count = 0
    ranks: Dict[int, Dict[str, Any]] = {}
    for records in sorted(files, key=lambda f: f.rank):
        peaks, rank_count = _trusted(records, records.peak_allocated_bytes), 0
        active = profiled.get(records.rank, set())
        for index, baseline in rises(peaks):
            step = records.global_steps[index]
            jump = (peaks[index] / baseline if baseline > 0 else math.inf, records.rank, step, peaks[index], baseline,
                    step in active or step - 1 in active)
            if len(kept) < JUMPS_KEPT:
                heapq.heappush(kept, jump)
            elif jump > kept[0]:
                heapq.heapreplace(kept, jump)
            rank_count += 1
        jump_count += rank_count
        ranks[records.rank] = _rank_memory(records, peaks, rank_count)
    peaks_by_rank = {rank: row["peak_allocated_bytes"] for rank, row in ranks.items()
                     if row["peak_allocated_bytes"] is not None}
    highest = max(peaks_by_rank, key=peaks_by_rank.__getitem__, default=None)
    lowest = min(peaks_by_rank, key=peaks_by_rank.__getitem__, default=None)
    sources: Dict[str, int] = {}
    for records in files:
        for source, records_of_it in records.memory_sources.items():
            if source is not None:
                sources[source] = sources.get(source, 0) + records_of_it
    return {
        "sources": sources,
        "ranks": ranks,
        "highest_rank": highest,
        "lowest_rank": lowest,
        "imbalance": (peaks_by_rank[highest] / peaks_by_rank[lowest]
                      if highest is not None and peaks_by_rank[lowest] > 0 else None),
        "jump_rule": {"text": jump_rule(), "over_baseline_share": JUMP_SHARE, "baseline_steps": JUMP_BASELINE_STEPS},
        "jump_count": jump_count,
        "disturbed_steps": sum(row["disturbed_steps"] for row in ranks.values()),
        "jumps": [{"rank": rank, "global_step": step, "peak_allocated_bytes": int(peak), "baseline_bytes": int(baseline),
                   "during_profiler": during}
                  for _, rank, step, peak, baseline, during in sorted(kept, key=lambda jump: (jump[2], jump[1]))],
    }
