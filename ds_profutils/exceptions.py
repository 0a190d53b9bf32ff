"""Exceptions of ``deepspeed.utils.exceptions`` and the one error class ds_profutils raises for bad input."""
from deepspeed.utils.exceptions import DeprecatedException

__all__ = ["DeprecatedException", "InvalidArgumentError"]


class InvalidArgumentError(ValueError, AssertionError):
    """Bad input to a ds_profutils function.

    DeepSpeed validates many arguments with ``assert``; code written against it catches
    ``AssertionError``.  Subclassing both keeps those handlers working while giving a real exception
    (asserts vanish under ``python -O``) that callers can also catch as ``ValueError``.
    """
