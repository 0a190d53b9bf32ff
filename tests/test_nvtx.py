"""instrument_w_nvtx: calls the accelerator as DeepSpeed's does, free where nobody can listen, and
ranges in the torch trace while a ds_profutils profiler records."""
import deepspeed.accelerator.real_accelerator as installed
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
    try:
        nvtx.configure_nvtx(enabled=False)
        wrapped(1)
        assert tool_attached.calls == []
        nvtx.configure_nvtx(enabled=True, domain="MyJob")
        wrapped(1)
        assert tool_attached.calls == [("push", "step", "MyJob"), ("pop", "MyJob")]
    finally:
        nvtx.configure_nvtx()


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
