"""Linking low-precision params to their fp32 optimizer fragments, as ``deepspeed.utils``.

The links (``param._hp_mapping``) are read by DeepSpeed's optimizers and by the ``safe_*``
accessors, so these are DeepSpeed's own functions, re-exported so both sides see one mapping.
"""
from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state, link_hp_params

# reachable here as in DeepSpeed's module, which imports them from tensor_fragment
from .tensor_fragment import (get_full_hp_grad, get_full_hp_param, get_hp_fragment_mapping, set_full_hp_grad,
                              set_full_hp_param)

__all__ = ["link_hp_params", "lazy_init_hp_params_optimizer_state", "get_full_hp_param", "get_full_hp_grad",
           "get_hp_fragment_mapping", "set_full_hp_param", "set_full_hp_grad"]
