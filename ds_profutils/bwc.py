"""Backward-compatible queries of a model-parallel unit (``mpu``), as ``deepspeed.utils.bwc``.

Re-exported from DeepSpeed: they hold no state and DeepSpeed's engine calls the same functions.
"""
from deepspeed.utils.bwc import (bwc_pipeline_parallel_group, bwc_pipeline_parallel_world_size,
                                 bwc_tensor_model_parallel_group, bwc_tensor_model_parallel_rank,
                                 bwc_tensor_model_parallel_world_size)

__all__ = [
    "bwc_pipeline_parallel_group",
    "bwc_pipeline_parallel_world_size",
    "bwc_tensor_model_parallel_group",
    "bwc_tensor_model_parallel_rank",
    "bwc_tensor_model_parallel_world_size",
]
