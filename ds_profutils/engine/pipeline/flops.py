"""A pipeline stage's model FLOPs per micro batch: its layers' forward and backward, counted once.

The stage's ``ForwardPass`` and ``BackwardPass`` instructions each run one micro batch through the stage's
layers (the last stage's loss included).  DeepSpeed's pipeline keeps the shapes between stages fixed for the
engine's life, so the first train batch's first forward and first backward are each counted with torch's
``FlopCounterMode`` formulas (through :mod:`..throughput.counting`, whose errors never reach the instruction) and
the sum is every later micro batch's count; a train record's ``flops`` is that times its micro batches.  The
forward recomputed inside ``BackwardPass`` (activation checkpointing) is left out of ``flops`` and kept in
``hardware_flops``, as for every other engine.  The counting mode is on only inside those two instructions, and
always left: an instruction that raises is counted again at the next batch.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from ..throughput.counting import Tally, push_counting

__all__ = ["COUNTED_KINDS", "StageFlops"]

COUNTED_KINDS = ("ForwardPass", "BackwardPass")


class StageFlops:
    """The stage's FLOPs per micro batch once both of its instructions were counted (``per_micro_batch``)."""

    def __init__(self) -> None:
        self._counted: Dict[str, int] = {}
        self._recomputed: Dict[str, int] = {}

    @property
    def per_micro_batch(self) -> Optional[int]:
        if len(self._counted) < len(COUNTED_KINDS):
            return None
        return sum(self._counted.values())

    @property
    def hardware_per_micro_batch(self) -> Optional[int]:
        """:attr:`per_micro_batch` with the recomputed forward (what the hardware computed)."""
        model = self.per_micro_batch
        return None if model is None else model + sum(self._recomputed.values())

    def wants(self, kind: str) -> bool:
        """Whether the instruction about to run is one still to be counted."""
        return kind in COUNTED_KINDS and kind not in self._counted

    def count(self, kind: str, run: Callable[[], Any]) -> Any:
        """Run one instruction with the counting mode on, and keep its count."""
        tally = Tally(backward=kind == "BackwardPass", attention=None)
        mode = push_counting(tally)
        try:
            result = run()
        finally:
            mode.__exit__(None, None, None)
        self._counted[kind], self._recomputed[kind] = tally.flops, tally.recompute
        return result
