"""Process groups, as ``deepspeed.utils.groups``, on DeepSpeed's own state.

The groups live in ``deepspeed.utils.groups`` (the engine writes ``groups.mpu`` and
``groups.mesh_device`` there).  This module reads and writes that same state: module attributes are
forwarded both ways, the getters are DeepSpeed's own functions, and the setters validate their
argument before handing it to DeepSpeed.
"""
import numbers
import sys
import types
from typing import Any, Optional

from deepspeed.utils import groups as _ds_groups
from deepspeed.utils.groups import (get_data_parallel_group, get_data_parallel_rank, get_data_parallel_world_size,
                                    get_model_parallel_group, get_model_parallel_rank, get_model_parallel_world_size,
                                    get_tensor_model_parallel_group, get_tensor_model_parallel_rank,
                                    get_tensor_model_parallel_src_rank, get_tensor_model_parallel_world_size,
                                    initialize)

from .bwc import bwc_pipeline_parallel_world_size, bwc_tensor_model_parallel_world_size
from .exceptions import DeprecatedException, InvalidArgumentError

__all__ = [
    "DeprecatedException",
    "bwc_pipeline_parallel_world_size",
    "bwc_tensor_model_parallel_world_size",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
    "initialize",
    "set_tensor_model_parallel_rank",
    "set_tensor_model_parallel_world_size",
]


def _checked_override(function: str, argument: str, value: Optional[int], lowest: int) -> Optional[int]:
    """``value`` as a plain int (numpy integers included), or None, which clears DeepSpeed's override."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(f"{function}: {argument} must be int or NoneType, got {type(value).__name__} "
                                   f"({value!r:.80})")
    if value < lowest:
        raise InvalidArgumentError(f"{function}: {argument} must be >= {lowest} (or None), got {value}")
    return int(value)


def _ensure_divisibility(numerator: int, denominator: int) -> None:
    """DeepSpeed's check that ``numerator`` splits evenly, which also names a zero ``denominator``.

    DeepSpeed 0.19.8 divides by it (ZeroDivisionError); its later releases name it, as here.
    """
    if denominator == 0:
        raise InvalidArgumentError(f"_ensure_divisibility: denominator must be non-zero (numerator {numerator})")
    if numerator % denominator:
        raise InvalidArgumentError(f"{numerator} is not divisible by {denominator}")


def set_tensor_model_parallel_world_size(world_size: Optional[int]) -> None:
    """Set the tensor-model-parallel world size DeepSpeed reports; None goes back to the process group's."""
    _ds_groups.set_tensor_model_parallel_world_size(
        _checked_override("set_tensor_model_parallel_world_size", "world_size", world_size, 1))


def set_tensor_model_parallel_rank(rank: Optional[int]) -> None:
    """Set this process's tensor-model-parallel rank DeepSpeed reports; None goes back to the process group's."""
    _ds_groups.set_tensor_model_parallel_rank(_checked_override("set_tensor_model_parallel_rank", "rank", rank, 0))


class _SharedStateModule(types.ModuleType):
    """Module attributes missing here (``mpu``, ``mesh_device``, the group globals) are DeepSpeed's."""

    def __getattr__(self, name: str) -> Any:
        try:
            return getattr(_ds_groups, name)
        except AttributeError:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__ or not hasattr(_ds_groups, name):
            super().__setattr__(name, value)
        else:
            setattr(_ds_groups, name, value)


sys.modules[__name__].__class__ = _SharedStateModule
