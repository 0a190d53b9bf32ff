"""ZeRO-3 leaf modules, as ``deepspeed.utils.z3_leaf_module``.

The ZeRO-3 parameter coordinator reads the ``_z3_leaf`` flag on modules, so the flag is set by
DeepSpeed's own functions; this module checks the arguments first and says what was expected.
"""
import importlib
from typing import Iterable, List, Tuple, Type, Union

import torch
from deepspeed.utils.z3_leaf_module import (apply_zero_leaf_module_config, get_z3_leaf_modules, z3_leaf_module,
                                             z3_leaf_parameter)

from ._validate import require_type
from .exceptions import InvalidArgumentError
from .logging import logger  # reachable here as in DeepSpeed's module

__all__ = [
    "apply_zero_leaf_module_config",
    "logger",
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]

# ``deepspeed.utils.z3_leaf_module`` is shadowed by the function of that name in deepspeed.utils.
_ds_leaf = importlib.import_module("deepspeed.utils.z3_leaf_module")

ModuleClasses = Union[List[Type], List[str]]


def _check_model(function: str, model: object) -> None:
    require_type(function, "model", model, torch.nn.Module)


def _checked_list(function: str, argument: str, values: object, item_types: Tuple[type, ...]) -> list:
    """``values`` as a list (read once, so a generator works), every item of ``item_types``."""
    if isinstance(values, (str, type)) or not isinstance(values, Iterable):
        raise InvalidArgumentError(f"{function}: {argument} must be a list, got {values!r:.80}")
    values = list(values)
    bad = [v for v in values if not isinstance(v, item_types)]
    if bad:
        allowed = " or ".join("class" if t is type else t.__name__ for t in item_types)
        raise InvalidArgumentError(f"{function}: every item of {argument} must be a {allowed}; got {bad!r:.80}")
    return values


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    """Flag (or unflag) one module as a ZeRO-3 leaf: its parameters are fetched all at once."""
    _check_model("set_z3_leaf_module", model)
    require_type("set_z3_leaf_module", "flag", flag, bool)
    _ds_leaf.set_z3_leaf_module(model, flag)


def set_z3_leaf_modules(model: torch.nn.Module,
                        leaf_module_classes: ModuleClasses,
                        raise_if_not_found: bool = True) -> List[torch.nn.Module]:
    """Flag every module of the given classes (types, class names or qualified names) as a leaf."""
    _check_model("set_z3_leaf_modules", model)
    leaf_module_classes = _checked_list("set_z3_leaf_modules", "leaf_module_classes", leaf_module_classes, (type, str))
    return _ds_leaf.set_z3_leaf_modules(model, leaf_module_classes, raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module,
                          leaf_module_classes: ModuleClasses,
                          raise_if_not_found: bool = True) -> List[torch.nn.Module]:
    """Clear the leaf flag on every module of the given classes."""
    _check_model("unset_z3_leaf_modules", model)
    leaf_module_classes = _checked_list("unset_z3_leaf_modules", "leaf_module_classes", leaf_module_classes, (type, str))
    return _ds_leaf.unset_z3_leaf_modules(model, leaf_module_classes, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: torch.nn.Module,
                                module_names: List[str],
                                flag: bool = True,
                                raise_if_not_found: bool = True) -> Tuple[List[torch.nn.Module], List[str]]:
    """Flag modules named as in ``model.named_modules()``; returns (matched modules, missing names)."""
    _check_model("set_z3_leaf_modules_by_name", model)
    module_names = _checked_list("set_z3_leaf_modules_by_name", "module_names", module_names, (str, ))
    require_type("set_z3_leaf_modules_by_name", "flag", flag, bool)
    return _ds_leaf.set_z3_leaf_modules_by_name(model, module_names, flag, raise_if_not_found)


def set_z3_leaf_modules_by_suffix(model: torch.nn.Module,
                                  module_name_suffixes: List[str],
                                  flag: bool = True,
                                  raise_if_not_found: bool = True) -> Tuple[List[torch.nn.Module], List[str]]:
    """Flag modules whose ``named_modules()`` name ends with a suffix; returns (matched, missing suffixes)."""
    _check_model("set_z3_leaf_modules_by_suffix", model)
    module_name_suffixes = _checked_list("set_z3_leaf_modules_by_suffix", "module_name_suffixes", module_name_suffixes, (str, ))
    require_type("set_z3_leaf_modules_by_suffix", "flag", flag, bool)
    return _ds_leaf.set_z3_leaf_modules_by_suffix(model, module_name_suffixes, flag, raise_if_not_found)
