"""ds_profutils: ``deepspeed.utils``, name for name, plus profiling tools DeepSpeed lacks.

Swap ``from deepspeed.utils import X`` for ``from ds_profutils import X``: every public name of
``deepspeed.utils`` 0.19.x is here with the same signature, acting on the same DeepSpeed state.
"""
from deepspeed.runtime.dataloader import RepeatingLoader

from .comms_logging import get_caller_func
from .exceptions import DeprecatedException
from .groups import (bwc_pipeline_parallel_world_size, bwc_tensor_model_parallel_world_size, get_data_parallel_group,
                     get_data_parallel_rank, get_data_parallel_world_size, get_model_parallel_group,
                     get_model_parallel_rank, get_model_parallel_world_size, get_tensor_model_parallel_group,
                     get_tensor_model_parallel_rank, get_tensor_model_parallel_src_rank,
                     get_tensor_model_parallel_world_size, initialize, set_tensor_model_parallel_rank,
                     set_tensor_model_parallel_world_size)
from .init_on_device import OnDevice
from .logging import log_dist, log_dist_once, logger, set_log_level_from_string
from .mixed_precision_linkage import lazy_init_hp_params_optimizer_state, link_hp_params
from .module_utils import recursive_getattr, recursive_setattr
from .numa import get_numactl_cmd
from .nvtx import instrument_w_nvtx
from .partitioned_param_profiler import PartitionedParameterProfiler
from .profiler_decorator import profiler, step_profiler
from .tensor_fragment import (fragment_address, get_full_hp_grad, get_full_hp_param, get_hp_fragment_mapping,
                              map_to_flat_opt_states, safe_get_full_fp32_param, safe_get_full_grad,
                              safe_get_full_optimizer_state, safe_get_local_fp32_param, safe_get_local_grad,
                              safe_get_local_optimizer_state, safe_set_full_fp32_param, safe_set_full_grad,
                              safe_set_full_optimizer_state, safe_set_local_fp32_param, safe_set_local_grad,
                              safe_set_local_optimizer_state, safe_update_full_grad_vectorized, set_full_hp_grad,
                              set_full_hp_param, tensor_fragment)
from .version import __version__
from .z3_leaf_module import (get_z3_leaf_modules, set_z3_leaf_module, set_z3_leaf_modules,
                             set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules,
                             z3_leaf_module, z3_leaf_parameter)
from .zero_attach import attach

# The names of deepspeed.utils 0.19.x, in the order of its __init__.
DEEPSPEED_UTILS_NAMES = [
    "logger", "log_dist", "log_dist_once", "set_log_level_from_string", "get_caller_func", "OnDevice",
    "DeprecatedException", "bwc_pipeline_parallel_world_size", "bwc_tensor_model_parallel_world_size",
    "initialize", "get_tensor_model_parallel_group", "get_model_parallel_group", "get_data_parallel_group",
    "set_tensor_model_parallel_world_size", "get_tensor_model_parallel_world_size", "get_model_parallel_world_size",
    "set_tensor_model_parallel_rank", "get_tensor_model_parallel_rank", "get_model_parallel_rank",
    "get_tensor_model_parallel_src_rank", "get_data_parallel_world_size", "get_data_parallel_rank",
    "instrument_w_nvtx", "tensor_fragment", "get_full_hp_param", "get_hp_fragment_mapping", "fragment_address",
    "get_full_hp_grad", "map_to_flat_opt_states", "safe_get_full_fp32_param", "safe_get_full_grad",
    "safe_get_full_optimizer_state", "set_full_hp_param", "set_full_hp_grad", "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state", "safe_set_full_grad", "safe_get_local_fp32_param", "safe_get_local_grad",
    "safe_get_local_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
    "safe_set_local_optimizer_state", "safe_update_full_grad_vectorized", "set_z3_leaf_modules",
    "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter", "set_z3_leaf_module",
    "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix", "link_hp_params",
    "lazy_init_hp_params_optimizer_state", "RepeatingLoader", "get_numactl_cmd", "recursive_getattr",
    "recursive_setattr"
]

# Our additions (profiling tools and configuration).
PROFUTILS_NAMES = ["__version__", "profiler", "step_profiler", "PartitionedParameterProfiler", "attach"]

__all__ = DEEPSPEED_UTILS_NAMES + PROFUTILS_NAMES
