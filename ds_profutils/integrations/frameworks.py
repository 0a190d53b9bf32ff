"""What the framework adapters share with the dispatcher: the frameworks ``attach`` knows and its refusal.

Below both :mod:`.dispatch` (which recognises objects and picks an adapter) and the adapters (which
refuse what they cannot profile with the same error), so neither imports the other back.

A framework is recognised through ``sys.modules``: an object can only be a ``transformers.Trainer`` if
``transformers.trainer`` is imported already, so the check imports nothing.  Each adapter supports a
stated range of its framework's releases, the ones whose internals it relies on; an object from a
release outside it is refused with the same error as an object ``attach`` does not know, which lists
everything it accepts.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Tuple

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

__all__ = ["ACCELERATOR", "AttachTargetError", "Framework", "LIGHTNING_TRAINERS", "TRAINER", "check_release",
           "refusal"]


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


def refusal(target: Any, reason: str) -> AttachTargetError:
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
        raise refusal(target, f"{framework.package} {framework.release()} is not a supported release "
                       f"(supported: {framework.label})")
