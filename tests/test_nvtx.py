"""instrument_w_nvtx: calls the accelerator as DeepSpeed's does, free where nobody can listen, and
ranges in the torch trace while a ds_profutils profiler records."""
import inspect
import logging
import pickle
import subprocess
import sys
import types

import deepspeed.accelerator.cuda_accelerator as ds_cuda_accelerator
import deepspeed.accelerator.real_accelerator as installed
import deepspeed.utils.nvtx as ds_nvtx
import pytest
import torch
from deepspeed.accelerator import set_accelerator
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
from torch.profiler import ProfilerActivity, profile

import ds_profutils
from ds_profutils import nvtx


class RecordingAccelerator:
    """Stands in for a CUDA accelerator: records range pushes and pops."""

    supports_nvtx_domain = True

    def __init__(self):
        self.calls = []

    def range_push(self, msg, domain=None):
        self.calls.append(("push", msg, domain))

    def range_pop(self, domain=None):
        self.calls.append(("pop", domain))


@pytest.fixture
def tool_attached(monkeypatch):
    """Pretend Nsight injected an NVTX tool, and route ranges to a recording accelerator."""
    accelerator = RecordingAccelerator()
    monkeypatch.setattr(nvtx, "_tool_attached", True)
    monkeypatch.setattr(nvtx, "get_accelerator", lambda: accelerator)
    nvtx._refresh()
    yield accelerator
    monkeypatch.undo()
    nvtx._refresh()


def step(x, *, scale=2):
    """Docstring kept."""
    return x * scale


def test_wraps_keeps_name_doc_and_wrapped():
    wrapped = ds_profutils.instrument_w_nvtx(step)
    assert wrapped.__name__ == "step" and wrapped.__doc__ == "Docstring kept."
    assert wrapped.__wrapped__ is step
    assert wrapped(3, scale=3) == 9


@ds_profutils.instrument_w_nvtx
def module_level_step(x, *, scale=2):
    """Decorated where it is defined, as DeepSpeed's instrumented functions are."""
    return x * scale


def test_a_decorated_module_function_keeps_its_signature_and_pickles_to_itself():
    """Code that sends a decorated function to another process (pickle resolves it by module and
    qualified name) or inspects it (help(), autodoc) sees the function, not the wrapper."""
    assert str(inspect.signature(module_level_step)) == "(x, *, scale=2)"
    assert (module_level_step.__module__, module_level_step.__qualname__) == (__name__, "module_level_step")
    assert pickle.loads(pickle.dumps(module_level_step)) is module_level_step


def test_no_tool_no_profiler_means_no_range():
    assert nvtx.nvtx_tool_attached() is False  # no Nsight on this machine
    assert not nvtx.ranges_active()


def test_range_pushed_and_popped_in_deepspeed_domain(tool_attached):
    assert ds_profutils.instrument_w_nvtx(step)(2) == 4
    assert tool_attached.calls == [("push", "step", "DeepSpeed"), ("pop", "DeepSpeed")]


def test_range_popped_when_the_call_raises(tool_attached):

    @ds_profutils.instrument_w_nvtx
    def boom():
        raise KeyError("x")

    with pytest.raises(KeyError):
        boom()
    assert tool_attached.calls == [("push", "test_range_popped_when_the_call_raises.<locals>.boom", "DeepSpeed"),
                                   ("pop", "DeepSpeed")]


def test_assigning_enable_nvtx_switches_ranges_off_and_on(tool_attached):
    wrapped = ds_profutils.instrument_w_nvtx(step)
    nvtx.enable_nvtx = False
    try:
        wrapped(1)
        assert tool_attached.calls == []
    finally:
        nvtx.enable_nvtx = True
    wrapped(1)
    assert len(tool_attached.calls) == 2


def test_deepspeeds_own_switch_counts_when_deepspeed_clears_it(tool_attached, monkeypatch):
    """engine.compile() sets deepspeed.utils.nvtx.enable_nvtx = False: our ranges stop as DeepSpeed's do."""
    import deepspeed.utils.nvtx as ds_nvtx

    wrapped = ds_profutils.instrument_w_nvtx(step)
    monkeypatch.setattr(ds_nvtx, "enable_nvtx", False)
    wrapped(1)
    assert tool_attached.calls == [] and not nvtx.ranges_active()
    monkeypatch.setattr(ds_nvtx, "enable_nvtx", True)
    wrapped(1)
    assert len(tool_attached.calls) == 2 and nvtx.ranges_active()


def test_config_disables_and_renames_domain(tool_attached):
    wrapped = ds_profutils.instrument_w_nvtx(step)
    undo = nvtx.configure_nvtx(enabled=False)
    wrapped(1)
    assert tool_attached.calls == []
    undo()
    undo = nvtx.configure_nvtx(enabled=True, domain="MyJob")
    wrapped(1)
    assert tool_attached.calls == [("push", "step", "MyJob"), ("pop", "MyJob")]
    undo()
    wrapped(1)
    assert tool_attached.calls[2:] == [("push", "step", "DeepSpeed"), ("pop", "DeepSpeed")]


def test_skipped_while_compiling(tool_attached, monkeypatch):
    monkeypatch.setattr(nvtx, "is_compiling", lambda: True)
    ds_profutils.instrument_w_nvtx(step)(1)
    assert tool_attached.calls == []


def test_ranges_appear_in_torch_trace_while_recording():
    wrapped = ds_profutils.instrument_w_nvtx(step)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        nvtx.set_torch_profiler_recording(True)
        try:
            wrapped(torch.ones(2))
        finally:
            nvtx.set_torch_profiler_recording(False)
        wrapped(torch.ones(2))  # after recording stops: no range
    names = [event.name for event in prof.events()]
    assert names.count("step") == 1


# --- every accelerator DeepSpeed supports: installed with set_accelerator, calls recorded ----------


class DomainAccelerator(CPU_Accelerator):
    """An out-of-tree accelerator whose ranges go somewhere, taking an NVTX-style domain."""

    supports_nvtx_domain = True

    def __init__(self):
        super().__init__()
        self.calls = []

    def range_push(self, msg, domain=None, category=None):
        self.calls.append(("push", msg, domain))

    def range_pop(self, domain=None):
        self.calls.append(("pop", domain))


class LegacyAccelerator(CPU_Accelerator):
    """An accelerator written before domains: ``range_push(msg)`` only."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def range_push(self, msg):
        self.calls.append(("push", msg))

    def range_pop(self):
        self.calls.append(("pop", ))


class RecordingDomain:
    """What the nvtx package's domain would be with Nsight attached."""

    def __init__(self):
        self.calls = []

    def push_range(self, message=None, category=None):
        self.calls.append(("push", message))

    def pop_range(self):
        self.calls.append(("pop", ))


def cuda_accelerator():
    """DeepSpeed's real CUDA accelerator (its own range_push), its NVTX domain recording; no GPU needed."""
    accelerator = CUDA_Accelerator.__new__(CUDA_Accelerator)
    accelerator._name = "cuda"
    accelerator._nvtx_domains = {"DeepSpeed": RecordingDomain()}
    return accelerator


@pytest.fixture
def install():
    """Install an accelerator as a user would (deepspeed.accelerator.set_accelerator); put the old one back."""
    previous = installed.ds_accelerator

    def install(accelerator):
        set_accelerator(accelerator)
        return accelerator

    yield install
    set_accelerator(previous)
    nvtx._refresh()


def test_domain_accelerator_is_called_with_the_domain_as_deepspeed_calls_it(install):
    accelerator = install(DomainAccelerator())
    assert ds_profutils.instrument_w_nvtx(step)(2) == 4
    assert accelerator.calls == [("push", "step", "DeepSpeed"), ("pop", "DeepSpeed")]
    assert nvtx.ranges_active() and nvtx._idle_accelerator is nvtx._NOBODY


def test_legacy_accelerator_is_called_without_a_domain(install):
    accelerator = install(LegacyAccelerator())
    ds_profutils.instrument_w_nvtx(step)(2)
    assert accelerator.calls == [("push", "step"), ("pop", )]


def test_accelerator_replaced_after_decoration_is_called_on_the_next_call(install):
    wrapped = ds_profutils.instrument_w_nvtx(step)
    install(CPU_Accelerator())
    wrapped(1)
    assert nvtx._idle_accelerator is installed.ds_accelerator  # the CPU accelerator: idle
    accelerator = install(DomainAccelerator())
    wrapped(1)
    assert accelerator.calls == [("push", "step", "DeepSpeed"), ("pop", "DeepSpeed")]


def test_cpu_accelerator_takes_the_idle_shortcut(install, monkeypatch):
    accelerator = install(CPU_Accelerator())
    pushed = []
    monkeypatch.setattr(CPU_Accelerator, "range_push", lambda self, *a, **k: pushed.append(a))
    nvtx._refresh()
    # CPU's range_push replaced: it might be heard now, so it is called.
    ds_profutils.instrument_w_nvtx(step)(1)
    assert pushed == [("step", )]
    monkeypatch.undo()
    nvtx._refresh()
    assert nvtx._idle_accelerator is accelerator and not nvtx.ranges_active()


def test_cuda_without_a_tool_is_idle_and_with_a_tool_pushes_in_the_domain(install, monkeypatch):
    accelerator = install(cuda_accelerator())
    domain = accelerator._nvtx_domains["DeepSpeed"]
    wrapped = ds_profutils.instrument_w_nvtx(step)
    monkeypatch.setattr(nvtx, "_tool_attached", False)
    nvtx._refresh()
    wrapped(1)
    assert domain.calls == [] and nvtx._idle_accelerator is accelerator
    monkeypatch.setattr(nvtx, "_tool_attached", True)
    nvtx._refresh()
    wrapped(1)
    assert domain.calls == [("push", "step"), ("pop", )]


def test_replacing_module_names_takes_effect_on_the_next_call(install, monkeypatch):
    accelerator = install(CPU_Accelerator())
    wrapped = ds_profutils.instrument_w_nvtx(step)
    wrapped(1)  # idle
    other = DomainAccelerator()
    monkeypatch.setattr(nvtx, "get_accelerator", lambda: other)
    wrapped(1)
    monkeypatch.setattr(nvtx, "is_compiling", lambda: True)
    wrapped(1)
    assert other.calls == [("push", "step", "DeepSpeed"), ("pop", "DeepSpeed")]
    monkeypatch.undo()
    accelerator = install(DomainAccelerator())
    wrapped(1)
    assert accelerator.calls == [("push", "step", "DeepSpeed"), ("pop", "DeepSpeed")]


# --- the "nvtx" section governs DeepSpeed's own instrumented functions -----------------------------


@pytest.fixture
def deepspeed_sites(monkeypatch):
    """DeepSpeed's instrument_w_nvtx and ours both push into one recording accelerator that takes domains."""
    accelerator = RecordingAccelerator()
    monkeypatch.setattr(ds_nvtx, "get_accelerator", lambda: accelerator)
    monkeypatch.setattr(nvtx, "get_accelerator", lambda: accelerator)
    monkeypatch.setattr(nvtx, "_tool_attached", True)
    return accelerator


def deepspeeds_free_param():
    """Call one of DeepSpeed's ~85 @instrument_w_nvtx functions (ZeRO-3's free_param; it refuses this
    stand-in parameter right after DeepSpeed's decorator pushed its range)."""
    from deepspeed.runtime.zero.partition_parameters import free_param

    with pytest.raises(RuntimeError):
        free_param(types.SimpleNamespace(ds_active_sub_modules={1}, ds_summary=lambda: "stand-in"))


def test_section_switches_deepspeeds_own_ranges_off_and_undo_puts_them_back(deepspeed_sites):
    assert ds_nvtx.enable_nvtx
    undo = nvtx.configure_nvtx(enabled=False)
    deepspeeds_free_param()
    ds_profutils.instrument_w_nvtx(step)(1)
    assert deepspeed_sites.calls == [] and ds_nvtx.enable_nvtx is False
    undo()
    deepspeeds_free_param()
    assert deepspeed_sites.calls == [("push", "free_param", "DeepSpeed")] and ds_nvtx.enable_nvtx is True


def test_section_domain_names_deepspeeds_ranges_where_the_accelerator_takes_one(deepspeed_sites):
    undo = nvtx.configure_nvtx(enabled=True, domain="MyJob")
    deepspeeds_free_param()
    ds_profutils.instrument_w_nvtx(step)(1)
    assert deepspeed_sites.calls == [("push", "free_param", "MyJob"), ("push", "step", "MyJob"), ("pop", "MyJob")]
    undo()
    assert (ds_nvtx.DEEPSPEED_NVTX_DOMAIN, nvtx.DEEPSPEED_NVTX_DOMAIN) == ("DeepSpeed", "DeepSpeed")


def test_section_turns_deepspeeds_switch_on_where_compile_cleared_it(deepspeed_sites, monkeypatch):
    monkeypatch.setattr(ds_nvtx, "enable_nvtx", False)  # as engine.compile() leaves it
    undo = nvtx.configure_nvtx(enabled=True)
    deepspeeds_free_param()
    assert deepspeed_sites.calls == [("push", "free_param", "DeepSpeed")]
    undo()
    assert ds_nvtx.enable_nvtx is False


def test_configurations_undone_in_any_order_leave_the_switches_as_before(deepspeed_sites):
    before = (nvtx.enable_nvtx, nvtx.DEEPSPEED_NVTX_DOMAIN, ds_nvtx.enable_nvtx, ds_nvtx.DEEPSPEED_NVTX_DOMAIN)
    undo_actor = nvtx.configure_nvtx(enabled=True, domain="Actor")
    undo_critic = nvtx.configure_nvtx(enabled=False, domain="Critic")
    undo_critic()
    assert (nvtx.enable_nvtx, ds_nvtx.DEEPSPEED_NVTX_DOMAIN) == (True, "Actor")  # the one still in force
    undo_actor()
    undo_actor()  # twice: nothing more
    assert (nvtx.enable_nvtx, nvtx.DEEPSPEED_NVTX_DOMAIN, ds_nvtx.enable_nvtx, ds_nvtx.DEEPSPEED_NVTX_DOMAIN) == before
    undo_actor = nvtx.configure_nvtx(enabled=False, domain="Actor")
    undo_critic = nvtx.configure_nvtx(enabled=True, domain="Critic")
    undo_actor()
    assert (ds_nvtx.enable_nvtx, ds_nvtx.DEEPSPEED_NVTX_DOMAIN) == (True, "Critic")
    undo_critic()
    assert (nvtx.enable_nvtx, nvtx.DEEPSPEED_NVTX_DOMAIN, ds_nvtx.enable_nvtx, ds_nvtx.DEEPSPEED_NVTX_DOMAIN) == before


def test_a_domain_the_accelerator_cannot_take_is_reported_once_and_deepspeeds_kept(monkeypatch, ds_caplog):
    accelerator = LegacyAccelerator()
    monkeypatch.setattr(nvtx, "get_accelerator", lambda: accelerator)
    undos = [nvtx.configure_nvtx(enabled=True, domain="NoDomainHere") for _ in range(2)]
    assert ds_nvtx.DEEPSPEED_NVTX_DOMAIN == "DeepSpeed"
    lines = [r.getMessage() for r in ds_caplog.records if "does not apply" in r.getMessage()]
    assert lines == ["[Rank -1] ds_profutils: nvtx.domain 'NoDomainHere' does not apply here: the LegacyAccelerator "
                     "accelerator takes no NVTX domain"]
    for undo in undos:
        undo()
    nvtx.configure_nvtx(enabled=True)()  # DeepSpeed's own domain name: nothing to report
    assert len([r for r in ds_caplog.records if "does not apply" in r.getMessage()]) == 1


def test_cuda_takes_a_domain_only_with_the_nvtx_package(monkeypatch):
    accelerator = cuda_accelerator()
    monkeypatch.setattr(ds_cuda_accelerator, "nvtx", types.SimpleNamespace(get_domain=lambda name: None))
    assert nvtx.domain_not_applicable(accelerator) is None  # as with ds-profutils[nvtx]
    monkeypatch.setattr(ds_cuda_accelerator, "nvtx", None)  # as without it
    assert "pip install ds-profutils[nvtx]" in nvtx.domain_not_applicable(accelerator)


@pytest.fixture
def without_nvtx_package(monkeypatch):
    """``import nvtx`` fails, as where the ds-profutils[nvtx] extra is not installed; tool detection asked anew."""
    monkeypatch.setitem(sys.modules, "nvtx", None)
    monkeypatch.setattr(nvtx, "_tool_attached", None)
    monkeypatch.delenv("NVTX_INJECTION64_PATH", raising=False)


def test_tool_detection_without_the_package_warns_once_on_cuda(without_nvtx_package, install, ds_caplog):
    accelerator = install(cuda_accelerator())
    wrapped = ds_profutils.instrument_w_nvtx(step)
    for _ in range(3):
        wrapped(1)
    warnings = [r.getMessage() for r in ds_caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "the nvtx package is not installed" in warnings[0]
    assert "none is attached" in warnings[0] and nvtx._idle_accelerator is accelerator


def test_tool_detection_without_the_package_reads_the_injection_variable(without_nvtx_package, install,
                                                                        monkeypatch):
    monkeypatch.setenv("NVTX_INJECTION64_PATH", "/opt/nsight/libToolsInjection64.so")
    monkeypatch.setattr(ds_cuda_accelerator, "nvtx", None)  # DeepSpeed's CUDA accelerator without the package
    pushed = []
    monkeypatch.setattr(ds_cuda_accelerator.torch.cuda, "nvtx",
                        types.SimpleNamespace(range_push=pushed.append, range_pop=lambda: pushed.append("pop")))
    install(cuda_accelerator())
    ds_profutils.instrument_w_nvtx(step)(1)
    assert nvtx.nvtx_tool_attached() is True and pushed == ["step", "pop"]  # torch.cuda.nvtx's default domain


def test_cpu_never_asks_for_a_tool(without_nvtx_package, install, ds_caplog):
    install(CPU_Accelerator())
    ds_profutils.instrument_w_nvtx(step)(1)
    assert nvtx._tool_attached is None
    assert [r for r in ds_caplog.records if r.levelno >= logging.WARNING] == []


def test_the_package_is_an_extra_that_ds_profutils_does_without():
    code = """
import sys
sys.modules["nvtx"] = None  # import nvtx fails, as without ds-profutils[nvtx]
import ds_profutils
from ds_profutils import instrument_w_nvtx, nvtx
undo = nvtx.configure_nvtx(enabled=True, domain="Job")
print(instrument_w_nvtx(lambda x: x + 1)(1)); undo()
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "2"
