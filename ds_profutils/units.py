"""Figures in units a reader takes in at a glance, one function per kind, used by every output (the report, the
diff, the live console line): a CPU job's 0.0004 TFLOP/s printed as ``0.000`` reads as nothing counted.

Plain formatting, no imports of ours: report/, diff/ and engine/ all use it without breaking the layout's
downward imports.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

__all__ = ["flops_rate", "rank_ranges", "share"]

_RATE_UNITS = (("TFLOP/s", 1.0), ("GFLOP/s", 1e-3), ("MFLOP/s", 1e-6))


def flops_rate(tflops: Optional[float]) -> Optional[str]:
    """A rate given in TFLOP/s as TFLOP/s, GFLOP/s or MFLOP/s (the largest unit in which it is at least 1; below
    1 MFLOP/s still MFLOP/s) with three significant digits: ``0.000412`` -> ``"412 MFLOP/s"``, ``12.34`` ->
    ``"12.3 TFLOP/s"``, ``0.0012`` -> ``"1.20 GFLOP/s"``, ``2345.6`` -> ``"2,350 TFLOP/s"``.  Never ``0`` for a rate that is not zero; None (and NaN)
    stay None."""
    if tflops is None or math.isnan(tflops):
        return None
    if tflops == 0:
        return "0 TFLOP/s"
    for unit, scale in _RATE_UNITS:
        value = float(f"{tflops / scale:.3g}")  # rounded first: 999.96 GFLOP/s is 1.00 TFLOP/s
        if abs(value) >= 1 or unit == _RATE_UNITS[-1][0]:
            shown = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:#.3g}".rstrip(".")
            return f"{shown} {unit}"
    raise AssertionError("unreachable: the last unit takes every rate")


def share(fraction: Optional[float]) -> Optional[str]:
    """A share (MFU, say) as a percentage with three significant digits: ``0.588`` -> ``"58.8%"``, ``0.0000012``
    -> ``"0.000120%"``, never ``0.0%`` for a share that is not zero; None (and NaN) stay None."""
    if fraction is None or math.isnan(fraction):
        return None
    if fraction == 0:
        return "0%"
    return f"{100 * fraction:#.3g}".rstrip(".") + "%"


def rank_ranges(ranks: Iterable[int], separator: str = ", ") -> str:
    """A set of ranks in a line whatever its size: ``0-3, 5, 7-9`` (``separator`` ``","``: ``0-3,5,7-9``, a record's
    key for a group), ``none`` for no rank."""
    ordered = sorted(set(ranks))
    parts = []
    for rank in ordered:
        if parts and rank == parts[-1][1] + 1:
            parts[-1][1] = rank
        else:
            parts.append([rank, rank])
    return separator.join(str(first) if first == last else f"{first}-{last}" for first, last in parts) or "none"
