"""What to change: rules from one engine's report figures and its recorded config values to ds_config keys.

Each rule is a small function of the engine's summary (the report's ``engines.{name}``, plain data) and the
engine's effective config values (``config``: dotted key -> value, :mod:`.settings`), returning advice or None.
Advice is data: ``{"key", "topic", "now", "direction", "suggest", "why", "expected": {"figure", "direction"},
"rule"}``.  ``key`` is a dotted ds_config key, or None with a ``topic`` ("data_loader", "batching") where no key
exists.  ``expected.figure`` names a figure of the diff (``engines.{name}``): ``step_ms``, a part such as
``fetch_wait_ms``, ``gap_ms``, or an event/collective count per step (``events.forward_all_gather.count``) --
load-proof where a rule has one.  A rule whose inputs are missing gives nothing; a job where nothing stands out
gets an empty list, never a guess.  Thresholds are named constants with their source: DeepSpeed's docs for the
key (https://www.deepspeed.ai/docs/config-json/, "ZeRO Optimizations for FP16 Training") or the figure's noise.
"""
from __future__ import annotations

from statistics import median
from typing import Any, Callable, Dict, List, Mapping, Optional

from .causes import MORE_WORK_RATIO

__all__ = ["FETCH_WAIT_SHARE", "EXPOSED_REDUCE_SHARE", "LIVE_AT_LIMIT", "MANY_REDUCES", "MANY_SMALL_GATHERS",
           "RULES", "SMALL_GATHER_FACTOR", "WAITED_SHARE", "WORK_TURNS_SHARE", "advise"]

Advice = Dict[str, Any]
Z = "zero_optimization."
DEEPSPEED_PREFETCH_BUCKET = 50_000_000
"""DeepSpeed's default ``stage3_prefetch_bucket_size`` (5e7): what a bucket below it is raised to."""
FETCH_WAIT_SHARE = 0.005
"""Fetch waits under 0.5 % of the step cost nothing a key could win back: no prefetch advice below."""
WAITED_SHARE = 0.10
"""Elements waited for while their prefetch was in flight, or gathered on demand, as a share of those gathered:
from 10 % the prefetch is not ahead of the forward (a 30-step run's first step, which traces the order and
gathers everything on demand, is about 3 %)."""
MANY_SMALL_GATHERS = 32
"""All-gathers per step from which their latency adds up (DeepSpeed's docs on
``stage3_param_persistence_threshold``: smaller values "can greatly increase communication (especially
latency-bound messages)")."""
SMALL_GATHER_FACTOR = 4
"""An all-gather of at most this many times ``stage3_param_persistence_threshold`` elements is a small one."""
LIVE_AT_LIMIT = 0.95
"""Live parameters at 95 % of ``stage3_max_live_parameters`` or more: the limit is what releases them."""
EXPOSED_REDUCE_SHARE = 0.05
"""Gradient collectives stalling the step for 5 % or more of it, on the rank that waited least (its wait is
its own collectives', not a late peer's): overlapping them is worth turning on (DeepSpeed's docs:
``overlap_comm`` "attempts to overlap the reduction of the gradients with backward computation")."""
MANY_REDUCES = 8
"""Reduce collectives per step from which the bucket, not the model, sets their number: with the bucket
smaller than the model by this factor or more, ``reduce_bucket_size`` / ``allgather_bucket_size`` split the
gradients into that many messages (DeepSpeed's docs: larger buckets are faster, at the cost of memory)."""
WORK_TURNS_SHARE = 0.5
"""Ranks taking turns holding the others back for more work at their pace (each draws long batches in its own
steps, none named) in at least half of the steps where a rank held the others back, with a median per-step work
imbalance of ``MORE_WORK_RATIO`` or more: unbalanced batches, whichever rank has them."""
REDUCE_OPS = ("reduce_scatter_tensor", "all_reduce", "reduce", "reduce_scatter")
GATHER_OPS = ("all_gather_into_tensor", "all_gather")


def _train_events(engine: Mapping[str, Any]) -> Mapping[str, Any]:
    return (engine.get("events") or {}).get("train", {})


def _steps(engine: Mapping[str, Any]) -> int:
    return max((row["steps"] for row in engine.get("ranks_summary", {}).values()), default=0)


def _rank_median(engine: Mapping[str, Any], column: str) -> Optional[float]:
    values = [row[column] for row in engine.get("ranks_summary", {}).values() if row.get(column) is not None]
    return median(values) if values else None


def _rank_least(engine: Mapping[str, Any], column: str) -> Optional[Mapping[str, Any]]:
    """The summary row of the rank with the least ``column`` (its other figures told of that same rank)."""
    rows = [row for row in engine.get("ranks_summary", {}).values() if row.get(column) is not None]
    return min(rows, key=lambda row: row[column]) if rows else None


def _advice(key: Optional[str], now: Any, direction: str, suggest: Any, why: str, figure: str,
            expected: str, rule: str, topic: Optional[str] = None) -> Advice:
    return {"key": key, "topic": topic, "now": now, "direction": direction, "suggest": suggest, "why": why,
            "expected": {"figure": figure, "direction": expected}, "rule": rule}


def prefetch_bucket(engine: Mapping[str, Any], config: Mapping[str, Any]) -> Optional[Advice]:
    """Fetch waits with prefetches not ahead of the forward, where the bucket is what stops the prefetch."""
    bucket, fetched = config.get(Z + "stage3_prefetch_bucket_size"), engine.get("fetch_elements")
    prefetch = _train_events(engine).get("forward_prefetch_submit")
    step, wait = _rank_median(engine, "step_ms_median"), _rank_median(engine, "fetch_wait_ms_median")
    if None in (bucket, fetched, prefetch, step, wait) or not prefetch["count"] or not step:
        return None
    gathered = fetched["prefetched"] + fetched["on_demand"]
    late = (fetched["in_flight_waited"] or 0) + fetched["on_demand"]
    per_prefetch = prefetch["numel"] / prefetch["count"]
    if wait / step < FETCH_WAIT_SHARE or not gathered or late / gathered < WAITED_SHARE or per_prefetch < bucket:
        return None
    gathers = _train_events(engine).get("forward_all_gather", {"count": 0})["count"] / max(1, _steps(engine))
    return _advice(Z + "stage3_prefetch_bucket_size", bucket, "raise", max(2 * bucket, DEEPSPEED_PREFETCH_BUCKET),
                   f"each prefetch stops at the bucket ({per_prefetch:,.0f} elements per prefetch >= the bucket's "
                   f"{bucket:,}); {late / gathered:.0%} of the elements gathered were waited for in flight or "
                   f"gathered on demand; fetch waits {wait:.2f} ms of a {step:.1f} ms step; "
                   f"{gathers:.1f} forward all-gathers per step",
                   "events.forward_all_gather.count", "lower", "prefetch_bucket")


def persistence_threshold(engine: Mapping[str, Any], config: Mapping[str, Any]) -> Optional[Advice]:
    """Many small all-gathers per step: parameters just above the persistence threshold, gathered one by one."""
    threshold, steps = config.get(Z + "stage3_param_persistence_threshold"), _steps(engine)
    gathers = [event for name, event in _train_events(engine).items() if name.endswith("_all_gather")]
    if threshold is None or not gathers or not steps:
        return None
    count, numel = sum(event["count"] for event in gathers), sum(event["numel"] for event in gathers)
    per_gather = numel / count if count else 0
    if count / steps < MANY_SMALL_GATHERS or per_gather > SMALL_GATHER_FACTOR * max(threshold, 1):
        return None
    return _advice(Z + "stage3_param_persistence_threshold", threshold, "raise", int(2 * per_gather),
                   f"{count / steps:.0f} all-gathers per step of {per_gather:,.0f} elements each (<= "
                   f"{SMALL_GATHER_FACTOR}x the threshold): parameters this small cost latency, not bandwidth",
                   "events.forward_all_gather.count", "lower", "persistence_threshold")


def live_parameters(engine: Mapping[str, Any], config: Mapping[str, Any]) -> Optional[Advice]:
    """Live parameters at the limit with re-fetches (more gathered than twice the model a step) or trace-cache
    invalidations, while the memory has room."""
    limit, memory, model = config.get(Z + "stage3_max_live_parameters"), engine.get("memory"), engine.get("model_numel")
    steps, events = _steps(engine), _train_events(engine)
    if None in (limit, memory, model) or not steps or not memory.get("ranks"):
        return None
    live = max((row.get("live_params_max") or 0 for row in memory["ranks"].values()), default=0)
    invalidations = sum(row.get("trace_cache_invalidations") or 0 for row in memory["ranks"].values())
    gathered = sum(event["numel"] for name, event in events.items() if name.endswith("_all_gather")) / steps
    refetched = gathered > 2 * model
    if live < LIVE_AT_LIMIT * limit or not (refetched or invalidations):
        return None
    return _advice(Z + "stage3_max_live_parameters", limit, "raise", 2 * limit,
                   f"live parameters reached {live:,} of the limit {limit:,}; "
                   + (f"{gathered / model:.1f}x the model gathered per step (re-fetches)" if refetched else
                      f"{invalidations} trace-cache invalidations")
                   + "; the records hold no device capacity: check the memory peak has room"
                   + f"; raise stage3_max_reuse_distance with it ({config.get(Z + 'stage3_max_reuse_distance')})",
                   "events.forward_all_gather.count", "lower", "live_parameters")


def _op_counts(engine: Mapping[str, Any], ops: tuple) -> Dict[str, float]:
    """Calls per step of each of ``ops`` the engine issued, most first."""
    collectives, steps = engine.get("collectives") or {}, _steps(engine)
    counts = {op: collectives[op]["count"] / steps for op in ops if op in collectives and steps}
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def overlap_comm(engine: Mapping[str, Any], config: Mapping[str, Any]) -> Optional[Advice]:
    """Gradient collectives stall the step with ``overlap_comm`` off."""
    on, stage = config.get(Z + "overlap_comm"), config.get(Z + "stage")
    least = _rank_least(engine, "collective_wait_ms_median")  # the rank that waited least: its waits are its own
    waited, step = (least["collective_wait_ms_median"], least.get("step_ms_median")) if least else (None, None)
    if on is not False or not stage or waited is None or not step or not sum(_op_counts(engine, REDUCE_OPS).values()):
        return None
    if waited / step < EXPOSED_REDUCE_SHARE:
        return None
    return _advice(Z + "overlap_comm", False, "set", True,
                   f"gradient collectives stall the step {waited:.1f} ms of {step:.1f} ms on the rank that waited "
                   "least, with overlap_comm off", "collective_wait_ms", "lower", "overlap_comm")


def bucket_sizes(engine: Mapping[str, Any], config: Mapping[str, Any]) -> Optional[Advice]:
    """Many reduce collectives per step because the bucket is much smaller than the model."""
    model = engine.get("model_numel")
    for key, ops in (("reduce_bucket_size", REDUCE_OPS), ("allgather_bucket_size", GATHER_OPS)):
        bucket = config.get(Z + key)
        if key == "allgather_bucket_size" and config.get(Z + "stage") == 3:
            continue  # ZeRO-3 gathers parameters by its prefetch bucket, not this one
        counts = _op_counts(engine, ops)
        per_step = sum(counts.values())
        if bucket and model and per_step >= MANY_REDUCES and model / bucket >= MANY_REDUCES:
            calls = ", ".join(f"{count:,.0f} {op}" if count >= 1 else f"{count:.2g} {op}"
                              for op, count in counts.items())
            return _advice(Z + key, bucket, "raise", int(model), f"{calls} per step: the bucket of "
                           f"{bucket:,} elements splits the model's {model:,} into {model / bucket:.0f} messages",
                           f"collectives.{next(iter(counts))}.count", "lower", "bucket_sizes")
    return None


def input_pipeline(engine: Mapping[str, Any], config: Mapping[str, Any]) -> Optional[Advice]:
    """A straggler late by its gap between steps: the data loader (not where the gap is its eval forwards and saves);
    or a rank held back in some steps, most of them for its input pipeline (a loader whose workers take turns)."""
    summary = engine.get("ranks_summary", {})
    for rank, row in summary.items():
        if row.get("cause") == "input_pipeline" and not row["cause_figures"].get("gap_is_eval"):
            figures = row["cause_figures"]
            return _advice(None, None, "set", _FASTER_LOADER, f"rank {rank}'s gap between steps {figures['gap_ms']:.1f} "
                           f"ms against {figures['others_gap_ms']:.1f} ms on the others", "gap_ms", "lower",
                           "input_pipeline", topic="data_loader")
    for rank, row in summary.items():
        steps = row.get("cause_steps") or {}
        if row.get("held_back_in_some_steps") and steps and max(steps, key=steps.__getitem__) == "input_pipeline":
            return _advice(None, None, "set", _FASTER_LOADER, f"rank {rank} held the others back in "
                           f"{row['straggler_steps']} steps, {steps['input_pipeline']} of them by its gap between "
                           "steps", "gap_ms", "lower", "input_pipeline", topic="data_loader")
    return None


_FASTER_LOADER = ("more DataLoader workers (num_workers), pin_memory=True, prefetch_factor >= 2, a cheaper collate or "
                  "transform (or move per-step host work out of the loop)")


def more_work(engine: Mapping[str, Any], config: Mapping[str, Any]) -> Optional[Advice]:
    """A straggler late by more work at the others' pace, or the ranks taking turns at it (``WORK_TURNS_SHARE``):
    unbalanced batches."""
    summary = engine.get("ranks_summary", {})
    for rank, row in summary.items():
        if row.get("cause") == "more_work":
            figures = row["cause_figures"]
            return _advice(None, None, "set", _BALANCED_BATCHES,
                           f"rank {rank} gets {figures['work_ratio']:.2f}x the others' work per step at their pace",
                           "step_ms", "lower", "more_work", topic="batching")
    held = sum(row.get("straggler_steps", 0) for row in summary.values())
    for_work = sum((row.get("cause_steps") or {}).get("more_work", 0) for row in summary.values())
    imbalance = engine.get("work_imbalance")
    if held and for_work >= WORK_TURNS_SHARE * held and imbalance is not None and imbalance >= MORE_WORK_RATIO:
        return _advice(None, None, "set", _BALANCED_BATCHES,
                       f"in {for_work} of the {held} steps where a rank held the others back it had more work at their "
                       f"pace, the ranks in turn; a step's most work is {imbalance:.2f}x its least (median over the "
                       "steps)", "step_ms", "lower", "more_work", topic="batching")
    return None


_BALANCED_BATCHES = "token-budget batches, packing, or length-grouped sampling by tokens"


RULES: List[Callable[[Mapping[str, Any], Mapping[str, Any]], Optional[Advice]]] = [
    prefetch_bucket, persistence_threshold, live_parameters, overlap_comm, bucket_sizes, input_pipeline, more_work]


def advise(engine: Mapping[str, Any], config: Mapping[str, Any]) -> List[Advice]:
    """Every rule's advice for one engine (an empty list: nothing stands out)."""
    return [found for found in (rule(engine, config) for rule in RULES) if found is not None]


def advice_lines(advice: List[Advice]) -> List[str]:
    """The report's "What to change" section, one entry per advice (unwrapped)."""
    if not advice:
        return ["What to change: nothing stands out."]
    lines = ["What to change:"]
    for found in advice:
        what = (f"{found['direction']} {found['key']} (now {found['now']!r}, try {found['suggest']!r})"
                if found["key"] is not None else f"{found['topic'].replace('_', ' ')}: {found['suggest']}")
        expected = found["expected"]
        lines.append(f"- {what}: {found['why']}; expect {expected['figure']} to go {expected['direction']}")
    return lines
