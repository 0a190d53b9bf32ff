"""The report as aligned text tables."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from .build import STRAGGLER_FACTOR

__all__ = ["render_text"]


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> List[str]:
    """Left-aligned first column, right-aligned others, two spaces apart."""
    cells = [list(headers)] + [[_cell(value) for value in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return [
        "  ".join(text.ljust(width) if i == 0 else text.rjust(width)
                  for i, (text, width) in enumerate(zip(row, widths))).rstrip() for row in cells
    ]


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if value < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _percent(share: Optional[float]) -> Optional[str]:
    return None if share is None else f"{100 * share:.1f}%"


def _ranks_text(ranks: Iterable[int]) -> str:
    return ", ".join(str(rank) for rank in ranks) or "none"


def _steps_shown(steps: List[Dict[str, Any]], limit: int) -> Tuple[List[Dict[str, Any]], str]:
    if len(steps) <= limit:
        return steps, ""
    slowest = sorted(steps, key=lambda row: row["fetch_wait_spread"]["max"], reverse=True)[:limit]
    return sorted(slowest, key=lambda row: row["step"]), f" ({limit} of {len(steps)} steps: the largest fetch-wait)"


def render_text(report: Mapping[str, Any], max_steps: int = 20) -> str:
    """The report as aligned text tables, at most ``max_steps`` rows in the per-step table."""
    lines = [f"ZeRO-3 fetch report: {report['directory']}"]
    if report["world_size"] is not None:
        lines.append(f"ranks with records: {_ranks_text(report['ranks'])} of {report['world_size']}")
        if report["missing_ranks"]:
            lines.append(f"MISSING ranks (no file or no complete record): {_ranks_text(report['missing_ranks'])}")
    for rank, found in sorted(report["problems"].items()):
        extra = found["count"] - len(found["first"])
        lines.extend(f"rank {rank}: {message}" for message in found["first"])
        if extra > 0:
            lines.append(f"rank {rank}: ... and {extra} more problems")

    for mode, events in report["events"].items():
        lines += ["", f"Events ({mode} records; totals per rank; numel as DeepSpeed counts it: shard or full):"]
        lines += _table(("event", "numel unit", "count", "numel", "bytes", "time ms min", "median", "max", "slowest"),
                        [(name, row["numel_unit"], row["count"], row["numel"], row["bytes"], row["time_ms"]["min"],
                          row["time_ms"]["median"], row["time_ms"]["max"], f"rank {row['time_ms']['slowest_rank']}")
                         for name, row in events.items()])

    summary = report["ranks_summary"]
    if report["steps"]:
        lines += ["", "Ranks (train steps; share = time waiting for fetches / step time; 0% = fully overlapped):"]
        lines += _table(("rank", "hosts", "steps", "fetch-wait ms/step (median)", "step ms (median)", "share", ""),
                        [(rank, ",".join(row["hosts"]), row["steps"], row["fetch_wait_ms_median"],
                          row["step_ms_median"], _percent(row["fetch_wait_share"]),
                          f"STRAGGLER (>{STRAGGLER_FACTOR}x the median of all ranks)" if row["straggler"] else "")
                         for rank, row in summary.items()])
        shown, note = _steps_shown(report["steps"], max_steps)
        lines += ["", f"Steps (fetch-wait ms across ranks){note}:"]
        lines += _table(("step", "global step", "fetch-wait min", "median", "max", "slowest", "max share"),
                        [(row["step"], row["global_step"], row["fetch_wait_spread"]["min"],
                          row["fetch_wait_spread"]["median"], row["fetch_wait_spread"]["max"],
                          f"rank {row['fetch_wait_spread']['slowest_rank']}", _percent(row["fetch_wait_share_max"]))
                         for row in shown])
    elif report["world_size"] is not None:
        lines += ["", "No train steps recorded."]

    for rank, trace in sorted(report["traces"].items()):
        step_ms = trace["step_ms"]
        steps = (f"{len(trace['steps'])} profiler steps, step ms median {step_ms['median']:.3f}, "
                 f"max {step_ms['max']:.3f}" if step_ms else "no ProfilerStep# events")
        lines += ["", f"Trace of rank {rank} ({Path(trace['file']).name}, {trace['events']:,} events): {steps}"]
        lines += _table(("top ops by total time", "category", "count", "total ms"),
                        [(op["name"], op["cat"], op["count"], op["total_ms"]) for op in trace["top_ops"]])
    return "\n".join(lines)
