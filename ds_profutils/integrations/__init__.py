"""Adapters from the frameworks DeepSpeed users train with to the one engine hook, ``engine.attach``.

``ds_profutils.attach`` (:mod:`.dispatch`) takes a DeepSpeed engine, a transformers ``Trainer``
(:mod:`.transformers`) or an Accelerate ``Accelerator`` (:mod:`.accelerate`); Lightning takes a
callback, ``ProfUtilsCallback`` from :mod:`.lightning` or :mod:`.pytorch_lightning` (one per
namespace).  Each framework is imported only by its own adapter module, never by this package, so
``from ds_profutils import attach`` loads none of them.
"""
from .dispatch import AttachTargetError, attach

__all__ = ["AttachTargetError", "attach"]
