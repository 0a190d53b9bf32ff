"""Read and write the fp32 master copy, gradient and optimizer state behind a model parameter.

As ``deepspeed.utils.tensor_fragment``: under ZeRO the optimizer holds these values partitioned
across ranks, and the ``safe_*`` accessors hide where they live.  The fragment mappings are DeepSpeed's
(``param._hp_mapping``, ``param._z3_optimizer``), so the accessors call into the very objects the
engine trains with: a value set here is the value the next ``engine.step()`` uses.

What differs from DeepSpeed is the handling of bad input: a non-tensor, a value of the wrong size, a
non-string state key, a ZeRO-3-only accessor on a ZeRO-1/2 parameter, or a setter on a parameter no
DeepSpeed optimizer manages raise ``InvalidArgumentError`` (a ``ValueError`` and an
``AssertionError``) instead of asserting or silently doing nothing.  Getters on an unmanaged
parameter return None, as in DeepSpeed.
"""
from typing import Callable, Iterable, List, Optional

import torch
from deepspeed.utils.tensor_fragment import (fragment_address, get_full_hp_grad, get_full_hp_param,
                                             get_hp_fragment_mapping, map_to_flat_opt_states, set_full_hp_grad,
                                             set_full_hp_param, tensor_fragment)

from ._validate import require_type
from .exceptions import InvalidArgumentError

__all__ = [
    "fragment_address",
    "get_full_hp_grad",
    "get_full_hp_param",
    "get_hp_fragment_mapping",
    "map_to_flat_opt_states",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
    "set_full_hp_grad",
    "set_full_hp_param",
    "tensor_fragment",
]


def _is_zero3(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id")


def _is_linked(param: torch.Tensor) -> bool:
    """ZeRO-1/2 and the bf16 optimizer link each param to its fp32 fragment."""
    return hasattr(param, "_hp_mapping")


def _full_numel(param: torch.Tensor) -> int:
    return param.ds_numel if _is_zero3(param) else param.numel()


def _check_param(function: str, param: object) -> None:
    require_type(function, "param", param, torch.Tensor)


def _check_key(function: str, optim_state_key: object) -> None:
    require_type(function, "optim_state_key", optim_state_key, str)


def _check_full_value(function: str, param: torch.Tensor, value: object) -> None:
    require_type(function, "value", value, torch.Tensor)
    if value.numel() != _full_numel(param):
        raise InvalidArgumentError(f"{function}: value has {value.numel()} elements but the full parameter has "
                                   f"{_full_numel(param)} (shape {tuple(getattr(param, 'ds_shape', param.shape))})")


def _check_managed(function: str, param: torch.Tensor) -> None:
    if not (_is_zero3(param) or _is_linked(param)):
        raise InvalidArgumentError(f"{function}: param is not managed by a DeepSpeed ZeRO or bf16 optimizer "
                                   "(no ds_id and no _hp_mapping); pass a parameter of an initialized engine")


def _check_local_value(function: str, param: torch.Tensor, value: object) -> None:
    """A local value must cover this rank's partition exactly; ``copy_`` would broadcast a wrong size."""
    require_type(function, "value", value, torch.Tensor)
    local_numel = param.ds_tensor.numel()
    if value.numel() != local_numel:
        raise InvalidArgumentError(f"{function}: value has {value.numel()} elements but this rank's partition "
                                   f"of the parameter has {local_numel}")


def _check_zero3(function: str, param: object) -> None:
    _check_param(function, param)
    if not _is_zero3(param):
        raise InvalidArgumentError(f"{function}: this API is only defined for ZeRO-3 partitioned parameters; "
                                   "param has no ds_id (it is not partitioned by ZeRO stage 3)")


# --- full values, assembled across ranks ---------------------------------------------------------


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The full fp32 master copy of ``param``, gathered from all ranks (None if unmanaged).

    Collective under ZeRO: every rank of the data-parallel group must call it.
    """
    _check_param("safe_get_full_fp32_param", param)
    if _is_zero3(param):
        return param._z3_optimizer.get_full_hp_param(param)
    if _is_linked(param):
        return param.get_full_hp_param()
    return None


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite this rank's part of the fp32 master copy from the full ``value``."""
    _check_param("safe_set_full_fp32_param", param)
    _check_managed("safe_set_full_fp32_param", param)
    _check_full_value("safe_set_full_fp32_param", param, value)
    if _is_zero3(param):
        param._z3_optimizer.set_full_hp_param(value, param)
    else:
        param.set_full_hp_param(value)


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> Optional[torch.Tensor]:
    """The full fp32 optimizer state ``optim_state_key`` (e.g. ``"exp_avg"``) of ``param``."""
    _check_param("safe_get_full_optimizer_state", param)
    _check_key("safe_get_full_optimizer_state", optim_state_key)
    if _is_zero3(param):
        return param._z3_optimizer.get_full_hp_param(param, optim_state_key)
    if _is_linked(param):
        return param.get_full_hp_param(optim_state_key)
    return None


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Overwrite this rank's part of optimizer state ``optim_state_key`` from the full ``value``."""
    _check_param("safe_set_full_optimizer_state", param)
    _check_key("safe_set_full_optimizer_state", optim_state_key)
    _check_managed("safe_set_full_optimizer_state", param)
    _check_full_value("safe_set_full_optimizer_state", param, value)
    if _is_zero3(param):
        param._z3_optimizer.set_full_hp_param(value, param, optim_state_key)
    else:
        param.set_full_hp_param(value, optim_state_key)


def safe_get_full_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The full gradient of ``param`` in the accumulation dtype, between backward and step."""
    _check_param("safe_get_full_grad", param)
    if getattr(param, "_hp_grad", None) is not None:  # bf16 optimizer: its own accumulation buffer
        return param.get_full_hp_grad()
    if param.grad is not None:
        return param.grad
    if _is_zero3(param):
        return param._z3_optimizer.get_fp32_grad_for_param(param)
    if _is_linked(param):
        return param.get_full_hp_grad()
    return None


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite the gradient of ``param`` (its partition under ZeRO) from the full ``value``."""
    _check_param("safe_set_full_grad", param)
    if param.grad is not None:  # copied as torch copies: a value that broadcasts to the gradient will do
        require_type("safe_set_full_grad", "value", value, torch.Tensor)
        try:
            broadcasts = torch.broadcast_shapes(value.shape, param.grad.shape) == param.grad.shape
        except RuntimeError:
            broadcasts = False
        if not broadcasts:
            raise InvalidArgumentError(f"safe_set_full_grad: value of shape {tuple(value.shape)} does not broadcast "
                                       f"to the gradient's shape {tuple(param.grad.shape)}")
        param.grad.copy_(value)
        return
    _check_full_value("safe_set_full_grad", param, value)
    _check_managed("safe_set_full_grad", param)
    if _is_zero3(param):
        param._z3_optimizer.set_fp32_grad_for_param(value, param)
    else:
        param.set_full_hp_grad(value)


def safe_update_full_grad_vectorized(param_list: List[torch.nn.Parameter], update_func: Callable) -> None:
    """Set each gradient to ``update_func(full_grad, param)``, batching the ZeRO-3 gathers.

    Every argument is checked before any gradient changes, so bad input leaves training untouched.
    """
    if isinstance(param_list, (torch.Tensor, str)) or not isinstance(param_list, Iterable):
        raise InvalidArgumentError(f"safe_update_full_grad_vectorized: param_list must be an iterable of "
                                   f"parameters, got {type(param_list).__name__}")
    if not callable(update_func):
        raise InvalidArgumentError("safe_update_full_grad_vectorized: update_func must be callable "
                                   "(full_grad, param) -> new_grad")
    params = list(param_list)
    for param in params:
        _check_param("safe_update_full_grad_vectorized", param)
    partitioned = []
    for param in params:
        if param.grad is not None:
            param.grad.copy_(update_func(param.grad, param))
        elif param.requires_grad:
            partitioned.append(param)
    if not partitioned:
        return
    if _is_zero3(partitioned[0]):
        partitioned[0]._z3_optimizer.update_fp32_grad_for_param_vectorized(update_func, partitioned)
    elif _is_linked(partitioned[0]):
        for param in partitioned:
            param.set_full_hp_grad(update_func(safe_get_full_grad(param), param))


# --- local partitions, ZeRO-3 only ---------------------------------------------------------------


def safe_get_local_grad(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's partition of the gradient of a ZeRO-3 parameter."""
    _check_zero3("safe_get_local_grad", param)
    return param._z3_optimizer.get_local_fp32_grad_for_param(param)


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite this rank's partition of the gradient of a ZeRO-3 parameter."""
    _check_zero3("safe_set_local_grad", param)
    _check_local_value("safe_set_local_grad", param, value)
    param._z3_optimizer.set_local_grad_for_param(value, param)


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's partition of the fp32 master copy of a ZeRO-3 parameter."""
    _check_zero3("safe_get_local_fp32_param", param)
    return param._z3_optimizer.get_local_fp32_param(param)


def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor:
    """This rank's partition of optimizer state ``optim_state_key`` of a ZeRO-3 parameter."""
    _check_zero3("safe_get_local_optimizer_state", param)
    _check_key("safe_get_local_optimizer_state", optim_state_key)
    return param._z3_optimizer.get_local_fp32_param(param, optim_state_key)


def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Overwrite this rank's partition of optimizer state ``optim_state_key`` of a ZeRO-3 parameter."""
    _check_zero3("safe_set_local_optimizer_state", param)
    _check_local_value("safe_set_local_optimizer_state", param, value)
    _check_key("safe_set_local_optimizer_state", optim_state_key)
    param._z3_optimizer.set_local_hp_param(value, param, optim_state_key)


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite this rank's partition of the fp32 master copy of a ZeRO-3 parameter."""
    _check_zero3("safe_set_local_fp32_param", param)
    _check_local_value("safe_set_local_fp32_param", param, value)
    param._z3_optimizer.set_local_hp_param(value, param)
