"""The engine's effective config values the advice rules read, recorded once per records file.

The rules judge the job DeepSpeed ran, not the file it was given: a key left out of ``zero_optimization``
still has a value (``overlap_comm`` is on for stage 3 only, ``stage3_prefetch_bucket_size`` 5e7 ...), and
only DeepSpeed's resolved config knows it.  The recorder writes :func:`effective_values` of the engine on
the first record of each file it writes (``"ds_config"``: dotted key -> value); the readers keep the
latest.  The engine is read by duck typing (``engine._config.zero_config``, a pydantic model): nothing
here imports torch or deepspeed.
"""
from __future__ import annotations

from typing import Any, Dict

__all__ = ["RECORDED_KEYS", "effective_values"]

RECORDED_KEYS = ("stage", "overlap_comm", "reduce_bucket_size", "allgather_bucket_size",
                 "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
                 "stage3_max_reuse_distance")
"""The ``zero_optimization`` keys the rules of :mod:`.advice` read (DeepSpeed's spelling, its aliases)."""


def effective_values(engine: Any) -> Dict[str, Any]:
    """``{"zero_optimization.<key>": value}`` for :data:`RECORDED_KEYS` as the engine resolved them; an
    engine without DeepSpeed's resolved ZeRO config (a stand-in) gives an empty dict."""
    try:
        resolved = engine._config.zero_config.model_dump(by_alias=True)
    except AttributeError:
        return {}
    return {f"zero_optimization.{key}": resolved[key] for key in RECORDED_KEYS if key in resolved}
