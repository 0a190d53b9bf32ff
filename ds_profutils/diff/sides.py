"""The two sides of ``ds-profutils diff``: each one run directory or several (reruns of one configuration).

``BASE`` and ``NEW`` are each a directory, a comma-separated list of them, or ``@FILE`` naming a file that
lists one per line (for names with commas).  Each run is summarized alone (:mod:`.summary`); a side keeps,
per engine found in every one of its runs, the runs' summaries, so that the test can see each run's mean
(:func:`.stats.compare_runs`: between runs where both sides have several), and per rank the median of the
runs' medians.
"""
from __future__ import annotations

from pathlib import Path
from statistics import median
from typing import Any, Dict, List, Mapping, Sequence

from ..report.build import ReportError
from .settings import settings_differences
from .summary import summarize_run

__all__ = ["read_side", "run_directories"]


def run_directories(argument: str) -> List[Path]:
    """The run directories one side names: ``A``, ``A1,A2,A3``, or ``@FILE`` (one per line, blank lines and
    lines starting with ``#`` skipped)."""
    if argument.startswith("@"):
        listing = Path(argument[1:])
        try:
            lines = listing.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ReportError(f"cannot read the list of runs {listing}: {exc.strerror or exc}") from None
        names = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not names:
            raise ReportError(f"the list of runs {listing} names no directory")
    else:
        names = [name.strip() for name in argument.split(",") if name.strip()]  # "A, B" as typed
        if not names:
            raise ReportError(f"no run directory in {argument!r}")
    return [Path(name) for name in names]


def _median_of(values: Sequence[Any]) -> Any:
    known = [value for value in values if value is not None]
    return median(known) if known else None


def _merged_figures(runs: Sequence[Mapping[str, Mapping[str, Any]]]) -> Dict[str, Dict[str, Any]]:
    """Per event (or collective) in any run, each per-step figure's median over the runs that have it."""
    merged: Dict[str, Dict[str, Any]] = {}
    for name in dict.fromkeys(name for run in runs for name in run):
        rows = [run[name] for run in runs if name in run]
        merged[name] = {key: rows[0][key] if isinstance(rows[0][key], str)
                        else _median_of([row.get(key) for row in rows]) for key in rows[0]}
    return merged


def _engine(runs: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """One engine of a side: its runs' summaries, and what the text shows per side (the runs' figures merged)."""
    ranks = sorted(set.intersection(*(set(run["ranks"]) for run in runs)))
    named = [rank for rank in dict.fromkeys(rank for run in runs for rank in run["stragglers"])
             if 2 * sum(rank in run["stragglers"] for run in runs) > len(runs)]
    return {
        "runs": list(runs),
        "global_steps": [step for run in runs for step in run["global_steps"]],
        "warmup": sum(run["warmup"] for run in runs),
        "ranks": {rank: {name: _median_of([run["ranks"][rank][name] for run in runs]) for name in runs[0]["ranks"][rank]}
                  for rank in ranks},
        "stragglers": named,  # named in more than half of the side's runs
        "straggler_runs": [list(run["stragglers"]) for run in runs],
        "straggler_hosts": list(dict.fromkeys(host for run in runs for host in run["straggler_hosts"])),
        "straggler_steps": {rank: sum(run["straggler_steps"].get(rank) or 0 for run in runs) for rank in named},
        "events": _merged_figures([run["events"] for run in runs]),
        "collectives": _merged_figures([run["collectives"] for run in runs]),
        "series": runs[0]["series"] if len(runs) == 1 else [run["series"] for run in runs],
        # one configuration per side: the first run's advice and config values stand for it
        "advice": runs[0]["advice"],
        "config": runs[0]["config"],
        "pipelines": [run["pipeline"] for run in runs],  # each run's stages, compared as the step time is
    }


def _not_reruns(runs: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """The side's runs whose settings differ from its first run's (per engine both have, and the traces'): a side
    is reruns of one configuration, and its test pools them."""
    first, found = runs[0], []
    for run in runs[1:]:
        for scope in [scope for scope in first["settings"] if scope in run["settings"]]:  # in the first run's order
            differences = settings_differences(first["settings"][scope], run["settings"][scope])
            if differences:
                found.append({"run": run["directory"], "of": first["directory"], "scope": scope,
                              "differences": differences})
    return found


def read_side(directories: Sequence[Path], top_ops: int) -> Dict[str, Any]:
    """One side's runs summarized and merged: per engine in every run, :func:`_engine`; the first run's traces and
    settings (a side is one configuration: ``not_reruns`` says where its runs differ); the runs' notes."""
    runs = [summarize_run(directory, top_ops) for directory in directories]
    names = [name for name in runs[0]["engines"] if all(name in run["engines"] for run in runs)]
    return {
        "runs": runs,
        "engines": {name: _engine([run["engines"][name] for run in runs]) for name in names},
        # per engine in some of the side's runs only, the runs without it
        "partial_engines": {name: [run["directory"] for run in runs if name not in run["engines"]]
                            for name in dict.fromkeys(n for run in runs for n in run["engines"]) if name not in names},
        "not_reruns": _not_reruns(runs),
        "traces": runs[0]["traces"],
        "settings": runs[0]["settings"],
    }
