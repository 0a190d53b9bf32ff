"""Linking low-precision params to their fp32 optimizer fragments, as ``deepspeed.utils``.

The links (``param._hp_mapping``) are read by DeepSpeed's optimizers and by the ``safe_*``
accessors, so these are DeepSpeed's own functions, re-exported so both sides see one mapping.
"""
from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state, link_hp_params

__all__ = ["link_hp_params", "lazy_init_hp_params_optimizer_state"]
