"""Argument checks shared by the delegating modules: one message shape for every bad input."""
from typing import Any, Tuple, Type, Union

from .exceptions import InvalidArgumentError

__all__ = ["require_type"]


def require_type(function: str, argument: str, value: Any, expected: Union[Type, Tuple[Type, ...]]) -> None:
    """Raise ``InvalidArgumentError`` naming the function, the argument and the expected type."""
    if not isinstance(value, expected):
        names = " or ".join(t.__name__ for t in (expected if isinstance(expected, tuple) else (expected, )))
        raise InvalidArgumentError(f"{function}: {argument} must be {names}, got {type(value).__name__} "
                                   f"({value!r:.80})")
