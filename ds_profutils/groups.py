"""Process groups, as ``deepspeed.utils.groups``, on DeepSpeed's own state.

The groups live in ``deepspeed.utils.groups`` (the engine writes ``groups.mpu`` and
``groups.mesh_device`` there).  This module reads and writes that same state: module attributes are
forwarded both ways, the getters are DeepSpeed's own functions, and the setters validate their
argument before handing it to DeepSpeed.
"""
import sys
import types
from typing import Any

from deepspeed.utils import groups as _ds_groups
from deepspeed.utils.groups import (get_data_parallel_group, get_data_parallel_rank, get_data_parallel_world_size,
                                    get_model_parallel_group, get_model_parallel_rank, get_model_parallel_world_size,
                                    get_tensor_model_parallel_group, get_tensor_model_parallel_rank,
                                    get_tensor_model_parallel_src_rank, get_tensor_model_parallel_world_size,
                                    initialize)

from ._validate import require_type
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


def set_tensor_model_parallel_world_size(world_size: int) -> None:
    """Set the tensor-model-parallel world size DeepSpeed reports (a positive int)."""
    require_type("set_tensor_model_parallel_world_size", "world_size", world_size, int)
    if world_size < 1:
        raise InvalidArgumentError(f"set_tensor_model_parallel_world_size: world_size must be >= 1, got {world_size}")
    _ds_groups.set_tensor_model_parallel_world_size(world_size)


def set_tensor_model_parallel_rank(rank: int) -> None:
    """Set this process's tensor-model-parallel rank DeepSpeed reports (an int >= 0)."""
    require_type("set_tensor_model_parallel_rank", "rank", rank, int)
    if rank < 0:
        raise InvalidArgumentError(f"set_tensor_model_parallel_rank: rank must be >= 0, got {rank}")
    _ds_groups.set_tensor_model_parallel_rank(rank)


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
