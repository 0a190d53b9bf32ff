"""The hub: ``attach(engine)`` and everything it puts on a DeepSpeed engine, for any ZeRO stage.

:mod:`.attaching` holds ``attach`` and the :class:`Attachment` it returns; :mod:`.hooks` follows the
engine's forward, backward and step (and says which engine runs now); :mod:`.recorder` writes the
per-step records, each filled in a :class:`~.step.StepRecord` (:mod:`.step`) with the step's
collectives (:mod:`.collectives`) and memory (:mod:`.memory`), and on ZeRO-3 the fetch events of
:mod:`ds_profutils.zero3`; :mod:`.snapshot` writes the allocator's history where memory runs out,
:mod:`.engine_setup` applies the config's engine settings, and :mod:`.engine_driven` runs the torch
profiler (:mod:`ds_profutils.torch_profiler`) from the engine's steps, and :mod:`.capture` the trace captures
that ride on the live interval exchange (:mod:`.live`).
"""
from .attaching import SUPPORTED_DEEPSPEED, AttachError, Attachment, attach, continue_series
from .hooks import Listener
from .recorder import StepRecorder

__all__ = ["SUPPORTED_DEEPSPEED", "AttachError", "Attachment", "Listener", "StepRecorder", "attach",
           "continue_series"]
