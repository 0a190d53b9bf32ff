"""``--plot``: the report as a PNG that reads the same at 2 ranks and at 1024 (matplotlib, imported only here).

Per engine, two panels: a rank x step heatmap of exposed wait (or busy time), with each step's
straggler marked, and per rank the mean train step split into busy time,
fetch wait and other blocking collectives (means, not medians: the parts add up to the step), flagged
stragglers marked.  Where the records carry memory figures, a third: a rank x step heatmap of the peak
allocated memory, with the jumps marked.  A heatmap has no line per rank, so it stays readable however
many ranks there are; the markers keep a single straggler visible when its row is thinner than a pixel.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence, Tuple

from .build import ReportError
from .steps import ARRIVAL_FIGURES, Matrix, StepView

__all__ = ["build_figure", "plot_report"]

_LABELS = {"exposed_wait_ms": "exposed wait (ms)", "busy_ms": "busy time (ms)"}
_GIB = 2**30


def _heatmap(axes: Any, figure: Any, view: StepView, matrix: Matrix, label: str, marked: Sequence[Tuple[int, int]],
             marker_label: str, scale: float = 1.0) -> None:
    """``matrix`` (divided by ``scale``) as ranks x steps cells, and markers at ``marked`` (step index, row)."""
    import numpy
    from matplotlib import colormaps

    values = numpy.frombuffer(matrix.values, dtype=numpy.float64).reshape(matrix.ranks, matrix.steps) / scale
    colors = colormaps["viridis"].with_extremes(bad="lightgrey")  # grey: no record of that step
    image = axes.imshow(values, aspect="auto", interpolation="nearest", origin="lower", cmap=colors,
                        extent=(-0.5, matrix.steps - 0.5, -0.5, matrix.ranks - 0.5))
    figure.colorbar(image, ax=axes, label=label, pad=0.01)
    if marked:
        axes.scatter([index for index, _ in marked], [row for _, row in marked], s=12, marker="x", color="red",
                     linewidths=1, label=marker_label)
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
                     label="STRAGGLER (held the others back more often than chance)")
    _rank_ticks(axes.xaxis, view)
    axes.set_xlim(-0.5, len(view.ranks) - 0.5)
    axes.set_ylim(0, top * 1.12 or 1.0)
    axes.set_xlabel("rank")
    axes.set_ylabel("mean per train step (ms)")
    axes.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize="small", ncol=4, frameon=False)


def _memory(axes: Any, figure: Any, name: str, memory: Mapping[str, Any], view: StepView) -> None:
    """Peak allocated memory per rank and step, the jumps and the highest rank's row marked (a row can be
    thinner than a pixel); the highest rank and the imbalance in the title."""
    steps = {step: index for index, step in enumerate(view.global_steps)}
    rows = {rank: row for row, rank in enumerate(view.ranks)}
    marked = [(steps[jump["global_step"]], rows[jump["rank"]]) for jump in memory["jumps"]
              if jump["global_step"] in steps and jump["rank"] in rows]
    source = "RSS" if set(memory["sources"]) == {"rss"} else "+".join(memory["sources"])
    _heatmap(axes, figure, view, view.peak_allocated_bytes, f"peak allocated (GiB, {source})", marked,
             f"jump (> {memory['jump_rule']['over_baseline_share']:.0%} over earlier steps)", _GIB)
    highest, imbalance = memory["highest_rank"], memory["imbalance"]
    if highest in rows:
        axes.scatter([len(steps) - 0.5], [rows[highest]], marker="<", color="red", s=40, zorder=3, clip_on=False)
    ratio = "" if imbalance is None else f", {imbalance:.2f}x the lowest"
    axes.set_title(f"engine {name}: peak allocated per rank and step; highest: rank {highest} (<){ratio}; "
                   f"jumps: {memory['jump_count']}", loc="left", fontsize="medium")


def build_figure(report: Mapping[str, Any], metric: str = "exposed_wait_ms") -> Any:
    """The report's figure (a matplotlib ``Figure``): per engine with train steps, a heatmap of ``metric``, the
    per-rank breakdown and, where the records carry memory figures, the memory heatmap."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ReportError("--plot needs matplotlib: pip install 'ds-profutils[plot]'") from None
    engines = {name: engine for name, engine in report["engines"].items() if engine["steps"].global_steps}
    if not engines:
        raise ReportError(f"{report['directory']}: no train steps to plot")
    kinds = [kind for engine in engines.values() for kind in (("time", "breakdown", "memory") if _has_peaks(engine)
                                                               else ("time", "breakdown"))]
    heights = {"time": 3.0, "breakdown": 2.0, "memory": 3.0}
    figure = Figure(figsize=(12, 3 * sum(heights[kind] for kind in kinds) / 2), layout="constrained")
    panels = iter(figure.subplots(len(kinds), 1, squeeze=False, height_ratios=[heights[kind] for kind in kinds])[:, 0])
    for name, engine in engines.items():
        view = engine["steps"]
        heatmap, breakdown = next(panels), next(panels)
        figure_name = ARRIVAL_FIGURES[view.arrival]
        marked = [(index, view.ranks.index(rank)) for index, rank in enumerate(view.straggler) if rank is not None]
        _heatmap(heatmap, figure, view, getattr(view, metric), _LABELS[metric], marked,
                 f"step straggler (least {figure_name})")
        named = ", ".join(str(rank) for rank in engine["straggler_ranks"]) or "none"
        hosts = "".join(f"; straggler host: {host}" for host in engine["straggler_hosts"])
        heatmap.set_title(f"engine {name}: {_LABELS[metric]} per rank and step ({len(view.ranks)} ranks, "
                          f"{len(view.global_steps)} steps); straggler: {named}{hosts}", loc="left",
                          fontsize="medium")
        _breakdown(breakdown, engine, view)
        if _has_peaks(engine):
            _memory(next(panels), figure, name, engine["memory"], view)
    figure.suptitle(f"ds-profutils report: {report['directory']}")
    return figure


def _has_peaks(engine: Mapping[str, Any]) -> bool:
    """Whether the engine's records carry step peaks to draw (not only live parameters or cache counts)."""
    return engine["memory"] is not None and engine["memory"]["highest_rank"] is not None


def plot_report(report: Mapping[str, Any], path: Path, metric: str = "exposed_wait_ms") -> None:
    """:func:`build_figure` written to ``path`` as a PNG."""
    figure = build_figure(report, metric)
    try:
        figure.savefig(path, dpi=120)
    except OSError as exc:
        raise ReportError(f"cannot write the plot to {path}: {exc.strerror}") from None
