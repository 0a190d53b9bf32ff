"""``ds-profutils diff`` as text: per engine, the verdict first, then where the change went.

Tables are the report's (:mod:`.text`); beyond ``max_ranks`` ranks, the ranks whose figures changed
most; ``--json`` has every number.
"""
from __future__ import annotations

from statistics import median
from typing import Any, List, Mapping, Optional, Sequence

from .diff_summary import PARTS
from .text import _table, _wrap, rank_ranges

__all__ = ["render_diff"]

_MIB = 2**20
_LABELS = {"step_ms": "step time", "busy_ms": "  busy", "fetch_wait_ms": "  fetch wait",
           "collective_wait_ms": "  collective wait", "peak_allocated_bytes": "memory peak MiB (highest rank)"}


def _signed(value: Optional[float], scale: float = 1.0) -> Optional[str]:
    """``+1.250``; a change that rounds to nothing is ``+0.000``, never ``-0.000``."""
    return None if value is None else f"{round(value / scale, 3) or 0.0:+.3f}"


def _percent(ratio: Optional[float]) -> Optional[str]:
    return None if ratio is None else f"{100 * (ratio - 1):+.1f}%"


def _p(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2g}"


def _scaled(value: Optional[float], scale: float) -> Optional[float]:
    return None if value is None else value / scale


def _verdict(step_ms: Mapping[str, Any]) -> str:
    if step_ms["base"] is None or step_ms["new"] is None:
        return "Step time: no train steps after warm-up in " + ("BASE" if step_ms["base"] is None else "NEW")
    change = f"{step_ms['change']:+.3f} ms, {_percent(step_ms['ratio']) or '-'}; p = {_p(step_ms['p_value'])}"
    said = (("SLOWER" if step_ms["change"] > 0 else "FASTER") + ", beyond noise" if step_ms["significant"]
            else "no significant change")
    return (f"Step time: {step_ms['base']:.3f} -> {step_ms['new']:.3f} ms median ({change}): {said}; p90 "
            f"{step_ms['p90']['base']:.3f} -> {step_ms['p90']['new']:.3f}, mean {step_ms['mean']['base']:.3f} -> "
            f"{step_ms['mean']['new']:.3f}")


def _parts(engine: Mapping[str, Any]) -> List[str]:
    rows = []
    for name, figure in [("step_ms", engine["step_ms"]), *engine["parts"].items()]:
        scale = _MIB if name == "peak_allocated_bytes" else 1.0
        mean = figure["mean"]
        mean_change = None if mean["base"] is None or mean["new"] is None else mean["new"] - mean["base"]
        rows.append((_LABELS[name], _scaled(figure["base"], scale), _scaled(figure["new"], scale),
                     _signed(figure["change"], scale), _percent(figure["ratio"]), _signed(mean_change, scale),
                     _p(figure["p_value"]), "SIGNIFICANT" if figure["significant"] else ""))
    lines = ["", *_wrap("The step and its parts (per step: the mean over ranks, ms; medians, and the change of the "
                        "means, which add up to the step's; busy = step - fetch wait - blocking collective wait):")]
    lines += _table(("", "BASE median", "NEW median", "change", "change %", "mean change", "p-value", ""), rows)
    where = engine["where"]
    if where:
        lines += _wrap("Where (per part that changed significantly, the ranks whose median changed most that way): "
                       + "; ".join(f"{_LABELS[part].strip()}: " + ", ".join(
                           f"rank {moved['rank']} {_signed(moved['change'], _MIB if part == 'peak_allocated_bytes' else 1.0)}"
                           for moved in ranks) for part, ranks in where.items() if ranks))
    if not engine["parts"].get("peak_allocated_bytes"):
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
    return _wrap("Straggler (the report's verdict): " + "; ".join(said))


_RANK_COLUMNS = ("step_ms", *PARTS)


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
    memory = "peak_allocated_bytes" in engine["parts"]
    columns = _RANK_COLUMNS + (("peak_allocated_bytes",) if memory else ())
    typical = {column: _typical(ranks, column) for column in columns}

    def apart(rank: int) -> float:
        return max(abs(ranks[rank]["change"][column] - typical[column]) / (_MIB if column == "peak_allocated_bytes"
                                                                             else 1.0)
                   for column in columns if ranks[rank]["change"][column] is not None and typical[column] is not None)

    shown = sorted(ranks) if len(ranks) <= limit else sorted(sorted(ranks, key=lambda rank: -apart(rank))[:limit])
    headers = ["rank", "BASE step", "NEW step", "step change", "busy change", "fetch wait change",
               "collective wait change", *(["memory peak change MiB"] if memory else []), "straggler"]
    base, new = set(engine["straggler"]["base"]), set(engine["straggler"]["new"])
    rows: List[Sequence[Any]] = []
    for rank in shown:
        row = ranks[rank]
        flags = "/".join(f"{run} STRAGGLER" for run, named in (("BASE", base), ("NEW", new)) if rank in named)
        rows.append((rank, row["base"]["step_ms"], row["new"]["step_ms"],
                     *(_signed(row["change"][column], _MIB if column == "peak_allocated_bytes" else 1.0)
                       for column in columns), flags))
    note = ""
    if len(ranks) > limit:
        note = (f"; {limit} of {len(ranks)} ranks shown: those whose change differs most from the typical rank's "
                "(every rank: --json)")
        rows.append(("median of all", None, None,
                     *(_signed(typical[column], _MIB if column == "peak_allocated_bytes" else 1.0)
                       for column in columns), ""))
    return ["", *_wrap(f"Ranks (median per step after warm-up, ms; change = NEW - BASE){note}:"), *_table(headers, rows)]


def _settings(differences: Sequence[Mapping[str, Any]], what: str) -> List[str]:
    if not differences:
        return []
    return _wrap(f"{what} that differ: " + "; ".join(f"{d['setting']} {d['base']} -> {d['new']}" for d in differences))


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
        lines += ["", *_wrap("Fetch events per train step (median across ranks; numel as DeepSpeed counts it; rows "
                             "whose count or size changed first, most first, then by the change of their time):")]
        rows = []
        for name, row in engine["events"].items():
            before, after = row["base"] or {}, row["new"] or {}
            rows.append((name, (row["base"] or row["new"])["numel_unit"],
                         *(_tidy(side.get(key)) for key in ("count", "numel_per_event", "bytes") for side in (before, after)),
                         before.get("time_ms"), after.get("time_ms"), _size_change(row), _signed(row["time_change_ms"])))
        lines += _table(("event", "unit", "BASE count", "NEW count", "BASE numel/event", "NEW numel/event",
                         "BASE bytes", "NEW bytes", "BASE ms", "NEW ms", "size changed", "ms change"), rows)
    if engine["collectives"]:
        lines += ["", "Blocking collectives per train step (median across ranks; the most changed first):"]
        lines += _table(("collective", "BASE count", "NEW count", "BASE ms", "NEW ms", "count changed", "ms change"),
                        [(op, _tidy((row["base"] or {}).get("count")), _tidy((row["new"] or {}).get("count")),
                          (row["base"] or {}).get("time_ms"), (row["new"] or {}).get("time_ms"), _size_change(row),
                          _signed(row["time_change_ms"])) for op, row in engine["collectives"].items()])
    return lines


def _engine(name: str, engine: Mapping[str, Any], max_ranks: int) -> List[str]:
    names = engine["engine"]
    title = name if names["base"] == names["new"] else f"{names['base']} (BASE) / {names['new']} (NEW)"
    steps, warmup = engine["steps"], engine["warmup_steps"]
    lines = ["", *_wrap(f"== engine {title}: {steps['base']:,} train steps in BASE, {steps['new']:,} in NEW; left out "
                        f"as warm-up: the first {warmup['base']} and {warmup['new']}; ranks in both: "
                        f"{rank_ranges(engine['ranks'])}")]
    lines += _wrap(_verdict(engine["step_ms"]))
    lines += _straggler(engine)
    lines += _settings(engine["settings"], "Settings")
    if engine["step_ms"]["base"] is not None and engine["step_ms"]["new"] is not None:
        lines += _parts(engine)
    lines += _ranks(engine, max_ranks)
    lines += _events(engine)
    return lines


def _operators(operators: Optional[Mapping[str, Any]]) -> List[str]:
    if not operators:
        return []
    steps = operators["steps"]
    lines = ["", *_wrap(f"Operators whose self time changed most (trace of rank {operators['rank']}; per profiled step: "
                        f"{steps['base']} in BASE, {steps['new']} in NEW; ms):")]
    late = {run: count for run, count in operators["late_events"].items() if count}
    if late:
        lines += _wrap("(" + ", ".join(f"{count:,} events of {run.upper()}" for run, count in late.items())
                       + " came too far out of order to be nested: counted as top-level)")
    lines += _table(("operator", "category", "BASE calls", "NEW calls", "BASE self ms", "NEW self ms", "change"),
                    [(row["name"], row["cat"], (row["base"] or {}).get("count"), (row["new"] or {}).get("count"),
                      (row["base"] or {}).get("self_ms"), (row["new"] or {}).get("self_ms"), _signed(row["change_ms"]))
                     for row in operators["ops"]])
    return lines


def _run_notes(run: str, notes: Mapping[str, Any]) -> List[str]:
    said = []
    if notes["incomplete"]:
        files = len(notes["incomplete"])
        said.append(f"{files} {'file' if files == 1 else 'files'} missing, incomplete or left out")
    if notes["problems"]:
        said.append(f"{notes['problems']:,} bad lines skipped")
    if not said:
        return []
    return _wrap(f"{run}: {'; '.join(said)} (ds-profutils report {notes['directory']} names them)")


def render_diff(diff: Mapping[str, Any], max_ranks: int = 8) -> str:
    """The comparison as text, at most ``max_ranks`` ranks per table."""
    lines = [f"ds-profutils diff: BASE {diff['base']['directory']} -> NEW {diff['new']['directory']}"]
    lines += _wrap(f"Test: {diff['test']['text']}.")
    lines += _run_notes("BASE", diff["base"]) + _run_notes("NEW", diff["new"])
    if diff["matched_by"] != "name":
        pair = next(iter(diff["engines"].values()))["engine"]
        lines += _wrap(f"Engines: {pair['base']} of BASE compared with {pair['new']} of NEW ({diff['matched_by']}).")
    for run in ("base", "new"):
        if diff["unmatched"][run]:
            lines += _wrap(f"Only in {run.upper()}, not compared: engine {', '.join(diff['unmatched'][run])}")
    lines += _settings(diff["trace_settings"], "Trace settings")
    for name, engine in diff["engines"].items():
        lines += _engine(name, engine, max_ranks)
    lines += _operators(diff["operators"])
    return "\n".join(lines)
