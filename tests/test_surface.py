"""The import swap: every public name of deepspeed.utils is in ds_profutils, with the same signature."""
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

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


# deepspeed/utils/ modules we add nothing to: DeepSpeed's own, read through (ds_profutils/_read_through.py).
READ_THROUGH_MODULES = ("debug", "pin_memory", "pin_memory_tracker", "static_cache", "torch", "types", "zero_to_fp32",
                        "zero_to_torch")
_CONSTANT = (str, int, float, bool, tuple, list, dict, frozenset, set)


def _deepspeed_modules():
    folder = Path(ds_utils.__file__).parent
    return sorted(path.stem for path in folder.glob("*.py") if path.stem != "__init__")


def test_every_deepspeed_utils_module_has_its_namesake():
    assert _deepspeed_modules() == sorted(MIRRORED_MODULES + READ_THROUGH_MODULES + ("config", ))


@pytest.mark.parametrize("module", MIRRORED_MODULES + ("config", ))
def test_a_mirror_holds_every_name_deepspeeds_module_gives(module):
    """What ``from deepspeed.utils.<module> import X`` gives (DeepSpeed's functions, classes and constants, those it
    re-exports from other DeepSpeed modules too), ``from ds_profutils.<module> import X`` gives; torch's, typing's
    and numpy's names it happens to import are not the mirror's to give."""
    ours = importlib.import_module(f"ds_profutils.{module}")
    theirs = importlib.import_module(f"deepspeed.utils.{module}")
    given = [name for name, value in vars(theirs).items() if not name.startswith("_") and name != "TYPE_CHECKING" and (
        isinstance(value, _CONSTANT) or (getattr(value, "__module__", None) or "").startswith("deepspeed"))]
    assert [name for name in given if not hasattr(ours, name)] == []


@pytest.mark.parametrize("module", READ_THROUGH_MODULES)
def test_a_read_through_module_is_deepspeeds(module):
    ours = importlib.import_module(f"ds_profutils.{module}")
    theirs = importlib.import_module(f"deepspeed.utils.{module}")
    star_ours, star_theirs = {}, {}
    exec(f"from ds_profutils.{module} import *", star_ours)
    exec(f"from deepspeed.utils.{module} import *", star_theirs)
    star_ours.pop("__builtins__"), star_theirs.pop("__builtins__")
    assert star_ours.keys() == star_theirs.keys()  # a star import takes what DeepSpeed's takes, the same objects
    assert all(star_ours[name] is value for name, value in star_theirs.items())
    assert all(getattr(ours, name) is value for name, value in vars(theirs).items() if not name.startswith("__"))
    assert getattr(ds_profutils, module) is ours
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        ours.nothing_here


def test_zero_to_fp32_runs_deepspeeds_command_line():
    result = subprocess.run([sys.executable, "-m", "ds_profutils.zero_to_fp32", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "checkpoint_dir" in result.stdout
    assert "RuntimeWarning" not in result.stderr


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
