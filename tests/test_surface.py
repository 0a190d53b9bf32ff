"""The import swap: every public name of deepspeed.utils is in ds_profutils, with the same signature."""
import importlib
import inspect
import subprocess
import sys

import deepspeed.utils as ds_utils
import pytest

import ds_profutils

# Submodules that mirror deepspeed/utils/ file for file.
MIRRORED_MODULES = ("logging", "comms_logging", "nvtx", "tensor_fragment", "mixed_precision_linkage",
                    "z3_leaf_module", "numa", "init_on_device", "groups", "timer", "bwc", "module_utils",
                    "exceptions")


def test_all_holds_exactly_the_deepspeed_names_plus_ours():
    assert len(ds_profutils.DEEPSPEED_UTILS_NAMES) == 58
    assert ds_profutils.__all__ == ds_profutils.DEEPSPEED_UTILS_NAMES + ds_profutils.PROFUTILS_NAMES
    assert len(set(ds_profutils.__all__)) == len(ds_profutils.__all__)


@pytest.mark.parametrize("name", ds_profutils.DEEPSPEED_UTILS_NAMES)
def test_name_exists_in_both(name):
    assert hasattr(ds_utils, name), f"deepspeed.utils has no {name}: DEEPSPEED_UTILS_NAMES is stale"
    assert hasattr(ds_profutils, name)


def _signature(obj):
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):
        return None


@pytest.mark.parametrize("name", [n for n in ds_profutils.DEEPSPEED_UTILS_NAMES if callable(getattr(ds_utils, n))])
def test_signature_matches_deepspeed(name):
    ours, theirs = _signature(getattr(ds_profutils, name)), _signature(getattr(ds_utils, name))
    if theirs is None:
        pytest.skip(f"{name} has no introspectable signature in DeepSpeed")
    ours_params = [(p.name, p.kind, p.default) for p in ours.parameters.values()]
    their_params = [(p.name, p.kind, p.default) for p in theirs.parameters.values()]
    assert ours_params == their_params


def test_z3_leaf_module_at_top_level_is_the_function():
    assert callable(ds_profutils.z3_leaf_module) and inspect.isfunction(ds_profutils.z3_leaf_module)


def test_shared_objects_are_deepspeeds():
    # The logger and the classes DeepSpeed creates instances of are DeepSpeed's own objects.
    assert ds_profutils.logger is ds_utils.logger
    assert ds_profutils.RepeatingLoader is ds_utils.RepeatingLoader
    assert ds_profutils.tensor_fragment is ds_utils.tensor_fragment
    assert ds_profutils.fragment_address is ds_utils.fragment_address
    assert ds_profutils.DeprecatedException is ds_utils.DeprecatedException
    assert issubclass(ds_profutils.OnDevice, ds_utils.OnDevice)


@pytest.mark.parametrize("module", MIRRORED_MODULES)
def test_submodule_mirrors_deepspeed_file(module):
    ours = importlib.import_module(f"ds_profutils.{module}")
    theirs = importlib.import_module(f"deepspeed.utils.{module}")
    assert isinstance(ours.__all__, list) and ours.__all__
    for name in ours.__all__:
        assert hasattr(ours, name), f"ds_profutils.{module}.__all__ names missing {name}"
    # Every public function and class DeepSpeed defines in that file is reachable from ours.
    defined = [
        name for name, value in vars(theirs).items() if not name.startswith("_") and (
            inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == theirs.__name__
    ]
    assert defined or module == "exceptions"
    assert [name for name in defined if not hasattr(ours, name)] == []


def test_nvtx_module_names_deepspeed_code_touches():
    from ds_profutils import nvtx
    assert nvtx.DEEPSPEED_NVTX_DOMAIN == "DeepSpeed"
    assert nvtx.enable_nvtx is True
    assert callable(nvtx.is_compiling) and callable(nvtx.get_accelerator)


def test_import_adds_no_log_handler():
    code = ("import logging, deepspeed.utils; before = len(logging.getLogger('DeepSpeed').handlers); "
            "import ds_profutils; print(before, len(logging.getLogger('DeepSpeed').handlers))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-2:]
    assert out[0] == out[1]
