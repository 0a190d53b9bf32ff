"""ZeRO-3 parameter-fetch profiling in a live DeepSpeed engine.

:mod:`.fetch_profiler` is the profiler DeepSpeed's coordinator calls on every fetch,
:mod:`.recorder` writes its per-step records, :mod:`.engine_setup` applies the config's engine
settings, and :mod:`.attaching` puts them into an engine with ``attach``.
"""
from .attaching import SUPPORTED_DEEPSPEED, AttachError, attach
from .fetch_profiler import NUMEL_UNITS, PartitionedParameterProfiler
from .recorder import ZeroFetchRecorder

__all__ = ["NUMEL_UNITS", "SUPPORTED_DEEPSPEED", "AttachError", "PartitionedParameterProfiler", "ZeroFetchRecorder",
           "attach"]
