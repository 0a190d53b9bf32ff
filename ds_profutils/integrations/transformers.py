"""``attach(trainer)`` for a transformers ``Trainer`` that trains with DeepSpeed.

The Trainer builds its engine inside ``train()`` (``trainer.model_wrapped`` once DeepSpeed made it)
and calls ``on_train_begin`` right after, before the first batch; so ``attach(trainer)``, called before
``train()``, adds a callback that attaches then and closes at ``on_train_end``.  Steps need nothing
from the Trainer: the engine hook follows ``engine.step()``, which the Trainer (through Accelerate)
calls at each gradient-accumulation boundary, and the forwards of every micro step; evaluation during
training runs the model the engine wraps, in eval mode, so those forwards are recorded as
``"mode": "eval"``.  A later ``train()`` (a resume) gets a new engine, attached under the first one's
name: its records are appended to the same file.

The engine exists only once ``train()`` runs, but its ds_config is the Trainer's from the start
(``args.hf_deepspeed_config``): ``attach(trainer)`` reads and checks our sections there, so a typo is
a ``ConfigError`` at the ``attach`` line, not ten seconds into ``train()``.  A Trainer that does not
train with DeepSpeed (the same script run without ``--deepspeed``) gets one warning and None.
"""
from __future__ import annotations

from typing import Any, Optional

from transformers import TrainerCallback

from ..config import load_config, resolve_section
from ..logging import warning_once
from .engines import FollowedEngines, FollowingCallback
from .live_sinks import TrainerSink

__all__ = ["ProfUtilsTrainerCallback", "attach_trainer"]


class ProfUtilsTrainerCallback(FollowingCallback, TrainerCallback):
    """What ``attach(trainer)`` adds to a Trainer: the engine of each ``train()`` is attached while it trains.

    ``attachment`` is the engine's current ``Attachment`` (None between runs, or when the config asks
    nothing); ``close()`` gives the engine back and takes the callback off the Trainer.
    """

    def __init__(self, trainer: Any, name: Optional[str], config: Any, options: dict) -> None:
        self._trainer = trainer
        self._engines = FollowedEngines(name, config, options)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._engines.begin(self._trainer.model_wrapped, TrainerSink(self._trainer))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._engines.end()

    def close(self) -> None:
        """Write what is finished, give the engine back, and stop attaching to later ones."""
        self._engines.close()
        self._trainer.remove_callback(self)

    def __enter__(self) -> "ProfUtilsTrainerCallback":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def attach_trainer(trainer: Any, name: Optional[str] = None, *, config: Any = None,
                   **options: Any) -> Optional[ProfUtilsTrainerCallback]:
    """Add the callback to ``trainer`` (once: attaching again returns the one already there); None, with a
    warning, when the Trainer does not train with DeepSpeed.  Raises ``ConfigError`` for a bad section."""
    if not getattr(trainer, "is_deepspeed_enabled", False):
        warning_once("ds_profutils.attach: this transformers.Trainer does not train with DeepSpeed "
                     "(TrainingArguments(deepspeed=...) is not set, or --deepspeed was not given), so there is "
                     "nothing to profile: ds_profutils profiles the DeepSpeed engine a Trainer builds")
        return None
    loaded = load_config(config if config is not None else _ds_config(trainer))  # a bad section fails here
    resolve_section(loaded.partitioned_param_profiler, options)  # and so does a bad keyword value
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, ProfUtilsTrainerCallback):
            return callback
    callback = ProfUtilsTrainerCallback(trainer, name, config, options)
    # first in line: at on_train_end it closes the attachment, whose last live events (an interval late on an
    # accelerator) reach the report_to integrations before their own on_train_end closes their writers
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback


def _ds_config(trainer: Any) -> Any:
    """The ds_config the Trainer will give DeepSpeed (HF fills its ``"auto"`` values later; ours have none)."""
    hf_config = getattr(trainer.args, "hf_deepspeed_config", None)
    return hf_config.config if hf_config is not None else trainer.args.deepspeed
