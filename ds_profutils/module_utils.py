"""Dotted-path attribute access on modules, as ``deepspeed.utils.module_utils``."""
from typing import Any

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model: Any, module_name: str) -> Any:
    """Return ``model.a.b.c`` for ``module_name="a.b.c"``.

    The error names the whole path and the part that was missing, which plain ``getattr`` does not.
    """
    current = model
    for depth, part in enumerate(module_name.split(".")):
        try:
            current = getattr(current, part)
        except AttributeError:
            walked = ".".join(module_name.split(".")[:depth]) or "<model>"
            raise AttributeError(f"recursive_getattr: {walked!r} has no attribute {part!r} "
                                 f"(resolving {module_name!r})") from None
    return current


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """Set ``model.a.b.c = module`` for ``module_name="a.b.c"``."""
    parent_path, _, leaf = module_name.rpartition(".")
    parent = recursive_getattr(model, parent_path) if parent_path else model
    setattr(parent, leaf, module)
