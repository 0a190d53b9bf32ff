"""The slow-stage rule of a pipeline, in one torch-free place for the report and the live metrics.

Stages do different work, so they are compared by their compute (forward and backward with the loss) only: a
stage is slow where its compute is at least ``SLOW_STAGE_RATIO`` times the median stage's.  The report names it
``slowest_stage`` where that holds in ``SLOW_STAGE_STEPS`` of the steps (:mod:`ds_profutils.report.pipeline`);
the live metrics apply it to each interval's medians (:mod:`ds_profutils.engine.live.interval`).
"""
from __future__ import annotations

from statistics import median
from typing import Mapping, Optional

__all__ = ["SLOW_STAGE_RATIO", "SLOW_STAGE_STEPS", "slow_stage"]

SLOW_STAGE_RATIO = 1.25
"""A stage is slow when its compute is at least this times the median stage's: the last stage's loss alone makes
an evenly split pipeline about 1.2x (a 2-stage run's median stage is the mean of the two)."""
SLOW_STAGE_STEPS = 2 / 3
"""... and the report names it when it was slow in at least this share of the steps all stages have (once in a
while any stage is slow: a page fault, the machine's other work)."""


def slow_stage(computes: Mapping[int, float]) -> Optional[int]:
    """The stage (a key of ``computes``: stage -> compute ms) at least ``SLOW_STAGE_RATIO`` times the median
    stage's, or None."""
    if not computes:
        return None
    slowest = max(computes, key=computes.__getitem__)
    middle = median(computes.values())
    return slowest if middle > 0 and computes[slowest] >= SLOW_STAGE_RATIO * middle else None
