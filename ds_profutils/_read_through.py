"""The ``deepspeed.utils`` modules ds_profutils adds nothing to, mirrored by reading through to DeepSpeed's own.

``ds_profutils.zero_to_fp32`` and the like are DeepSpeed's code: a fork would be a copy to keep in step, and
what they hold (the pinned-memory tracker's counts, the static cache) is DeepSpeed state its engine must see.
So each mirror's attributes are its DeepSpeed module's (PEP 562), ``from ... import *`` takes the names a star
import of DeepSpeed's module takes, and ``dir()`` lists them.
"""
from __future__ import annotations

import importlib
import importlib.util
import runpy
from typing import Any, Callable, List, Tuple

__all__ = ["read_through", "run_as_main"]


def read_through(deepspeed_module: str) -> Tuple[Callable[[str], Any], Callable[[], List[str]], List[str]]:
    """``(__getattr__, __dir__, __all__)`` for a mirror of ``deepspeed_module`` (imported now)."""
    module = importlib.import_module(deepspeed_module)

    def __getattr__(name: str) -> Any:
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(f"module {deepspeed_module!r} (read through by ds_profutils) has no attribute "
                                 f"{name!r}") from None

    def __dir__() -> List[str]:
        return sorted(vars(module))

    return __getattr__, __dir__, [name for name in vars(module) if not name.startswith("_")]


def run_as_main(deepspeed_module: str) -> None:
    """``python -m ds_profutils.<name> ...`` runs DeepSpeed's command line of that module, as ``python <its file>``
    does (the way DeepSpeed documents its use from a checkpoint folder)."""
    spec = importlib.util.find_spec(deepspeed_module)
    runpy.run_path(spec.origin, run_name="__main__")
