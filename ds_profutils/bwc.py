"""Backward-compatible queries of a model-parallel unit (``mpu``), as ``deepspeed.utils.bwc``.

The pipeline queries are DeepSpeed's own.  The tensor-model-parallel ones read an ``mpu`` in any of
its three spellings, and, as DeepSpeed's later releases do, an ``mpu`` with none of them (Ulysses'
sequence-parallel unit) as "not split": rank 0, world size 1, no group.  DeepSpeed 0.19.8 raises
AttributeError there instead.
"""
from typing import Any, Optional

from deepspeed.utils.bwc import bwc_pipeline_parallel_group, bwc_pipeline_parallel_world_size

__all__ = [
    "bwc_pipeline_parallel_group",
    "bwc_pipeline_parallel_world_size",
    "bwc_tensor_model_parallel_group",
    "bwc_tensor_model_parallel_rank",
    "bwc_tensor_model_parallel_world_size",
]

# The spellings of the tensor-model-parallel API, newest first: Megatron and DeepSpeed now, some
# DeepSpeed pipeline-parallel versions, then the deprecated Megatron/DeepSpeed one.
_TENSOR_PARALLEL_SPELLINGS = ("tensor_model_parallel", "slice_parallel", "model_parallel")


def _tensor_parallel_query(mpu: Any, what: str, unsplit: Any) -> Any:
    """``mpu.get_<spelling>_<what>()`` of the first spelling ``mpu`` has; ``unsplit`` without an ``mpu`` or any."""
    if mpu is not None:
        for spelling in _TENSOR_PARALLEL_SPELLINGS:
            name = f"get_{spelling}_{what}"
            if hasattr(mpu, name):
                return getattr(mpu, name)()
    return unsplit


def bwc_tensor_model_parallel_rank(mpu: Any = None) -> int:
    """This process's tensor-model-parallel rank from ``mpu``; 0 without one (tensors are not split)."""
    return _tensor_parallel_query(mpu, "rank", 0)


def bwc_tensor_model_parallel_world_size(mpu: Any = None) -> int:
    """How many processes share each tensor in ``mpu``; 1 without one."""
    return _tensor_parallel_query(mpu, "world_size", 1)


def bwc_tensor_model_parallel_group(mpu: Any = None) -> Optional[Any]:
    """The tensor-model-parallel process group of ``mpu``; None without one."""
    return _tensor_parallel_query(mpu, "group", None)
