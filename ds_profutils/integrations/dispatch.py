"""``ds_profutils.attach(target)``: one entry point for a DeepSpeed engine and for the frameworks that build one.

Most DeepSpeed jobs never hold the engine: a transformers ``Trainer`` or an Accelerate ``Accelerator``
builds it.  ``attach`` recognises those objects and hands them to their adapter, which finds the
engine and calls :func:`ds_profutils.engine.attach` on it, so everything the engine hook does reaches
them unchanged.

Frameworks are recognised without importing them (:mod:`.frameworks`), so ``import ds_profutils``
never loads one; the adapters are imported only when their object is given.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

from .frameworks import ACCELERATOR, LIGHTNING_TRAINERS, TRAINER, AttachTargetError, check_release, refusal

__all__ = ["AttachTargetError", "attach", "is_engine"]


def is_engine(target: Any) -> bool:
    """Whether ``target`` is a DeepSpeed engine, or has the interface ``engine.attach`` uses (test stand-ins)."""
    engine_module = sys.modules.get("deepspeed.runtime.engine")
    if engine_module is not None and isinstance(target, engine_module.DeepSpeedEngine):
        return True
    return (callable(getattr(target, "zero_optimization_stage", None)) and callable(getattr(target, "step", None))
            and hasattr(target, "module") and hasattr(target, "global_steps"))


def attach(target: Any, name: Optional[str] = None, *, config: Any = None, **options: Any) -> Any:
    """Profile the DeepSpeed engine behind ``target`` as its ds_config asks; see docs/integrations.md.

    * a DeepSpeed engine: :func:`ds_profutils.engine.attach` itself; returns its ``Attachment`` (or None
      when the config asks nothing);
    * a ``transformers.Trainer``, before ``train()``: adds a callback that attaches to each engine the
      Trainer builds, at train begin, and closes at train end; returns that callback (``close()``);
    * an ``accelerate.Accelerator``, after ``prepare(...)``: attaches to its DeepSpeed engine; returns the
      ``Attachment`` (or None).

    A Trainer or Accelerator that does not train with DeepSpeed (the same script run without it) logs one
    warning and returns None.  Our ds_config sections are read and checked at once, so a bad key raises
    ``ConfigError`` here.

    ``name``, ``config`` and the keyword options are those of ``engine.attach``; by default the settings
    come from the ds_config the framework gave DeepSpeed (with HF's ``"auto"`` values filled in).
    Anything else, or a framework release outside the supported range, raises
    :class:`AttachTargetError` naming the type, the supported releases and what is accepted.  Lightning
    takes a callback instead: ``ds_profutils.integrations.lightning.ProfUtilsCallback``.
    """
    if TRAINER.recognises(target):
        check_release(TRAINER, target)
        from .transformers import attach_trainer

        return attach_trainer(target, name, config=config, **options)
    if ACCELERATOR.recognises(target):
        check_release(ACCELERATOR, target)
        from .accelerate import attach_accelerator

        return attach_accelerator(target, name, config=config, **options)
    if is_engine(target):
        from ..engine import attach as attach_engine

        return attach_engine(target, name, config=config, **options)
    for framework in LIGHTNING_TRAINERS:
        if framework.recognises(target):
            raise refusal(target, "a Lightning Trainer builds its engine inside DeepSpeedStrategy; give it "
                           "ProfUtilsCallback() in callbacks= instead")
    raise refusal(target, "it is not a DeepSpeed engine nor a framework object that builds one")
