"""``attach(accelerator)`` for an Accelerate ``Accelerator`` that trains with DeepSpeed.

``accelerator.prepare(model, optimizer, ...)`` builds the engine and keeps it as
``accelerator.deepspeed_engine_wrapped.engine``; ``accelerator.backward(loss)`` runs its backward and,
at each gradient-accumulation boundary, its ``step()``.  The prepared optimizer's ``step()`` does
nothing under DeepSpeed, so steps are taken from the engine, never from that wrapper.  Nothing of
Accelerate is imported here: the accelerator says all that is needed.  An accelerator that does not
train with DeepSpeed (the same script launched without it) gets one warning and None.
"""
from __future__ import annotations

from typing import Any, Optional

from ..logging import warning_once
from .frameworks import AttachTargetError
from .live_sinks import AccelerateSink

__all__ = ["attach_accelerator"]


def attach_accelerator(accelerator: Any, name: Optional[str] = None, *, config: Any = None, **options: Any) -> Any:
    """``engine.attach`` on the engine ``accelerator.prepare`` built; its ``Attachment``, or None (also, with a
    warning, when the accelerator does not train with DeepSpeed)."""
    from ..engine import attach

    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if wrapped is None:
        if getattr(accelerator.state, "deepspeed_plugin", None) is None:
            warning_once("ds_profutils.attach: this accelerate.Accelerator does not train with DeepSpeed (start the "
                         "job with `accelerate launch --use_deepspeed --deepspeed_config_file ds_config.json`, or "
                         "give Accelerator a DeepSpeedPlugin), so there is nothing to profile")
            return None
        raise AttachTargetError("ds_profutils.attach: cannot profile this accelerate.Accelerator: it has no DeepSpeed "
                                "engine yet: call attach(accelerator) after accelerator.prepare(model, ...)")
    attachment = attach(wrapped.engine, name, config=config, **options)
    if attachment is not None:
        attachment.report_to(AccelerateSink(accelerator))  # its trackers, once init_trackers ran
    return attachment
