"""The operator summary of a profiled run: calls, host time and counted FLOPs per operator, over every cycle.

Built from torch's raw event list (``kineto_results.events()``, C++ objects read field by field), not
from ``key_averages()``: that builds a Python object tree over every event and took 32 s for a
250k-event window on this project's machine, against about 2 s here.  Only the aggregates are kept
between cycles (one row per operator name), so a run with many cycles costs no more memory than one.

Rows are host events (operators, ``record_function`` ranges such as ``zero3.*`` fetches); the
``ProfilerStep#N`` ranges are not rows but give the step time.  "Self" time is an event's duration
less that of the events directly nested in it on the same thread.  Device kernels are in the trace,
not in this table.  FLOPs are the ones torch counts (matrix multiplications and convolutions, with
``with_flops``): not attention kernels such as SDPA, and recomputation counts again, so the achieved
FLOP/s here is not model FLOPs utilisation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..config import SUMMARY_SORT_KEYS
from ..outputs import STEP_RANGE_PREFIX

__all__ = ["OperatorSummary", "OperatorTotals", "si_number"]

_NS_PER_MS = 1e6


def si_number(value: float) -> str:
    """``1234567`` -> ``"1.23M"``: a count in thousands, millions, ... with three significant digits."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


@dataclass
class OperatorTotals:
    """One operator's totals over every recorded cycle."""

    count: int = 0
    total_ns: int = 0
    self_ns: int = 0
    flops: int = 0

    def sort_value(self, key: str) -> float:
        """The value of one of ``SUMMARY_SORT_KEYS``."""
        return {
            "self_cpu_time_total": self.self_ns,
            "cpu_time_total": self.total_ns,
            "count": self.count,
            "flops": self.flops
        }[key]


def _host_events(events: Any) -> List[Tuple[int, int, int, str, int]]:
    """(thread, start ns, end ns, name, flops) of the synchronous host events, sorted per thread by start."""
    rows = []
    for event in events:
        if event.device_type().name != "CPU" or event.is_async() or event.is_python_function():
            continue
        start = event.start_ns()
        rows.append((event.start_thread_id(), start, start + event.duration_ns(), event.name(), event.flops()))
    # Same start: the longer (outer) event first, so it becomes the parent.
    rows.sort(key=lambda row: (row[0], row[1], -row[2]))
    return rows


class OperatorSummary:
    """Per-operator totals summed over cycles, and the step time and FLOPs they cover."""

    def __init__(self, sort_by: str, row_limit: int) -> None:
        if sort_by not in SUMMARY_SORT_KEYS:
            raise ValueError(f"sort_by must be one of {', '.join(SUMMARY_SORT_KEYS)}, got {sort_by!r}")
        self.sort_by = sort_by
        self.row_limit = row_limit
        self.operators: Dict[str, OperatorTotals] = {}
        self.steps = 0
        self.step_ns = 0

    def add_cycle(self, torch_profiler: Any, renames: Mapping[str, str] = {}) -> None:  # noqa: B006 - read only
        """Add the events of a ``torch.profiler.profile`` that has stopped recording.

        ``renames`` maps ranges as recorded to their names in the trace: a step range renamed to
        another step's name counts as that step; one renamed to anything else (what ran after the last
        ``step_profiler()`` of a run that returned inside a window) is neither a step nor an operator.
        """
        self.add_events(torch_profiler.profiler.kineto_results.events(), renames)

    def add_events(self, events: Any, renames: Mapping[str, str] = {}) -> None:  # noqa: B006 - read only
        """Add raw profiler events (objects with torch's ``KinetoEvent`` methods); see ``add_cycle``."""
        operators = self.operators
        stack: List[Tuple[int, OperatorTotals]] = []  # (end ns, totals) of the open events, innermost last
        thread = None
        for event_thread, start, end, name, flops in _host_events(events):
            if event_thread != thread:
                thread, stack = event_thread, []
            while stack and stack[-1][0] <= start:
                stack.pop()
            duration = end - start
            if name.startswith(STEP_RANGE_PREFIX):  # renames are of step ranges only
                name = renames.get(name, name)
                if not name.startswith(STEP_RANGE_PREFIX):
                    continue  # the tail: not a step
                self.steps += 1
                self.step_ns += duration
                continue  # a step holds operators; it is not one
            if stack:
                stack[-1][1].self_ns -= duration
            totals = operators.get(name)
            if totals is None:
                totals = operators[name] = OperatorTotals()
            totals.count += 1
            totals.total_ns += duration
            totals.self_ns += duration
            totals.flops += flops
            stack.append((end, totals))

    @property
    def flops(self) -> int:
        """FLOPs counted over every recorded step."""
        return sum(totals.flops for totals in self.operators.values())

    def achieved_flops_per_second(self) -> Optional[float]:
        """Counted FLOPs per second of step time; None without steps or FLOPs."""
        if not self.step_ns or not self.flops:
            return None
        return self.flops / (self.step_ns / 1e9)

    def flops_lines(self, peak_tflops: Optional[float]) -> List[str]:
        """The counted operators' achieved FLOP/s per step, labelled as what it is (none without FLOPs)."""
        rate = self.achieved_flops_per_second()
        if rate is None:
            return []
        line = (f"counted-operator FLOP/s: {si_number(rate)}FLOP/s ({si_number(self.flops / self.steps)} FLOPs in "
                f"{self.step_ns / self.steps / _NS_PER_MS:.3f} ms per recorded step)")
        if peak_tflops:
            line += f", {100 * rate / (peak_tflops * 1e12):.3g}% of peak_tflops {peak_tflops:g}"
        return [line, "  torch counts matrix multiplication and convolution FLOPs only (not attention kernels such as "
                "SDPA) and counts recomputation again: this is not model FLOPs utilisation (MFU)"]

    def table(self, peak_tflops: Optional[float] = None) -> Optional[str]:
        """The top ``row_limit`` operators by ``sort_by`` as aligned text, then the FLOP/s lines (None before
        any cycle)."""
        if not self.operators:
            return None
        ranked = sorted(self.operators.items(), key=lambda item: item[1].sort_value(self.sort_by),
                        reverse=True)[:self.row_limit]
        self_total = sum(totals.self_ns for totals in self.operators.values()) or 1
        header = ("Name", "Calls", "Self host ms", "Self %", "Host total ms", "FLOPs")
        rows = [(name[:60], f"{t.count:,}", f"{t.self_ns / _NS_PER_MS:.3f}", f"{100 * t.self_ns / self_total:.1f}%",
                 f"{t.total_ns / _NS_PER_MS:.3f}", si_number(t.flops) if t.flops else "-") for name, t in ranked]
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
                 for row in [header, *rows]]
        lines.insert(1, "-" * len(lines[0]))
        lines.append(f"sorted by {self.sort_by}; {self.steps} recorded steps, {self.step_ns / _NS_PER_MS:.3f} ms")
        return "\n".join(lines + self.flops_lines(peak_tflops))
