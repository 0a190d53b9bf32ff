"""One optimizer step's totals over its micro steps: the whole iteration, its gap, FLOPs and batch.

A record holds one micro step (forward start to the end of its backward or of ``engine.step()``); what a
user's iteration costs is wider: from the end of the previous optimizer step to the end of this one, data
loading, callbacks and logging included (``iteration_ms``).  ``gap_ms`` is the part of it outside the
micro steps' own spans -- what the program did between them, which no step time shows (a slow input
pipeline); ds_profutils' own work as an optimizer step ends (the records written, the live exchange, which on
gloo waits for every rank) is in the iteration, not in the gap.  Two parts of the gap are named: ``eval_ms``, the time inside the engine's eval and no-grad
forwards (an eval loop, the transformers Trainer's evaluation; a reference model's no-grad forward too), and
``save_ms``, the time inside ``engine.save_checkpoint()``: an interval's TFLOP/s and tokens/s fall where
either ran, and these say why.  All are host-clock figures, final the moment the step ends, so the live figures
(:class:`~ds_profutils.engine.live.StepFigures`) are built from them at once.

:class:`OptimizerStepTotals` adds up the micro steps of the optimizer step in progress and, at its end,
gives the two fields of the record that ended it and the step's figures.  Its clock is the recorder's
``perf_counter_ns``; every optimizer step's end is noted (a clock read), measured or not, so a step
``log_interval`` records still has its iteration; the first after attach has no previous end.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

from ..live.interval import StepFigures
from .flops import MicroStepFlops

__all__ = ["OptimizerStepTotals", "StepSums"]

_NS_PER_MS = 1e6


class StepSums:
    """What the micro steps of one optimizer step added up to (None where any micro step did not know)."""

    __slots__ = ("busy_ns", "own_ns", "step_ms", "flops", "tokens", "samples", "exposed_wait_ms", "collective_ms",
                 "peak_allocated_bytes", "eval_ms", "save_ms")

    def __init__(self) -> None:
        self.busy_ns = 0  # host time inside the micro steps' spans
        self.own_ns = 0  # ds_profutils' own work at the previous optimizer step's end
        self.step_ms = 0.0  # their step times, on the clock each was measured on (host here)
        self.flops: Optional[int] = 0
        self.tokens: Optional[int] = 0
        self.samples: Optional[int] = 0
        self.exposed_wait_ms = 0.0
        self.collective_ms = 0.0
        self.peak_allocated_bytes: Optional[int] = None
        self.eval_ms = 0.0  # of the gap: inside eval and no-grad forwards since the previous optimizer step's end
        self.save_ms = 0.0  # of the gap: inside engine.save_checkpoint() since then

    def figures(self, global_step: int, records: Sequence[Any], iteration_ms: Optional[float], gap_ms: Optional[float],
                gap_collective_ms: float) -> StepFigures:
        """The optimizer step's figures for the live metrics, from these sums and its micro steps' ``records`` (an
        engine kind's own parts: a pipeline's), the gap less the frameworks' collectives in it (as the report's)."""
        own: Dict[str, Any] = {}
        for record in records:
            for part in record.parts:
                own.update(part.live(record.fields, self.step_ms))
        flops = own.pop("flops", self.flops)
        own_gap_ms = None if gap_ms is None else max(gap_ms - gap_collective_ms, 0.0)
        return StepFigures(global_step, self.step_ms, iteration_ms, own_gap_ms, flops, self.tokens, self.samples,
                           self.exposed_wait_ms, self.collective_ms + gap_collective_ms, self.peak_allocated_bytes,
                           eval_ms=self.eval_ms, save_ms=self.save_ms, **own)


def _add(total: Optional[int], value: Optional[int]) -> Optional[int]:
    """None where any micro step did not know."""
    return None if total is None or value is None else total + value


class OptimizerStepTotals:
    """The optimizer step in progress on one engine (see the module doc)."""

    def __init__(self) -> None:
        self.sums = StepSums()
        self._previous_end_ns: Optional[int] = None

    def micro_step(self, start_ns: int, end_ns: int, timing: Dict[str, Any], flops: Optional[MicroStepFlops],
                   memory: Optional[Dict[str, Any]], fetch_wait_ms: float) -> None:
        """One train micro step of this optimizer step ended: its span, host timing and batch."""
        sums = self.sums
        sums.busy_ns += end_ns - start_ns
        sums.step_ms += timing["step_time_ms"]
        sums.collective_ms += timing["collective_ms"]
        sums.exposed_wait_ms += timing["collective_wait_ms"] + fetch_wait_ms
        if flops is None:
            sums.flops = sums.tokens = sums.samples = None
        else:
            sums.flops = _add(sums.flops, flops.flops)
            sums.tokens = _add(sums.tokens, flops.tokens)
            sums.samples = _add(sums.samples, flops.samples)
        if memory is not None:
            peak = memory["peak_allocated_bytes"]
            sums.peak_allocated_bytes = peak if sums.peak_allocated_bytes is None else max(sums.peak_allocated_bytes,
                                                                                           peak)

    def eval_forward(self, span_ns: int) -> None:
        """An eval or no-grad forward of ``span_ns`` ended (outside every micro step: a part of the gap)."""
        self.sums.eval_ms += span_ns / _NS_PER_MS

    def checkpoint_saved(self, elapsed_ns: int) -> None:
        """``engine.save_checkpoint()`` took ``elapsed_ns`` (a part of the gap)."""
        self.sums.save_ms += elapsed_ns / _NS_PER_MS

    def own_work(self, elapsed_ns: int) -> None:
        """ds_profutils' own work at the optimizer step's end took ``elapsed_ns`` (the next iteration's, not its gap)."""
        self.sums.own_ns += elapsed_ns

    def ended(self, end_ns: int) -> Tuple[Optional[float], Optional[float], StepSums]:
        """The optimizer step ended at ``end_ns``: its ``iteration_ms`` and ``gap_ms`` (None for the first
        after attach) and its sums; the next step's totals start empty."""
        previous, self._previous_end_ns = self._previous_end_ns, end_ns
        sums, self.sums = self.sums, StepSums()
        if previous is None:
            return None, None, sums
        iteration_ns = end_ns - previous
        return iteration_ns / _NS_PER_MS, max(iteration_ns - sums.busy_ns - sums.own_ns, 0) / _NS_PER_MS, sums
