"""``diff --plot``: the two runs side by side as a PNG (matplotlib, imported only here).

Per engine, two panels: the step time of every recorded train step of each run (the mean over ranks),
warm-up shaded, so a drift or a few slow steps show beside a shift of the whole run; and the mean step
of each run after warm-up as a bar split into busy time, fetch wait and blocking collective wait (means:
the parts stack up to the step), so the change is seen where it happened.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ..report.build import ReportError
from .summary import PARTS

__all__ = ["plot_diff"]

_PART_LABELS = {"busy_ms": "busy", "fetch_wait_ms": "fetch wait", "collective_wait_ms": "blocking collective wait"}
_RUN_COLORS = {"base": "tab:blue", "new": "tab:orange"}


def _series(axes: Any, engine: Mapping[str, Any]) -> None:
    for run in ("base", "new"):
        side = engine["series"][run]
        runs = side if isinstance(side, list) else [side]
        for index, series in enumerate(runs):
            values = series["step_ms"]
            axes.plot(range(len(values)), [value if value is not None else float("nan") for value in values],
                      color=_RUN_COLORS[run], linewidth=1, label=run.upper() if index == 0 else None)
        warmup = engine["warmup_steps"][run] // len(runs)
        if warmup:
            axes.axvspan(-0.5, warmup - 0.5, color=_RUN_COLORS[run], alpha=0.08)
    axes.set_xlabel("recorded train step (shaded: warm-up, left out of the test)")
    axes.set_ylabel("step time, largest over ranks (ms)")
    axes.set_ylim(bottom=0)
    axes.legend(loc="lower right", fontsize="small", frameon=False)


def _parts(axes: Any, engine: Mapping[str, Any]) -> None:
    bottoms = [0.0, 0.0]
    for part in PARTS:
        means = [engine["parts"][part]["mean"][run] or 0.0 for run in ("base", "new")]
        axes.bar(["BASE", "NEW"], means, bottom=bottoms, label=_PART_LABELS[part], width=0.6)
        bottoms = [bottom + mean for bottom, mean in zip(bottoms, means)]
    axes.set_ylabel("mean per step after warm-up (ms)")
    axes.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize="small", ncol=3, frameon=False)


def _named(side: Any) -> str:
    """A side's directory, or its runs' directories (several runs: a list of notes)."""
    return side["directory"] if isinstance(side, Mapping) else ", ".join(notes["directory"] for notes in side)


def plot_diff(diff: Mapping[str, Any], path: Path) -> None:
    """Per engine with train steps after warm-up in both runs, the step series and the split of the mean step."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ReportError("--plot needs matplotlib: pip install 'ds-profutils[plot]'") from None
    engines = {name: engine for name, engine in diff["engines"].items()
               if engine["step_ms"]["base"] is not None and engine["step_ms"]["new"] is not None}
    if not engines:
        raise ReportError("no engine has train steps after warm-up in both runs: nothing to plot")
    figure = Figure(figsize=(13, 4.5 * len(engines)), layout="constrained")
    panels = figure.subplots(len(engines), 2, squeeze=False, width_ratios=[3, 1])
    for (name, engine), (series, parts) in zip(engines.items(), panels):
        step_ms = engine["step_ms"]
        verdict = "beyond noise" if step_ms["significant"] else "no significant change"
        tested = "too few steps to test" if step_ms["p_value"] is None else f"p = {step_ms['p_value']:.2g}"
        series.set_title(f"engine {name}: median step {step_ms['base']:.2f} -> {step_ms['new']:.2f} ms ({verdict}, "
                         f"{tested})", loc="left", fontsize="medium")
        _series(series, engine)
        _parts(parts, engine)
    figure.suptitle(f"ds-profutils diff: BASE {_named(diff['base'])} -> NEW {_named(diff['new'])}")
    try:
        figure.savefig(path, dpi=110)
    except OSError as exc:
        raise ReportError(f"cannot write the plot to {path}: {exc.strerror}") from None
