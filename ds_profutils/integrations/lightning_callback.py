"""The Lightning callback's behaviour, shared by the ``lightning`` and ``pytorch_lightning`` namespaces.

Each namespace's ``Trainer`` accepts only its own ``Callback`` class, so :mod:`.lightning` and
:mod:`.pytorch_lightning` each define ``ProfUtilsCallback`` as this mixin on their namespace's
``Callback``; nothing here imports Lightning.

``DeepSpeedStrategy`` builds the engine in its ``setup``, before ``on_fit_start``; it is
``trainer.strategy.deepspeed_engine``.  The callback attaches there and closes at ``on_fit_end`` (or
when the run raises); a later ``fit()`` is attached under the same engine name, so its records are
appended.  Lightning calls ``engine.step()`` for every batch and lets the engine decide the
gradient-accumulation boundary, so the engine hook sees every micro step.  Validation forwards,
sanity check included, run through the engine in eval mode: ``"mode": "eval"``.  File names carry
the global rank (Lightning's own profilers use the local rank, so nodes write into the same files).
"""
from __future__ import annotations

from typing import Any, Optional

from .frameworks import AttachTargetError, Framework, check_release
from .engines import FollowedEngines, FollowingCallback
from .live_sinks import LightningSink

__all__ = ["ProfUtilsCallbackMixin"]


class ProfUtilsCallbackMixin(FollowingCallback):
    """Attach to ``trainer.strategy.deepspeed_engine`` for each ``fit()``; see the module doc.

    ``name``, ``config`` and the keyword options are those of ``ds_profutils.attach``; by default the
    settings come from the config ``DeepSpeedStrategy`` gave DeepSpeed.
    """

    framework: Framework  # the namespace's entry in .frameworks' table, set by each subclass
    strategy_class: type  # the namespace's DeepSpeedStrategy

    def __init__(self, name: Optional[str] = None, *, config: Any = None, **options: Any) -> None:
        check_release(self.framework, self)
        super().__init__()
        self._engines = FollowedEngines(name, config, options)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if not isinstance(trainer.strategy, self.strategy_class):
            raise AttachTargetError(f"ds_profutils: ProfUtilsCallback profiles the engine of DeepSpeedStrategy; "
                                    f"this Trainer's strategy is {type(trainer.strategy).__name__} "
                                    "(Trainer(strategy=\"deepspeed_stage_3\") or DeepSpeedStrategy(...))")

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._engines.begin(trainer.strategy.deepspeed_engine, LightningSink(trainer))

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._engines.end()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._engines.end()

    def close(self) -> None:
        """Give the engine back now and attach no later one."""
        self._engines.close()
