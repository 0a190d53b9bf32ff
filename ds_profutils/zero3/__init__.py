"""What is ZeRO-3's only: the parameter-fetch profiler and what a step record says about fetches.

:mod:`.fetch_profiler` is the profiler DeepSpeed's coordinator calls on every fetch, :mod:`.entries`
builds a record's per-event entries, and :mod:`.fetches` puts the profiler in an engine's coordinator
for the engine's recorder (:mod:`ds_profutils.engine`, which attaches it and owns the records).
"""
from .entries import NUMEL_UNITS
from .fetch_profiler import PartitionedParameterProfiler
from .fetches import CoordinatorFetches, StepFetches

__all__ = ["NUMEL_UNITS", "CoordinatorFetches", "PartitionedParameterProfiler", "StepFetches"]
