"""A forward's inputs as the FLOP counter keys them: the shape key, and the micro step's tokens and samples
(the rule is in :mod:`.flops`' doc).

Where no argument is a tensor but some are dicts, lists or tuples (a Lightning batch handed to the module
whole), their contents are read one level deep -- a dict's items as keyword arguments, a list's or tuple's
as positional ones -- so their tensors enter the key and may hold the tokens.  The usual case (tensors as
arguments) pays nothing for it.
"""
from __future__ import annotations

import math
from typing import Any, List, Mapping, Optional, Tuple

import torch

__all__ = ["inspect_batch"]

_INTEGER_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
                             torch.uint64})
"""The dtypes of a token tensor (token ids, not bool masks)."""


def inspect_batch(args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> Tuple[tuple, Optional[int], Optional[int]]:
    """The shape key of a forward's inputs, and its tokens and samples by the module doc's rule.

    Each tensor's ``shape`` is read once (building a ``torch.Size`` is most of the cost of a known step).
    """
    shapes: List[Any] = []
    tokens = first = None
    for value in args:
        if isinstance(value, torch.Tensor):
            shape = value.shape
            shapes.append(shape)
            if first is None:
                first = shape
            if tokens is None and value.dtype in _INTEGER_DTYPES:
                tokens = shape
        else:
            shapes.append(None)  # keeps positions apart: (None, x) is not (x, None)
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            shape = value.shape
            shapes.append((name, shape))
            if first is None:
                first = shape
            if name == "input_ids":
                tokens = shape  # named, so it wins over a positional integer tensor
    if first is None and any(isinstance(value, (Mapping, list, tuple)) for value in args):
        return _inside_containers(args, kwargs)
    if tokens is not None:
        return tuple(shapes), math.prod(tokens), (tokens[0] if tokens else 1)
    return tuple(shapes), None, (None if first is None else first[0] if first else 1)


def _inside_containers(args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> Tuple[tuple, Optional[int], Optional[int]]:
    """The module doc's one level down: each container argument read as arguments of its own, in order."""
    keys: List[Any] = []
    tokens = samples = None
    for value in args:
        if isinstance(value, Mapping):
            key, inner_tokens, inner_samples = inspect_batch((), value)
        elif isinstance(value, (list, tuple)):
            key, inner_tokens, inner_samples = inspect_batch(tuple(value), {})
        else:
            key, inner_tokens, inner_samples = None, None, None
        keys.append(key)
        if tokens is None and inner_tokens is not None:
            tokens, samples = inner_tokens, inner_samples
        elif samples is None:
            samples = inner_samples
    keys.append(tuple(kwargs))
    return tuple(keys), tokens, samples
