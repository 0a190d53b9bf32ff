"""The operator summary table of a profiled run, over all its recorded cycles.

torch keeps the events of one cycle only; a run with ``repeat > 1`` would otherwise summarise its
last cycle.  Here each cycle's per-operator averages are added into the first cycle's, so the table
covers every recorded step, with a FLOPs column when the run counted FLOPs.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

__all__ = ["OperatorSummary"]


class OperatorSummary:
    """Per-operator totals summed over cycles, rendered as torch's ``key_averages().table``."""

    def __init__(self, sort_by: str, row_limit: int) -> None:
        self.sort_by = sort_by
        self.row_limit = row_limit
        self._averages: Optional[Any] = None  # torch's EventList of FunctionEventAvg, one per operator
        self._by_key: Dict[str, Any] = {}

    def add_cycle(self, torch_profiler: Any) -> None:
        """Add the operators of a cycle that has stopped recording."""
        averages = torch_profiler.key_averages()
        if self._averages is None:
            # Keep torch's own list: it knows the device and whether FLOPs were counted.
            self._averages = averages
            self._by_key = {average.key: average for average in averages}
            return
        for average in averages:
            total = self._by_key.get(average.key)
            if total is None:
                self._averages.append(average)
                self._by_key[average.key] = average
            else:
                total.add(average)

    def table(self) -> Optional[str]:
        """The table (None before any cycle was added)."""
        if self._averages is None:
            return None
        return self._averages.table(sort_by=self.sort_by, row_limit=self.row_limit)
