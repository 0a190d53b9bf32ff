"""Text building blocks shared by the report and the diff: wrapped prose, aligned tables, rank ranges."""
from __future__ import annotations

import textwrap
from typing import Any, Iterable, List, Optional, Sequence

__all__ = ["cell", "counted", "percent", "rank_ranges", "table", "wrap"]

_WIDTH = 110  # prose is wrapped to this; tables are as wide as their columns


def wrap(text: str) -> List[str]:
    """Prose wrapped at the report's width, never between a number and its unit."""
    kept_together = text.replace(" ms", "\N{NO-BREAK SPACE}ms")  # textwrap breaks at ASCII whitespace only
    return [line.replace("\N{NO-BREAK SPACE}", " ")
            for line in textwrap.wrap(kept_together, _WIDTH, subsequent_indent="  ", break_on_hyphens=False)]


def counted(count: int, noun: str) -> str:
    """``1 rank``, ``2 ranks``."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> List[str]:
    """Left-aligned first column, right-aligned others, two spaces apart."""
    cells = [list(headers)] + [[cell(value) for value in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return [
        "  ".join(text.ljust(width) if i == 0 else text.rjust(width)
                  for i, (text, width) in enumerate(zip(row, widths))).rstrip() for row in cells
    ]


def cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def percent(share: Optional[float]) -> Optional[str]:
    return None if share is None else f"{100 * share:.1f}%"


def rank_ranges(ranks: Iterable[int]) -> str:
    """``0-3, 5, 7-9``: a set of ranks in a line whatever its size."""
    ordered = sorted(set(ranks))
    if not ordered:
        return "none"
    parts, start, previous = [], ordered[0], ordered[0]
    for rank in ordered[1:] + [None]:
        if rank is not None and rank == previous + 1:
            previous = rank
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if rank is not None:
            start = previous = rank
    return ", ".join(parts)


