"""What is DeepSpeed's ``PipelineEngine``'s only: its step is one ``train_batch()`` (or ``eval_batch()``), timed
instruction by instruction (docs/pipeline.md).

A PipelineEngine's ``forward``, ``backward`` and ``step`` raise; its schedule runs each micro batch's forward
and backward inside ``train_batch()``.  So the hooks every other engine gets (:mod:`..hooks`) would see one
"step" per micro batch and never an optimizer step.  :class:`PipelineHooks` tells the same listeners of the
whole ``train_batch()`` instead, and :mod:`.instructions` adds each kind of instruction's time to its record.
"""
from .hooks import PipelineHooks, is_pipeline_engine
from .instructions import GROUPS, INSTRUCTION_KINDS, InstructionTimes

__all__ = ["GROUPS", "INSTRUCTION_KINDS", "InstructionTimes", "PipelineHooks", "is_pipeline_engine"]
