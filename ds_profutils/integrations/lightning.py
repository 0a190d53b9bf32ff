"""``ProfUtilsCallback`` for ``lightning.pytorch`` Trainers with ``DeepSpeedStrategy``.

``lightning.pytorch.Trainer(strategy=DeepSpeedStrategy(...), callbacks=[ProfUtilsCallback()])``; the
behaviour is :class:`~.lightning_callback.ProfUtilsCallbackMixin`'s.  For the ``pytorch_lightning``
namespace use :mod:`ds_profutils.integrations.pytorch_lightning`.
"""
from lightning.pytorch import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy

from .frameworks import LIGHTNING_TRAINERS
from .lightning_callback import ProfUtilsCallbackMixin

__all__ = ["ProfUtilsCallback"]


class ProfUtilsCallback(ProfUtilsCallbackMixin, Callback):
    """Profile the engine of ``DeepSpeedStrategy`` as its ds_config asks (``lightning.pytorch``)."""

    framework = LIGHTNING_TRAINERS[0]
    strategy_class = DeepSpeedStrategy
