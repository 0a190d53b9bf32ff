"""A forward's inputs as the FLOP counter keys them: the shape key, and the micro step's tokens and samples
(the rule is in :mod:`.flops`' doc).

A positional argument that is a dict (a Lightning batch handed to the module whole) is read as keyword
arguments, and one that is a list or tuple as positional ones, one level deep: its tensors enter the key and
may hold the tokens.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, List, Mapping, Optional, Tuple

import torch

__all__ = ["inspect_batch"]

_INTEGER_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
                             torch.uint64})
"""The dtypes of a token tensor (token ids, not bool masks)."""


class _Reading:
    """The shapes read so far, the token tensor's shape and the first tensor's shape."""

    __slots__ = ("shapes", "tokens", "named_tokens", "first")

    def __init__(self) -> None:
        self.shapes: List[Any] = []
        self.tokens: Optional[torch.Size] = None
        self.named_tokens = False
        self.first: Optional[torch.Size] = None

    def positional(self, values: Iterable[Any]) -> None:
        for value in values:
            if isinstance(value, torch.Tensor):
                shape = value.shape
                self.shapes.append(shape)
                if self.first is None:
                    self.first = shape
                if self.tokens is None and value.dtype in _INTEGER_DTYPES:
                    self.tokens = shape
            else:
                self.shapes.append(None)  # keeps positions apart: (None, x) is not (x, None)

    def named(self, values: Mapping[str, Any]) -> None:
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                shape = value.shape
                self.shapes.append((name, shape))
                if self.first is None:
                    self.first = shape
                if name == "input_ids" and not self.named_tokens:
                    self.tokens, self.named_tokens = shape, True  # named, so it wins over a positional one


def inspect_batch(args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> Tuple[tuple, Optional[int], Optional[int]]:
    """The shape key of a forward's inputs, and its tokens and samples by the module doc's rule.

    Each tensor's ``shape`` is read once (building a ``torch.Size`` is most of the cost of a known step).
    """
    reading = _Reading()
    for value in args:
        if isinstance(value, Mapping):
            reading.shapes.append("{")
            reading.named(value)
            reading.shapes.append("}")
        elif isinstance(value, (list, tuple)):
            reading.shapes.append("(")
            reading.positional(value)
            reading.shapes.append(")")
        else:
            reading.positional((value, ))
    reading.named(kwargs)
    tokens, first = reading.tokens, reading.first
    if tokens is not None:
        return tuple(reading.shapes), math.prod(tokens), (tokens[0] if tokens else 1)
    return tuple(reading.shapes), None, (None if first is None else first[0] if first else 1)
