"""ZeRO-3 parameter-fetch profiling in a live DeepSpeed engine, and what else ``attach`` puts on it.

:mod:`.fetch_profiler` is the profiler DeepSpeed's coordinator calls on every fetch (it also holds
the step's collectives, from :mod:`.collectives`), :mod:`.recorder` writes its per-step records with
the memory of :mod:`.memory`, :mod:`.snapshot` writes the allocator's history where memory runs out,
:mod:`.engine_setup` applies the config's engine settings, :mod:`.hooks` follows the engine's steps,
and :mod:`.attaching` puts them into an engine with ``attach``.
"""
from .attaching import SUPPORTED_DEEPSPEED, AttachError, Attachment, attach
from .fetch_profiler import NUMEL_UNITS, PartitionedParameterProfiler
from .recorder import ZeroFetchRecorder

__all__ = ["NUMEL_UNITS", "SUPPORTED_DEEPSPEED", "AttachError", "Attachment", "PartitionedParameterProfiler",
           "ZeroFetchRecorder", "attach"]
