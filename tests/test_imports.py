"""``import ds_profutils`` stays cheap: names resolve on first use, and the ones shadowed by submodules
stay DeepSpeed's objects whatever the import order.  Each check runs in a fresh interpreter."""
import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import setuptools

OUR_ADDITIONS = ("ds_profutils.torch_profiler", "ds_profutils.engine", "ds_profutils.zero3", "ds_profutils.report", "ds_profutils.config")
FRAMEWORKS = ("transformers", "accelerate", "lightning", "pytorch_lightning")


def fresh_python(code: str) -> dict:
    """Run ``code`` in a new interpreter; it prints one JSON object, which is returned."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def loaded_after(statement: str) -> dict:
    return fresh_python(f"""
import json, sys
{statement}
print(json.dumps({{name: name in sys.modules for name in
                  ("torch", "deepspeed", "ds_profutils.logging", {", ".join(map(repr, OUR_ADDITIONS + FRAMEWORKS))})}}))
""")


def test_importing_the_package_imports_nothing_heavy():
    loaded = loaded_after("import ds_profutils")
    assert not any(loaded.values()), loaded


def test_a_mirror_name_loads_its_module_and_not_our_additions():
    loaded = loaded_after("from ds_profutils import log_dist")
    assert loaded["ds_profutils.logging"] and loaded["deepspeed"]
    assert not any(loaded[name] for name in OUR_ADDITIONS), loaded


def test_the_profiler_loads_only_its_own_subpackage_and_what_it_builds_on():
    loaded = loaded_after("from ds_profutils import profiler")
    assert loaded["ds_profutils.torch_profiler"] and loaded["ds_profutils.config"]
    assert not loaded["ds_profutils.zero3"] and not loaded["ds_profutils.engine"] and not loaded["ds_profutils.report"]


@pytest.mark.parametrize("statement", ["import ds_profutils", "from ds_profutils import attach",
                                       "from ds_profutils import *; import ds_profutils.integrations"])
def test_no_framework_is_imported_by_ours(statement):
    """``attach`` recognises a Trainer, an Accelerator or a Lightning Trainer without importing their packages."""
    loaded = loaded_after(statement)
    assert not any(loaded[name] for name in FRAMEWORKS), loaded


def test_the_report_needs_neither_torch_nor_deepspeed():
    loaded = loaded_after("import ds_profutils.report, ds_profutils.cli")
    assert loaded["ds_profutils.report"] and not loaded["torch"] and not loaded["deepspeed"]


@pytest.mark.parametrize("order", [
    "import ds_profutils.z3_leaf_module, ds_profutils.tensor_fragment",
    "from ds_profutils import z3_leaf_module, tensor_fragment",
    "import ds_profutils; ds_profutils.z3_leaf_module; ds_profutils.tensor_fragment; "
    "import ds_profutils.z3_leaf_module, ds_profutils.tensor_fragment",
    "from ds_profutils.z3_leaf_module import set_z3_leaf_modules; from ds_profutils.tensor_fragment import "
    "safe_get_full_grad",
    "from ds_profutils import *",
])
def test_shadowed_names_stay_deepspeeds_objects_in_any_import_order(order):
    found = fresh_python(f"""
import json, sys, types
{order}
import ds_profutils, deepspeed.utils as ds_utils
print(json.dumps({{
    "z3_leaf_module": ds_profutils.z3_leaf_module is ds_utils.z3_leaf_module,
    "tensor_fragment": ds_profutils.tensor_fragment is ds_utils.tensor_fragment,
    "submodules_importable": all(isinstance(sys.modules["ds_profutils." + name], types.ModuleType)
                                 for name in ("z3_leaf_module", "tensor_fragment")
                                 if "ds_profutils." + name in sys.modules),
}}))
""")
    assert found == {"z3_leaf_module": True, "tensor_fragment": True, "submodules_importable": True}


def test_unknown_attribute_is_an_attribute_error():
    import ds_profutils
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        ds_profutils.no_such_name  # noqa: B018


def test_nvtx_is_an_extra_not_a_requirement(monkeypatch):
    """Installing ds_profutils must not make DeepSpeed's CUDA accelerator push into another NVTX domain:
    it does so whenever the nvtx package imports."""
    declared = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: declared.update(kwargs))
    runpy.run_path(str(Path(__file__).parents[1] / "setup.py"))
    assert not [r for r in declared["install_requires"] if r.split(">")[0].split("=")[0].strip() == "nvtx"]
    assert declared["extras_require"]["nvtx"] == ["nvtx>=0.2"]
