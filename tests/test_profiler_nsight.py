"""Nsight capture ranges: the exact start/stop/range sequence (with a recording CUDA stand-in), and
the CPU path for real."""
import pytest
import torch

from ds_profutils import profiler, step_profiler
from ds_profutils.torch_profiler import nsight
from ds_profutils.logging import warning_once
from profiler_testing import profiler_steps, read_trace


class RecordingCudaAccelerator:
    """What the profiler may touch of DeepSpeed's CUDA accelerator, writing each call to ``calls``."""

    def __init__(self, calls):
        self.calls = calls

    def device_name(self, device_index=None):
        return "cuda"

    def range_push(self, msg, domain=None, category=None):
        self.calls.append(f"push {msg}")

    def range_pop(self, domain=None):
        self.calls.append("pop")


@pytest.fixture
def cuda_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(nsight, "get_accelerator", lambda: RecordingCudaAccelerator(calls))
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: calls.append("cudaProfilerStart"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: calls.append("cudaProfilerStop"))
    return calls


def test_capture_brackets_each_active_window(tmp_path, cuda_calls, capsys, monkeypatch):
    activities = []

    class SpyProfile(torch.profiler.profile):

        def __init__(self, **kwargs):
            activities.append(set(kwargs["activities"]))
            super().__init__(**kwargs)

    monkeypatch.setattr(torch.profiler, "profile", SpyProfile)
    monkeypatch.setattr(torch.profiler, "supported_activities",
                        lambda: {torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA})

    @profiler(output_dir=str(tmp_path), nsight_enabled=True, nsight_output="run1", skip_first=1, wait=1, warmup=1,
              active=2, repeat=2)
    def train():
        for _ in range(12):
            step_profiler()

    train()
    window = ["cudaProfilerStart", "push ProfilerStep#{}", "pop", "push ProfilerStep#{}", "pop", "cudaProfilerStop"]
    expected = [c.format(s) for c, s in zip(window, [None, 3, None, 4, None, None])]
    expected += [c.format(s) for c, s in zip(window, [None, 7, None, 8, None, None])]
    assert cuda_calls == expected
    assert "nsys profile --capture-range=cudaProfilerApi --capture-range-end=repeat -o run1" in capsys.readouterr().out
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [3, 4, 7, 8]  # torch trace too
    # CUPTI serves one client: while Nsight captures, torch records CPU activity only.
    assert activities == [{torch.profiler.ProfilerActivity.CPU}] * 2


def test_capture_is_closed_when_the_run_fails_inside_a_window(tmp_path, cuda_calls):

    @profiler(output_dir=str(tmp_path), nsight_enabled=True, skip_first=0, wait=0, warmup=0, active=5)
    def train():
        step_profiler()
        raise RuntimeError("step 1 failed")

    with pytest.raises(RuntimeError):
        train()
    assert cuda_calls == [
        "cudaProfilerStart", "push ProfilerStep#0", "pop", "push ProfilerStep#1", "pop", "cudaProfilerStop"
    ]


def test_cpu_accelerator_warns_once_and_profiles_on(tmp_path, ds_caplog):
    warning_once.cache_clear()
    for run in range(2):
        profiler(output_dir=str(tmp_path / str(run)), nsight_enabled=True, skip_first=0, wait=0, warmup=0,
                 active=1)(lambda: step_profiler())()
        assert profiler_steps(read_trace(tmp_path / str(run) / "trace_rank_0.json")) == [0]
    assert ds_caplog.text.count("Nsight capture ranges need a CUDA accelerator, this one is 'cpu'") == 1
