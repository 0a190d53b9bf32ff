"""``--plot``: the report as a PNG that reads the same at 2 ranks and at 1024 (matplotlib, imported only here).

Per engine, two panels: a rank x step heatmap of exposed wait (or busy time), with each step's
straggler marked, and per rank the mean train step split into busy time, fetch wait and other blocking
collectives (means, not medians: the parts add up to the step), flagged stragglers marked.  A heatmap has no line per rank, so it stays readable however
many ranks there are; the markers keep a single straggler visible when its row is thinner than a
pixel.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from .build import ReportError
from .steps import StepView

__all__ = ["plot_report"]

_LABELS = {"exposed_wait_ms": "exposed wait (ms)", "busy_ms": "busy time (ms)"}


def _heatmap(axes: Any, figure: Any, view: StepView, metric: str) -> None:
    import numpy
    from matplotlib import colormaps

    matrix = getattr(view, metric)
    values = numpy.frombuffer(matrix.values, dtype=numpy.float64).reshape(matrix.ranks, matrix.steps)
    colors = colormaps["viridis"].with_extremes(bad="lightgrey")  # grey: no record of that step
    image = axes.imshow(values, aspect="auto", interpolation="nearest", origin="lower", cmap=colors,
                        extent=(-0.5, matrix.steps - 0.5, -0.5, matrix.ranks - 0.5))
    figure.colorbar(image, ax=axes, label=_LABELS[metric], pad=0.01)
    marked = [(index, view.ranks.index(rank)) for index, rank in enumerate(view.straggler) if rank is not None]
    if marked:
        axes.scatter([index for index, _ in marked], [row for _, row in marked], s=12, marker="x", color="red",
                     linewidths=1, label="step straggler (least exposed wait)")
        axes.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize="small", frameon=False)
    _rank_ticks(axes.yaxis, view)
    _step_ticks(axes.xaxis, view)
    axes.set_ylabel("rank")
    axes.set_xlabel("global step")


def _rank_ticks(axis: Any, view: StepView) -> None:
    """Rank numbers (not row positions) on the axis, at most a dozen of them."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    axis.set_major_locator(MaxNLocator(12, integer=True))
    axis.set_major_formatter(FuncFormatter(lambda row, _: str(view.ranks[int(row)])
                                           if 0 <= int(row) < len(view.ranks) and row == int(row) else ""))


def _step_ticks(axis: Any, view: StepView) -> None:
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    axis.set_major_locator(MaxNLocator(12, integer=True))
    axis.set_major_formatter(FuncFormatter(lambda index, _: str(view.global_steps[int(index)])
                                           if 0 <= int(index) < len(view.global_steps) and index == int(index) else ""))


def _breakdown(axes: Any, engine: Mapping[str, Any], view: StepView) -> None:
    summary = engine["ranks_summary"]
    rows = range(len(view.ranks))
    parts = (("busy_ms_mean", "busy", "tab:blue"), ("fetch_wait_ms_mean", "fetch wait", "tab:orange"),
             ("collective_wait_ms_mean", "other blocking collectives", "tab:green"))
    bottom = [0.0] * len(view.ranks)
    width = 0.8 if len(view.ranks) <= 64 else 1.0  # touching bars read as areas at scale
    for key, label, color in parts:
        heights = [summary[rank][key] or 0.0 for rank in view.ranks]
        axes.bar(rows, heights, width=width, bottom=bottom, label=label, color=color, linewidth=0)
        bottom = [b + h for b, h in zip(bottom, heights)]
    top = max(bottom, default=0.0)
    flagged = [row for row, rank in enumerate(view.ranks) if summary[rank]["straggler"]]
    if flagged:
        axes.scatter(flagged, [top * 1.05] * len(flagged), marker="v", color="red", s=40, zorder=3,
                     label="STRAGGLER (held the others back in >= half the steps)")
    _rank_ticks(axes.xaxis, view)
    axes.set_xlim(-0.5, len(view.ranks) - 0.5)
    axes.set_ylim(0, top * 1.12 or 1.0)
    axes.set_xlabel("rank")
    axes.set_ylabel("mean per train step (ms)")
    axes.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize="small", ncol=4, frameon=False)


def plot_report(report: Mapping[str, Any], path: Path, metric: str = "exposed_wait_ms") -> None:
    """Per engine with train steps, a rank x step heatmap of ``metric`` and a per-rank breakdown, as a PNG."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ReportError("--plot needs matplotlib: pip install 'ds-profutils[plot]'") from None
    engines = {name: engine for name, engine in report["engines"].items() if engine["steps"].global_steps}
    if not engines:
        raise ReportError(f"{report['directory']}: no train steps to plot")
    figure = Figure(figsize=(12, 7.5 * len(engines)), layout="constrained")
    panels = figure.subplots(2 * len(engines), 1, squeeze=False, height_ratios=[3, 2] * len(engines))[:, 0]
    for index, (name, engine) in enumerate(engines.items()):
        view = engine["steps"]
        heatmap, breakdown = panels[2 * index], panels[2 * index + 1]
        _heatmap(heatmap, figure, view, metric)
        named = ", ".join(str(rank) for rank in engine["straggler_ranks"]) or "none"
        hosts = "".join(f"; straggler host: {host}" for host in engine["straggler_hosts"])
        heatmap.set_title(f"engine {name}: {_LABELS[metric]} per rank and step ({len(view.ranks)} ranks, "
                          f"{len(view.global_steps)} steps); straggler: {named}{hosts}", loc="left",
                          fontsize="medium")
        _breakdown(breakdown, engine, view)
    figure.suptitle(f"ds-profutils report: {report['directory']}")
    try:
        figure.savefig(path, dpi=120)
    except OSError as exc:
        raise ReportError(f"cannot write the plot to {path}: {exc.strerror}") from None
