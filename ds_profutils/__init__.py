"""ds_profutils: ``deepspeed.utils``, name for name, plus profiling tools DeepSpeed lacks.

Swap ``from deepspeed.utils import X`` for ``from ds_profutils import X``: every public name of
``deepspeed.utils`` 0.19.x is here with the same signature, acting on the same DeepSpeed state.

Names are resolved on first use (PEP 562), so ``import ds_profutils`` costs nothing: the
``ds-profutils`` command line reads reports without importing torch or DeepSpeed.  The submodules
``z3_leaf_module`` and ``tensor_fragment`` share their names with a DeepSpeed function and class; at
top level those names stay DeepSpeed's objects however the submodules are imported, as in
``deepspeed.utils``.
"""
import importlib
import sys
from types import ModuleType  # not `import types`: ds_profutils.types is DeepSpeed's module's mirror
from typing import Any, Dict, List, Tuple

from .version import __version__

# Where each public name lives, module by module in the order of deepspeed.utils 0.19's __init__.
_HOMES: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    (".logging", ("logger", "log_dist", "log_dist_once", "set_log_level_from_string")),
    (".comms_logging", ("get_caller_func", )),
    (".init_on_device", ("OnDevice", )),
    (".exceptions", ("DeprecatedException", )),
    (".groups", ("bwc_pipeline_parallel_world_size", "bwc_tensor_model_parallel_world_size", "initialize",
                 "get_tensor_model_parallel_group", "get_model_parallel_group", "get_data_parallel_group",
                 "set_tensor_model_parallel_world_size", "get_tensor_model_parallel_world_size",
                 "get_model_parallel_world_size", "set_tensor_model_parallel_rank", "get_tensor_model_parallel_rank",
                 "get_model_parallel_rank", "get_tensor_model_parallel_src_rank", "get_data_parallel_world_size",
                 "get_data_parallel_rank")),
    (".nvtx", ("instrument_w_nvtx", )),
    (".tensor_fragment", ("tensor_fragment", "get_full_hp_param", "get_hp_fragment_mapping", "fragment_address",
                          "get_full_hp_grad", "map_to_flat_opt_states", "safe_get_full_fp32_param",
                          "safe_get_full_grad", "safe_get_full_optimizer_state", "set_full_hp_param",
                          "set_full_hp_grad", "safe_set_full_fp32_param", "safe_set_full_optimizer_state",
                          "safe_set_full_grad", "safe_get_local_fp32_param", "safe_get_local_grad",
                          "safe_get_local_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
                          "safe_set_local_optimizer_state", "safe_update_full_grad_vectorized")),
    (".z3_leaf_module", ("set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
                         "z3_leaf_parameter", "set_z3_leaf_module", "set_z3_leaf_modules_by_name",
                         "set_z3_leaf_modules_by_suffix")),
    (".mixed_precision_linkage", ("link_hp_params", "lazy_init_hp_params_optimizer_state")),
    ("deepspeed.runtime.dataloader", ("RepeatingLoader", )),
    (".numa", ("get_numactl_cmd", )),
    (".module_utils", ("recursive_getattr", "recursive_setattr")),
)
_ADDITIONS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    (".torch_profiler", ("profiler", "step_profiler")),
    (".zero3", ("PartitionedParameterProfiler", )),
    (".integrations", ("attach", )),  # a DeepSpeed engine, a transformers Trainer or an Accelerate Accelerator
)

DEEPSPEED_UTILS_NAMES: List[str] = [name for _, names in _HOMES for name in names]
"""The 58 public names of deepspeed.utils 0.19.x, in the order of its __init__."""
PROFUTILS_NAMES: List[str] = ["__version__"] + [name for _, names in _ADDITIONS for name in names]
"""Our additions: the profiler decorator, the ZeRO-3 fetch profiler and ``attach``."""
__all__ = DEEPSPEED_UTILS_NAMES + PROFUTILS_NAMES

_HOME_OF: Dict[str, str] = {name: module for module, names in _HOMES + _ADDITIONS for name in names}
_SUBMODULES = frozenset({
    "logging", "comms_logging", "nvtx", "timer", "tensor_fragment", "mixed_precision_linkage", "z3_leaf_module",
    "numa", "init_on_device", "groups", "module_utils", "bwc", "exceptions", "outputs", "cli", "config",
    "torch_profiler", "engine", "zero3", "report", "integrations",
    # DeepSpeed's own modules, read through (._read_through)
    "debug", "pin_memory", "pin_memory_tracker", "static_cache", "torch", "types", "zero_to_fp32", "zero_to_torch"
})
# Submodules whose name is also a DeepSpeed object exported at top level.
_SHADOWED = frozenset({"z3_leaf_module", "tensor_fragment"})


def __getattr__(name: str) -> Any:
    """Import a public name (or a submodule) on first use, then keep it as a plain attribute."""
    home = _HOME_OF.get(name)
    if home is not None:
        value = getattr(importlib.import_module(home, __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__) | _SUBMODULES)


class _Package(ModuleType):
    """Keeps ``z3_leaf_module`` and ``tensor_fragment`` DeepSpeed's objects at top level.

    Importing a submodule makes the import system set it as an attribute of its package, which would
    replace the function (or class) of the same name.  That binding is dropped here; the submodule
    stays reachable through ``sys.modules`` and ``importlib.import_module``, as in ``deepspeed.utils``.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SHADOWED and isinstance(value, ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
