"""``ds-profutils diff`` as text: per engine, the verdict first, then where the change went.

Tables are the report's (:mod:`ds_profutils.report.tables`); beyond ``max_ranks`` ranks, the ranks whose change differs
most from the typical rank's; ``--json`` has every number.
"""
from __future__ import annotations

from statistics import median
from typing import Any, List, Mapping, Optional, Sequence

from ..diagnosis.checked import checked_lines
from .stages import stage_lines
from .stats import verdict_words
from .summary import MEMORY, PARTS
from ..report.tables import rank_ranges, table, wrap
from ..units import flops_rate, share

__all__ = ["render_diff"]

_MIB = 2**20
_LABELS = {"step_ms": "step time", "step_ms_mean_over_ranks": "step, mean over ranks", "busy_ms": "  busy",
           "fetch_wait_ms": "  fetch wait", "collective_wait_ms": "  collective wait",
           MEMORY: "memory peak MiB (highest rank)", "iteration_ms": "iteration", "gap_ms": "gap"}
_WITHIN = "one run per side: this sees changes beyond within-run noise; offsets between nodes or reruns need several runs per side"


def _shown(value: Optional[float], column: str = "step_ms") -> Optional[float]:
    """A figure in the unit it is shown in: ms, or MiB for the memory peak."""
    return None if value is None else value / (_MIB if column == MEMORY else 1.0)


def _signed(value: Optional[float], column: str = "step_ms") -> Optional[str]:
    """A change as ``+1.250`` (in ``column``'s unit); one that rounds to nothing is ``+0.000``, never ``-0.000``."""
    value = _shown(value, column)
    return None if value is None else f"{round(value, 3) or 0.0:+.3f}"


def _percent(ratio: Optional[float]) -> Optional[str]:
    return None if ratio is None else f"{100 * (ratio - 1):+.1f}%"


def _p(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2g}"


def _verdict(step_ms: Mapping[str, Any]) -> str:
    if step_ms["base"] is None or step_ms["new"] is None:
        return "Step time: no train steps after warm-up in " + ("BASE" if step_ms["base"] is None else "NEW")
    change = f"{step_ms['change']:+.3f} ms, {_percent(step_ms['ratio']) or '-'}; p = {_p(step_ms['p_value'])}"
    seen = f" ({_WITHIN})" if step_ms["method"] == "within runs" else ""
    return (f"Step time (per step the largest over ranks: the step the job took): {step_ms['base']:.3f} -> "
            f"{step_ms['new']:.3f} ms median ({change}): {verdict_words(step_ms)}{seen}; p90 "
            f"{step_ms['p90']['base']:.3f} -> {step_ms['p90']['new']:.3f}, mean {step_ms['mean']['base']:.3f} -> "
            f"{step_ms['mean']['new']:.3f}{_drift(step_ms)}")


def _iteration(engine: Mapping[str, Any]) -> List[str]:
    """What a user's iteration lost (or won): the whole optimizer step, data loading and callbacks included,
    split into the step and the gap between steps; the throughput beside it."""
    found = engine["iteration"]
    if "iteration_ms" not in found:
        return []
    whole, gap = found["iteration_ms"], found.get("gap_ms")
    said = (f"Iteration (end of one optimizer step to the end of the next: what each step cost the user, data "
            f"loading, callbacks and logging included; per step the largest over ranks): {whole['base']:.3f} -> "
            f"{whole['new']:.3f} ms median ({whole['change']:+.3f} ms, {_percent(whole['ratio']) or '-'}; p = "
            f"{_p(whole['p_value'])}): {verdict_words(whole)}; the step {engine['step_ms']['change']:+.3f} ms")
    if gap is not None:
        said += (f" and the gap between steps (outside forward, backward and step; largest over ranks) "
                 f"{gap['change']:+.3f} ms ({verdict_words(gap)})")
    for name, label, shown in (("tflops", "TFLOP/s per rank, mean over ranks", flops_rate),
                               ("mfu", "MFU, mean over ranks", share)):
        if name in found:
            figure = found[name]
            said += (f"; {label} {shown(figure['base'])} -> {shown(figure['new'])} "
                     f"({verdict_words(figure, 'HIGHER', 'LOWER')})")
    return wrap(said)


def _drift(figure: Mapping[str, Any]) -> str:
    """The figures the test used: the runs' lag-1 autocorrelation, each side's effective steps out of its steps,
    and, with several runs per side, the runs."""
    if figure["p_value"] is None:
        return ""
    lag1 = figure["autocorrelation"]
    said = [f"{run.upper()} {figure['effective_steps'][run]:.1f} effective of {figure['steps'][run]} steps"
            + (f" in {figure['runs'][run]} runs" if figure["runs"][run] > 1 else "") for run in ("base", "new")]
    method = "; between runs: the runs' means compared" if figure["method"] == "between runs" else ""
    return (f"; tested on autocorrelation {'-' if lag1 is None else f'{lag1:.2f}'}, " + " and ".join(said)
            + f"{method} (p < {figure['alpha']:g} needed)")


def _parts(engine: Mapping[str, Any]) -> List[str]:
    rows = []
    parts = [(name, figure) for name, figure in engine["parts"].items() if name != "fetch_wait_ms" or engine["events"]]
    for name, figure in [("step_ms_mean_over_ranks", engine["step_ms_mean_over_ranks"]), *parts]:
        mean = figure["mean"]
        mean_change = None if mean["base"] is None or mean["new"] is None else mean["new"] - mean["base"]
        rows.append((_LABELS[name], _shown(figure["base"], name), _shown(figure["new"], name),
                     _signed(figure["change"], name), _percent(figure["ratio"]), _signed(mean_change, name),
                     _p(figure["p_value"]), "SIGNIFICANT" if figure["significant"] else ""))
    waits = "fetch wait - blocking collective wait" if engine["events"] else "blocking collective wait"
    lines = ["", *wrap("The step and its parts (per step: the mean over ranks, ms; medians, and the change of the "
                        f"means, which add up to the step's; busy = step - {waits}):")]
    lines += table(("", "BASE median", "NEW median", "change", "change %", "mean change", "p-value", ""), rows)
    where = engine["where"]
    if where:
        lines += wrap("Where (per figure that changed significantly, the ranks whose own median changed most that "
                      "way, as that rank saw it): "
                       + "; ".join(f"{_LABELS[part].strip()}: " + ", ".join(
                           f"rank {moved['rank']} {_signed(moved['change'], part)}" for moved in ranks)
                                   for part, ranks in where.items() if ranks))
    if MEMORY not in engine["parts"]:
        which = [run.upper() for run, has in engine["memory"].items() if not has]
        lines.append(f"No memory peak: the records of {' and '.join(which)} carry no memory figures.")
    return lines


def _straggler(engine: Mapping[str, Any]) -> List[str]:
    straggler = engine["straggler"]
    said = []
    for run in ("base", "new"):
        ranks = straggler[run]
        counts = straggler["straggler_steps"][run]
        named = ", ".join(f"rank {rank}" + (f" (the step straggler in {counts[rank]} of {engine['steps'][run]} steps)"
                                            if counts.get(rank) is not None else "") for rank in ranks) or "none"
        hosts = straggler["hosts"][run]
        said.append(f"{run.upper()} {named}" + (f"; host {', '.join(hosts)}" if hosts and not ranks else ""))
    return wrap("Straggler (the report's verdict): " + "; ".join(said))


_RANK_COLUMNS = ("step_ms", *PARTS)
_ITERATION_COLUMNS = ("iteration_ms", "gap_ms")  # where the records carry them
_RANK_HEADERS = {"step_ms": "step change", "busy_ms": "busy change", "fetch_wait_ms": "fetch wait change",
                 "collective_wait_ms": "collective wait change", MEMORY: "memory peak change MiB",
                 "iteration_ms": "iteration change", "gap_ms": "gap change"}


def _typical(ranks: Mapping[int, Mapping[str, Any]], column: str) -> Optional[float]:
    """The median change of ``column`` across ranks."""
    changes = [row["change"][column] for row in ranks.values() if row["change"][column] is not None]
    return median(changes) if changes else None


def _ranks(engine: Mapping[str, Any], limit: int) -> List[str]:
    """Every rank up to ``limit``; beyond, those whose change differs most from the typical rank's (a slowed
    rank got busier where all the others waited), and the median change of all ranks."""
    ranks = engine["ranks"]
    if not ranks:
        return []
    memory = MEMORY in engine["parts"]
    iteration = tuple(column for column in _ITERATION_COLUMNS
                      if any(row["change"].get(column) is not None for row in ranks.values()))
    columns = tuple(column for column in _RANK_COLUMNS if column != "fetch_wait_ms" or engine["events"])
    columns += ((MEMORY,) if memory else ()) + iteration
    typical = {column: _typical(ranks, column) for column in columns}

    def apart(rank: int) -> float:
        return max(abs(_shown(ranks[rank]["change"][column] - typical[column], column)) for column in columns
                   if ranks[rank]["change"][column] is not None and typical[column] is not None)

    shown = sorted(ranks) if len(ranks) <= limit else sorted(sorted(ranks, key=lambda rank: -apart(rank))[:limit])
    headers = ["rank", "BASE step", "NEW step", *(_RANK_HEADERS[column] for column in columns), "straggler"]
    base, new = set(engine["straggler"]["base"]), set(engine["straggler"]["new"])
    rows: List[Sequence[Any]] = []
    for rank in shown:
        row = ranks[rank]
        flags = "/".join(f"{run} STRAGGLER" for run, named in (("BASE", base), ("NEW", new)) if rank in named)
        rows.append((rank, row["base"]["step_ms"], row["new"]["step_ms"],
                     *(_signed(row["change"][column], column) for column in columns), flags))
    note = ""
    if len(ranks) > limit:
        note = (f"; {limit} of {len(ranks)} ranks shown: those whose change differs most from the typical rank's "
                "(every rank: --json)")
        rows.append(("median of all", None, None, *(_signed(typical[column], column) for column in columns), ""))
    caption = wrap(f"Ranks (median per step after warm-up, ms; change = NEW - BASE){note}:")
    return ["", *caption, *table(headers, rows)]


def _settings(differences: Sequence[Mapping[str, Any]], what: str) -> List[str]:
    if not differences:
        return []
    return wrap(f"{what} that differ: " + "; ".join(f"{d['setting']} {d['base']} -> {d['new']}" for d in differences))


def _size_change(row: Mapping[str, Any]) -> str:
    if row["base"] is None:
        return "NEW only"
    if row["new"] is None:
        return "BASE only"
    return f"{100 * row['size_change']:.0f}%"


def _tidy(value: Any) -> Any:
    """A per-step figure that is whole (a count, usually) shown without decimals."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _events(engine: Mapping[str, Any]) -> List[str]:
    lines = []
    if engine["events"]:
        lines += ["", *wrap("Fetch events per train step (each rank's mean over every recorded train step, warm-up "
                             "included, the median across ranks; numel as DeepSpeed counts it; rows whose count or "
                             "size changed first, most first, then by the change of their time):")]
        rows = []
        for name, row in engine["events"].items():
            before, after = row["base"] or {}, row["new"] or {}
            sizes = (_tidy(side.get(key)) for key in ("count", "numel_per_event", "bytes") for side in (before, after))
            rows.append((name, (row["base"] or row["new"])["numel_unit"], *sizes, before.get("time_ms"),
                         after.get("time_ms"), _size_change(row), _signed(row["time_change_ms"])))
        lines += table(("event", "unit", "BASE count", "NEW count", "BASE numel/event", "NEW numel/event",
                         "BASE bytes", "NEW bytes", "BASE ms", "NEW ms", "size changed", "ms change"), rows)
    if engine["collectives"]:
        lines += ["", *wrap("Blocking collectives per train step (each rank's mean over every recorded train step, "
                             "warm-up included, the median across ranks; the most changed first):")]
        rows = []
        for op, row in engine["collectives"].items():
            before, after = row["base"] or {}, row["new"] or {}
            rows.append((op, _tidy(before.get("count")), _tidy(after.get("count")), before.get("time_ms"),
                         after.get("time_ms"), _size_change(row), _signed(row["time_change_ms"])))
        lines += table(("collective", "BASE count", "NEW count", "BASE ms", "NEW ms", "count changed", "ms change"),
                        rows)
    return lines


def _engine(name: str, engine: Mapping[str, Any], max_ranks: int) -> List[str]:
    names = engine["engine"]
    title = name if names["base"] == names["new"] else f"{names['base']} (BASE) / {names['new']} (NEW)"
    steps, warmup = engine["steps"], engine["warmup_steps"]
    lines = ["", *wrap(f"== engine {title}: {steps['base']:,} train steps in BASE, {steps['new']:,} in NEW; left out "
                        f"as warm-up: the first {warmup['base']} and {warmup['new']}; ranks in both: "
                        f"{rank_ranges(engine['ranks'])}")]
    lines += wrap(_verdict(engine["step_ms"]))
    if engine["step_ms"]["change"] is not None:
        lines += _iteration(engine)
    lines += _straggler(engine)
    lines += _settings(engine["settings"], "Settings")
    if engine["step_ms"]["base"] is not None and engine["step_ms"]["new"] is not None:
        lines += _parts(engine)
    lines += _ranks(engine, max_ranks)
    lines += stage_lines(engine.get("stages"))
    lines += _events(engine)
    lines += [part for line in checked_lines(engine.get("advice_checked", [])) for part in wrap(line)]
    return lines


def _operators(operators: Optional[Mapping[str, Any]]) -> List[str]:
    if not operators:
        return []
    steps = operators["steps"]
    lines = ["", *wrap(f"Operators whose self time changed most (trace of rank {operators['rank']}; per profiled "
                        f"step: {steps['base']} in BASE, {steps['new']} in NEW; ms):")]
    late = {run: count for run, count in operators["late_events"].items() if count}
    if late:
        lines += wrap("(" + ", ".join(f"{count:,} events of {run.upper()}" for run, count in late.items())
                       + " came too far out of order to be nested: counted as top-level)")
    rows = []
    for row in operators["ops"]:
        before, after = row["base"] or {}, row["new"] or {}
        rows.append((row["name"], row["cat"], _tidy(before.get("count")), _tidy(after.get("count")),
                     before.get("self_ms"), after.get("self_ms"), _signed(row["change_ms"])))
    lines += table(("operator", "category", "BASE calls", "NEW calls", "BASE self ms", "NEW self ms", "change"), rows)
    return lines


def _run_notes(run: str, notes: Mapping[str, Any]) -> List[str]:
    said = []
    if notes["incomplete"]:
        files = len(notes["incomplete"])
        said.append(f"{files} {'file' if files == 1 else 'files'} missing, incomplete or left out")
    if notes["problems"]:
        said.append(f"{notes['problems']:,} bad lines skipped")
    if notes["superseded"]:
        said.append(f"resumed: {notes['superseded']:,} records of steps recorded again later superseded (each step "
                    "from its latest segment)")
    if not said:
        return []
    return wrap(f"{run}: {'; '.join(said)} (ds-profutils report {notes['directory']} names them)")


def _runs(side: Any) -> List[Mapping[str, Any]]:
    """A side's notes per run (one run's notes are a mapping, several runs' a list)."""
    return [side] if isinstance(side, Mapping) else list(side)


def _directories(side: Any) -> str:
    runs = _runs(side)
    named = ", ".join(notes["directory"] for notes in runs)
    return named if len(runs) == 1 else f"{len(runs)} runs ({named})"


def render_diff(diff: Mapping[str, Any], max_ranks: int = 8) -> str:
    """The comparison as text, at most ``max_ranks`` ranks per table."""
    lines = [f"ds-profutils diff: BASE {_directories(diff['base'])} -> NEW {_directories(diff['new'])}"]
    lines += [line for warning in diff["warnings"] for line in wrap(f"WARNING: {warning}.")]
    lines += wrap(f"Test: {diff['test']['text']}.")
    lines += [line for run in ("base", "new") for notes in _runs(diff[run]) for line in _run_notes(run.upper(), notes)]
    if diff["matched_by"] != "name":
        pair = next(iter(diff["engines"].values()))["engine"]
        lines += wrap(f"Engines: {pair['base']} of BASE compared with {pair['new']} of NEW ({diff['matched_by']}).")
    for run in ("base", "new"):
        if diff["unmatched"][run]:
            lines += wrap(f"Only in {run.upper()}, not compared: engine {', '.join(diff['unmatched'][run])}")
        for name, missing in diff["partial"][run].items():
            lines += wrap(f"Not compared: engine {name}, missing from {run.upper()}'s run {', '.join(missing)}")
    lines += _settings(diff["trace_settings"], "Trace settings")
    for name, engine in diff["engines"].items():
        lines += _engine(name, engine, max_ranks)
    lines += _operators(diff["operators"])
    return "\n".join(lines)
