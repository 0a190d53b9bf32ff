"""``ProfUtilsCallback`` for ``pytorch_lightning`` Trainers with ``DeepSpeedStrategy``.

``pytorch_lightning.Trainer(strategy=DeepSpeedStrategy(...), callbacks=[ProfUtilsCallback()])``; the
behaviour is :class:`~.lightning_callback.ProfUtilsCallbackMixin`'s.  For the ``lightning`` namespace
use :mod:`ds_profutils.integrations.lightning`.
"""
from pytorch_lightning import Callback
from pytorch_lightning.strategies import DeepSpeedStrategy

from .frameworks import LIGHTNING_TRAINERS
from .lightning_callback import ProfUtilsCallbackMixin

__all__ = ["ProfUtilsCallback"]


class ProfUtilsCallback(ProfUtilsCallbackMixin, Callback):
    """Profile the engine of ``DeepSpeedStrategy`` as its ds_config asks (``pytorch_lightning``)."""

    framework = LIGHTNING_TRAINERS[1]
    strategy_class = DeepSpeedStrategy
