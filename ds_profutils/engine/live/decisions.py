"""What every rank decides from an interval's exchanged rows: the same pure function of the same rows on
every rank, so no rank decides for the others and every rank acts at the same boundary (shared/DESIGN.md,
"The exchange goes both ways").

A row is a rank's packed interval (:func:`.interval.pack_interval`, or :func:`empty_row` where the rank has
no figures: its recorder failed) followed by one flags column.  Nothing here imports torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

__all__ = ["STOP", "UNREAD", "Decisions", "decide", "empty_row", "known_rows", "split_flags", "with_flags"]

STOP = 1
"""Flag bit: this rank cannot go on with the live exchange (its own live code failed), so every rank stops
exchanging at the same interval rather than leaving the others waiting in the next one."""
UNREAD = 2
"""Flag bit: nothing on this rank reads the rows (no sink, no console line, nothing riding on the exchange).
Where every rank says so, the exchange stops: a blocking all-gather every interval that nobody reads is a
cost on the step path and nothing else.  Told through the exchange, not assumed, since sinks may be given on
some ranks only (the events are rank 0's)."""
_NAN = float("nan")


@dataclass(frozen=True)
class Decisions:
    """What an interval's rows decide for every rank."""

    stop: bool  # no rank exchanges again once the decision takes effect: a rank's live figures failed
    unread: bool  # no rank reads the rows: the exchange stops as well, silently


def with_flags(values: Sequence[float], flags: int) -> List[float]:
    """A packed interval with its flags column last."""
    return [*values, float(flags)]


def empty_row(length: int) -> List[float]:
    """The figures of a rank that has none this interval: every figure unknown (NaN), same length."""
    return [_NAN] * length


def split_flags(rows: Sequence[Sequence[float]]) -> Tuple[List[List[float]], List[int]]:
    """The rows without their flags column, and each row's flags."""
    return [list(row[:-1]) for row in rows], [int(row[-1]) for row in rows]


def known_rows(rows: Sequence[Sequence[float]]) -> List[int]:
    """Indexes of the rows with figures (an empty row's first figure, its first step time, is NaN)."""
    return [index for index, row in enumerate(rows) if row and not math.isnan(row[0])]


def decide(flags: Sequence[int]) -> Decisions:
    """The decisions of one interval from every row's flags."""
    return Decisions(stop=any(flag & STOP for flag in flags), unread=all(flag & UNREAD for flag in flags))
