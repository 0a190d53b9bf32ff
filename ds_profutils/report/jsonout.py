"""``--json``: the report as one JSON document, written by orjson.

The step views stay in their arrays until written: each rank's row becomes a list only while it is
serialized, so the output of 1024 ranks x 1000 steps never exists as Python objects all at once.
NaN (a rank without a record of a step) is written as null.
"""
from __future__ import annotations

from typing import Any, Mapping

import orjson

from .steps import Matrix, StepView

__all__ = ["report_json"]


def _default(value: Any) -> Any:
    """orjson's hook for what it cannot write itself; it calls it again on what this returns."""
    if isinstance(value, StepView):
        return {"layout": "each column is a list per rank (in 'ranks' order) of values per global step (in "
                          "'global_steps' order); null: no record", "global_steps": value.global_steps,
                "ranks": value.ranks, **value.columns(), "straggler": value.straggler, "spread_ms": value.spread_ms,
                "threshold_ms": value.threshold_ms}
    if isinstance(value, Matrix):
        return value.rows()
    if isinstance(value, memoryview):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not part of a report")


def report_json(report: Mapping[str, Any]) -> bytes:
    """The whole report as JSON bytes (one line, newline-terminated; integer keys as strings)."""
    return orjson.dumps(report, default=_default, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_APPEND_NEWLINE
                        | orjson.OPT_PASSTHROUGH_DATACLASS)
