"""Text building blocks shared by the report and the diff: wrapped prose, aligned tables, rank ranges, and the
files a run's reading could not use, summarised."""
from __future__ import annotations

import textwrap
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..units import rank_ranges

__all__ = ["cell", "counted", "percent", "table", "unread_files", "wrap"]

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


_FILES_NAMED = 3  # files named one per line in a kind of finding; more of one kind are one line naming the first


def _incomplete(entries: Sequence[Mapping[str, Any]]) -> List[str]:
    """The missing and incomplete files, one line per file where a kind has few; a kind (what, reason) with more
    is one line: how many, their ranks and the first few named (2,000 empty files of ranks beyond the world are
    one line, not 2,000)."""
    kinds: Dict[Tuple[str, str], List[Mapping[str, Any]]] = {}
    for entry in entries:
        what = {"trace": "trace", "hang": "hang file"}.get(entry["kind"], f"records of engine {entry['engine']}")
        kinds.setdefault((what, entry["reason"]), []).append(entry)
    lines = []
    for (what, reason), found in kinds.items():
        if len(found) <= _FILES_NAMED:
            lines += [f"  {what}, rank {entry['rank']}" + (f" ({entry['file']})" if entry["file"] else "") + f": {reason}"
                      for entry in found]
            continue
        files = [entry["file"] for entry in found if entry["file"]]
        named = f"; {', '.join(files[:_FILES_NAMED])}{', ...' if len(files) > _FILES_NAMED else ''}" if files else ""
        noun = "files" if files else "ranks"
        lines += wrap(f"  {what}: {len(found):,} {noun} of ranks {rank_ranges(entry['rank'] for entry in found)} "
                      f"({reason}{named})")
    return lines


def unread_files(incomplete: Sequence[Mapping[str, Any]], problems: Sequence[Mapping[str, Any]]) -> List[str]:
    """The report's ``incomplete`` files and bad lines (``problems``) as text, a kind of finding with many files in
    one line, so that thousands of empty or damaged files never flood the report."""
    lines = ["MISSING OR INCOMPLETE:", *_incomplete(incomplete)] if incomplete else []
    for found in problems[:_FILES_NAMED]:
        lines.extend(f"{found['file']}: {message}" for message in found["first"])
        if found["count"] > len(found["first"]):
            lines.append(f"{found['file']}: ... and {found['count'] - len(found['first'])} more problems")
    if len(problems) > _FILES_NAMED:
        more = problems[_FILES_NAMED:]
        lines.append(f"... and {sum(found['count'] for found in more):,} problems in {len(more):,} more files "
                     "(every file: --json)")
    return lines
