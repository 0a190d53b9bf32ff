"""instrument_w_nvtx: free when nobody listens, exact ranges when NVTX or torch.profiler does."""
import pytest
import torch
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
