"""The diff's check of BASE's advice: where NEW changed a key BASE's advice named, did the figure the advice
expected to move, move that way, beyond what the diff's test calls noise?

``figure`` is a path into the diff's engine (``engines.{name}``): ``step_ms``; a part of the step
(``parts``: ``busy_ms``, ``fetch_wait_ms``, ``collective_wait_ms``, ``peak_allocated_bytes``); an iteration
figure (``iteration``: ``iteration_ms``, ``gap_ms`` ...), each with the diff's own verdict (``significant``);
or ``events.{event}.count`` / ``collectives.{op}.count``, counts per step that the configuration decides and
load cannot move (the same job makes the same all-gathers every step): these are significant when they moved
by the diff's ``MIN_CHANGE`` or more.  Those are the load-proof figures the rules prefer.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

__all__ = ["advice_checked", "checked_lines"]


def _figure(engine: Mapping[str, Any], figure: str, min_change: float) -> Optional[Tuple[float, float, bool]]:
    """(BASE value, NEW value, significant) of one figure of the diff's engine; None where either run lacks it."""
    head, _, rest = figure.partition(".")
    if head in ("events", "collectives"):
        name, _, column = rest.rpartition(".")
        row = engine.get(head, {}).get(name)
        if row is None or row["base"] is None or row["new"] is None:
            return None
        before, after = row["base"][column], row["new"][column]
        return before, after, bool(before) and abs(after - before) >= min_change * abs(before)
    compared = engine.get(figure) if figure == "step_ms" else (engine.get("parts", {}).get(figure)
                                                               or engine.get("iteration", {}).get(figure))
    if compared is None or compared["base"] is None or compared["new"] is None:
        return None
    return compared["base"], compared["new"], bool(compared["significant"])


def advice_checked(advice: List[Mapping[str, Any]], base_config: Mapping[str, Any], new_config: Mapping[str, Any],
                   engine: Mapping[str, Any], min_change: float) -> List[Dict[str, Any]]:
    """Per advice of BASE whose key NEW changed: ``{key, base, new, figure, expected, change_pct, significant,
    as_expected}``; ``as_expected``: the figure moved in the expected direction and the diff's test calls it
    significant (both None where the diff lacks the figure)."""
    checked = []
    for found in advice:
        key = found["key"]
        if key is None or key not in base_config or key not in new_config or base_config[key] == new_config[key]:
            continue
        expected = found["expected"]
        values = _figure(engine, expected["figure"], min_change)
        change_pct = significant = as_expected = None
        if values is not None:
            before, after, significant = values
            change_pct = 100.0 * (after - before) / before if before else None
            moved = after < before if expected["direction"] == "lower" else after > before
            as_expected = moved and significant
        checked.append({"key": key, "base": base_config[key], "new": new_config[key], "figure": expected["figure"],
                        "expected": expected["direction"], "change_pct": change_pct, "significant": significant,
                        "as_expected": as_expected})
    return checked


def checked_lines(checked: List[Mapping[str, Any]]) -> List[str]:
    """The diff's text on BASE's advice that NEW followed (unwrapped; empty when NEW changed no advised key)."""
    lines = []
    for found in checked:
        moved = ("the diff lacks it" if found["as_expected"] is None else "from 0" if found["change_pct"] is None
                 else f"{found['change_pct']:+.1f}%")
        lines.append(f"Advice checked: {found['key']} {found['base']!r} -> {found['new']!r}: {found['figure']} "
                     f"{moved} (expected {found['expected']}): the change {_verdict(found)}.")
    return lines


def _verdict(found: Mapping[str, Any]) -> str:
    """What the check showed, in words: a move the diff's test cannot tell from noise shows nothing either way."""
    if found["as_expected"] is None:
        return "cannot be checked"
    if found["as_expected"]:
        return "did what the advice said"
    change = found["change_pct"]
    if change is None:  # from 0: no share of it to weigh
        return "cannot be checked"
    expected_way = change != 0 and (change < 0) == (found["expected"] == "lower")
    if not found["significant"]:
        return ("moved it the expected way, within the diff's noise: not shown to help (more steps, or several runs "
                "a side, would tell)" if expected_way else "did not move it beyond the diff's noise")
    return "did NOT do what the advice said: it moved the other way"
