"""``ds_profutils.attach(target)``: one entry point for a DeepSpeed engine and for the frameworks that build one.

Most DeepSpeed jobs never hold the engine: a transformers ``Trainer`` or an Accelerate ``Accelerator``
builds it.  ``attach`` recognises those objects and hands them to their adapter, which finds the
engine and calls :func:`ds_profutils.engine.attach` on it, so everything the engine hook does reaches
them unchanged.

A framework is recognised through ``sys.modules``: an object can only be a ``transformers.Trainer`` if
``transformers.trainer`` is imported already, so the check imports nothing, and ``import ds_profutils``
never loads a framework.  Each adapter supports a stated range of its framework's releases, the ones
whose internals it relies on; an object from a release outside it is refused with the same error as
an object ``attach`` does not know, which lists everything it accepts.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

__all__ = ["ACCELERATOR", "AttachTargetError", "Framework", "LIGHTNING_TRAINERS", "TRAINER", "attach",
           "check_release", "is_engine"]


class AttachTargetError(TypeError):
    """``attach`` was given something it cannot profile as given; the message lists what it accepts."""


@dataclass(frozen=True)
class Framework:
    """A framework object ``attach`` knows: where its class lives and which releases the adapter supports."""

    package: str  # the top-level module, which holds __version__ ("transformers", "pytorch_lightning")
    module: str  # the module defining the class, imported by any program that made an instance
    class_name: str
    supported: str  # the releases the adapter relies on, as a version specifier (">=5.0,<6")
    accepted_as: str  # how to hand it over, as the error message lists it

    @property
    def label(self) -> str:
        return f"{self.package} {self.supported}"

    def recognises(self, target: Any) -> bool:
        module = sys.modules.get(self.module)
        cls = getattr(module, self.class_name, None)
        return isinstance(cls, type) and isinstance(target, cls)

    def release(self) -> str:
        return str(getattr(sys.modules.get(self.package), "__version__", "unknown"))

    def supports_release(self) -> bool:
        try:
            return SpecifierSet(self.supported).contains(Version(self.release()), prereleases=True)
        except InvalidVersion:
            return False


TRAINER = Framework("transformers", "transformers.trainer", "Trainer", ">=5.0,<6",
                    "a transformers.Trainer, before trainer.train()")
ACCELERATOR = Framework("accelerate", "accelerate.accelerator", "Accelerator", ">=1.0,<2",
                        "an accelerate.Accelerator, after accelerator.prepare(...)")
LIGHTNING_TRAINERS: Tuple[Framework, ...] = tuple(
    Framework(package, f"{namespace}.trainer.trainer", "Trainer", ">=2.0,<3",
              f"for a {namespace}.Trainer with DeepSpeedStrategy, not attach but "
              f"callbacks=[ds_profutils.integrations.{package}.ProfUtilsCallback()]")
    for package, namespace in (("lightning", "lightning.pytorch"), ("pytorch_lightning", "pytorch_lightning")))


def _refusal(target: Any, reason: str) -> AttachTargetError:
    cls = type(target)
    accepted = [
        "a DeepSpeed engine (what deepspeed.initialize returns; DeepSpeed 0.19.x)",
        *(f"{framework.accepted_as} ({framework.label})" for framework in (TRAINER, ACCELERATOR) +
          LIGHTNING_TRAINERS),
    ]
    return AttachTargetError(f"ds_profutils.attach: cannot profile a {cls.__module__}.{cls.__qualname__}: {reason}. "
                             f"It accepts: " + "; ".join(accepted) + ".")


def check_release(framework: Framework, target: Any) -> None:
    """Refuse ``target`` when its framework's release is outside what the adapter supports."""
    if not framework.supports_release():
        raise _refusal(target, f"{framework.package} {framework.release()} is not a supported release "
                       f"(supported: {framework.label})")


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
            raise _refusal(target, "a Lightning Trainer builds its engine inside DeepSpeedStrategy; give it "
                           "ProfUtilsCallback() in callbacks= instead")
    raise _refusal(target, "it is not a DeepSpeed engine nor a framework object that builds one")
