"""``--plot``: the report as a PNG (matplotlib, imported only here)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from .build import ReportError

__all__ = ["plot_report"]


def plot_report(report: Mapping[str, Any], path: Path) -> None:
    """Fetch-wait and all-gather time per step, one line per rank, as a PNG at ``path``."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise ReportError("--plot needs matplotlib: pip install 'ds-profutils[plot]'") from None
    figure = Figure(figsize=(10, 6), layout="constrained")
    wait_axes, gather_axes = figure.subplots(2, 1, sharex=True)
    for rank in report["ranks_summary"]:
        rows = [row for row in report["steps"] if rank in row["fetch_wait_ms"]]
        steps = [row["step"] for row in rows]
        wait_axes.plot(steps, [row["fetch_wait_ms"][rank] for row in rows], label=f"rank {rank}")
        gather_axes.plot(steps, [row["all_gather_ms"][rank] for row in rows], label=f"rank {rank}")
    wait_axes.set_ylabel("fetch wait (ms)")
    gather_axes.set_ylabel("all-gather (ms)")
    gather_axes.set_xlabel("step")
    gather_axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    wait_axes.legend(loc="upper right")
    figure.suptitle(f"ZeRO-3 fetches per step: {report['directory']}")
    figure.savefig(path)
