"""One pipeline step's instruction times by kind, on the clock of its record, and the record fields made of them.

DeepSpeed's schedule runs instructions of ten kinds (``deepspeed.runtime.pipe.schedule``).  Each is timed on
the host (``perf_counter_ns``) and, where the record is timed on the device, also between two device events,
as the record's collectives are (:mod:`ds_profutils._device_clock`): the record waits for these intervals
before it is written.  Per step only one running total per kind and the step's intervals are held, so memory
does not grow with the step count.
"""
from __future__ import annotations

from time import perf_counter_ns
from typing import Any, Callable, Dict, List, Mapping, Optional

from ..._device_clock import DeviceEvents, Pair, pair_ns

__all__ = ["GROUPS", "INSTRUCTION_KINDS", "InstructionTimes"]

INSTRUCTION_KINDS = ("LoadMicroBatch", "ForwardPass", "BackwardPass", "SendActivation", "RecvActivation", "SendGrad",
                     "RecvGrad", "ReduceGrads", "ReduceTiedGrads", "OptimizerStep")
"""The instruction classes of DeepSpeed 0.19's schedules, by name (the keys of ``instructions_ms``)."""
GROUPS: Mapping[str, tuple] = {
    "compute_ms": ("ForwardPass", "BackwardPass"),  # the last stage's loss is computed in its ForwardPass
    # on gloo a send blocks until its peer receives: waiting for the neighbour stage hides in sends and receives
    "p2p_ms": ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad"),
    "reduce_ms": ("ReduceGrads", "ReduceTiedGrads"),
    "optimizer_ms": ("OptimizerStep", ),
    "load_ms": ("LoadMicroBatch", ),
}
"""The record's grouped figures and the instruction kinds each adds up."""
_NS_PER_MS = 1e6


class InstructionTimes:
    """The instructions one step ran: host nanoseconds per kind and, on the device clock, their intervals."""

    __slots__ = ("device_events", "host_ns", "counts", "intervals", "flops_per_micro_batch",
                 "hardware_flops_per_micro_batch")

    def __init__(self, device_events: Optional[DeviceEvents]) -> None:
        self.device_events = device_events  # None: the record is timed on the host
        self.host_ns: Dict[str, int] = {}
        self.counts: Dict[str, int] = {}
        self.intervals: Dict[str, List[Pair]] = {}
        self.flops_per_micro_batch: Optional[int] = None  # a train batch's, once counted (:mod:`.flops`)
        self.hardware_flops_per_micro_batch: Optional[int] = None  # the same with the recompute

    def run(self, kind: str, instruction: Callable[..., Any], engine: Any, kwargs: Mapping[str, Any]) -> Any:
        """Run one instruction (``instruction(engine, **kwargs)``) and add its time to its kind."""
        events = self.device_events
        start_mark = events.mark() if events is not None else None
        start = perf_counter_ns()
        try:
            result = instruction(engine, **kwargs)
        except BaseException:
            if events is not None:
                events.release(start_mark)
            raise
        host_ns = perf_counter_ns() - start
        self.host_ns[kind] = self.host_ns.get(kind, 0) + host_ns
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if events is not None:
            self.intervals.setdefault(kind, []).append(events.pair(start_mark, events.mark(), host_ns))
        return result

    def pairs(self) -> List[Pair]:
        """Every device interval of the step (the record waits for them before it is written)."""
        return [pair for pairs in self.intervals.values() for pair in pairs]

    def live(self, fields: Mapping[str, Any], step_ms: float) -> Dict[str, Any]:
        """The step's figures for the live metrics (:class:`..live.StepFigures`), from the times known now."""
        figures = self.fields(step_ms)
        return {"pipe_stage": fields.get("pipe_stage"), "compute_ms": figures["compute_ms"],
                "bubble_ms": figures["bubble_ms"], "flops": figures.get("flops")}

    def fields(self, step_ms: float) -> Dict[str, Any]:
        """The record's pipeline figures, in ms: per kind, grouped, and the time outside every instruction.

        ``bubble_ms`` is what is not work: the send and receive instructions (waiting for a neighbour stage
        included) and the time outside instructions; ``bubble_share`` its share of the step."""
        by_kind = {kind: (sum(map(pair_ns, self.intervals[kind])) if kind in self.intervals else host_ns) / _NS_PER_MS
                   for kind, host_ns in self.host_ns.items()}
        # every micro batch passes forward once on every stage (not every stage loads one)
        figures: Dict[str, Any] = {"micro_batches": self.counts.get("ForwardPass", 0), "instructions_ms": by_kind}
        for name, kinds in GROUPS.items():
            figures[name] = sum(by_kind.get(kind, 0.0) for kind in kinds)
        figures["other_ms"] = max(0.0, step_ms - sum(by_kind.values()))
        figures["bubble_ms"] = figures["p2p_ms"] + figures["other_ms"]
        figures["bubble_share"] = figures["bubble_ms"] / step_ms if step_ms > 0 else None
        if self.flops_per_micro_batch is not None:
            figures.update(flops=self.flops_per_micro_batch * figures["micro_batches"], flops_source="counted",
                           hardware_flops=self.hardware_flops_per_micro_batch * figures["micro_batches"])
        return figures
