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


# ---- the package's structure, read from its imports (every import statement, lazy ones included) ----------

PACKAGE = Path(__file__).parents[1] / "ds_profutils"
MAX_MODULE_LINES = 400
MAX_FOLDER_MODULES = 12
FORBIDDEN = {  # arrows point down: a package never imports one above it (docs: /work/shared/DESIGN.md "Layout")
    "zero3": {"engine", "torch_profiler", "integrations", "report", "diff", "cli"},
    "torch_profiler": {"engine", "zero3", "integrations", "report", "diff", "cli"},
    "engine": {"integrations", "report", "diff", "cli"},
    "config": {"engine", "zero3", "torch_profiler", "integrations", "report", "diff"},
    "report": {"engine", "zero3", "torch_profiler", "integrations"},
    "diff": {"engine", "zero3", "torch_profiler", "integrations"},
}


def _module_names():
    """Every module of ds_profutils: dotted name -> file."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("ds_profutils", ) + path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name, path, modules):
    """The ds_profutils modules ``name`` imports (what ``from pkg import x`` names: the submodule x if there is
    one, else the package)."""
    import ast

    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            base = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):  # a module's own package: implicit
                found.add(target)
    return found


def _graph():
    modules = _module_names()
    return {name: _imports(name, path, modules) for name, path in modules.items()}, modules


def test_no_modules_import_each_other_in_a_circle():
    graph, _ = _graph()
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert circles == []


def test_imports_point_down():
    graph, _ = _graph()
    wrong = []
    for name, targets in graph.items():
        floor = name.split(".")[1] if name.count(".") else None
        for target in targets:
            if target.count(".") and target.split(".")[1] in FORBIDDEN.get(floor, ()):
                wrong.append(f"{name} -> {target}")
    assert wrong == []


def test_zero3_holds_no_attach():
    graph, modules = _graph()
    zero3 = [name for name in modules if name.startswith("ds_profutils.zero3")]
    assert zero3 and not any("def attach(" in modules[name].read_text() for name in zero3)


def test_no_module_over_the_line_budget():
    _, modules = _graph()
    long = {name: n for name, path in modules.items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_no_folder_over_the_module_budget_but_the_top_level_mirror():
    counts = {}
    for path in PACKAGE.rglob("*.py"):
        if path.parent != PACKAGE:
            counts[path.parent.name] = counts.get(path.parent.name, 0) + 1
    assert {folder: n for folder, n in counts.items() if n > MAX_FOLDER_MODULES} == {}
