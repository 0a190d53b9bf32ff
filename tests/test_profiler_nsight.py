"""Nsight capture ranges: the exact synchronize/start/stop/range sequence (with a recording CUDA stand-in),
CUDA activity kept in the torch trace unless nsys is attached, and the CPU path for real."""
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

    def synchronize(self, device_index=None):
        self.calls.append("synchronize")

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


@pytest.mark.parametrize("nsys_attached", [False, True])
def test_capture_brackets_each_active_window(tmp_path, cuda_calls, capsys, monkeypatch, nsys_attached):
    """The device is synchronized before each start and each stop, so the capture holds exactly the active
    steps' device work: the warmup step's last kernels end before it, the last active step's inside it."""
    if nsys_attached:
        monkeypatch.setenv("NSYS_PROFILING_SESSION_ID", "1")
    else:
        monkeypatch.delenv("NSYS_PROFILING_SESSION_ID", raising=False)
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
    window = ["synchronize", "cudaProfilerStart", "push ProfilerStep#{}", "pop", "push ProfilerStep#{}", "pop",
              "synchronize", "cudaProfilerStop"]
    expected = [c.format(s) for c, s in zip(window, [None, None, 3, None, 4, None, None, None])]
    expected += [c.format(s) for c, s in zip(window, [None, None, 7, None, 8, None, None, None])]
    assert cuda_calls == expected
    out = capsys.readouterr().out
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [3, 4, 7, 8]  # torch trace too
    cpu, cuda = torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA
    if nsys_attached:  # CUPTI serves one client: while nsys captures, torch records CPU activity only
        assert activities == [{cpu}] * 2 and "nsys is attached, so the torch trace holds CPU activity only" in out
    else:  # nothing captures: the torch trace keeps the device's activity, and the start says how to capture
        assert activities == [{cpu, cuda}] * 2 and "nsys is not attached, so the torch trace keeps CUDA activity" in out
        assert "nsys profile --capture-range=cudaProfilerApi --capture-range-end=repeat -o run1" in out


def test_capture_is_closed_when_the_run_fails_inside_a_window(tmp_path, cuda_calls):

    @profiler(output_dir=str(tmp_path), nsight_enabled=True, skip_first=0, wait=0, warmup=0, active=5)
    def train():
        step_profiler()
        raise RuntimeError("step 1 failed")

    with pytest.raises(RuntimeError):
        train()
    assert cuda_calls == ["synchronize", "cudaProfilerStart", "push ProfilerStep#0", "pop", "push ProfilerStep#1",
                          "pop", "synchronize", "cudaProfilerStop"]


def test_cpu_accelerator_warns_once_and_profiles_on(tmp_path, ds_caplog):
    warning_once.cache_clear()
    for run in range(2):
        profiler(output_dir=str(tmp_path / str(run)), nsight_enabled=True, skip_first=0, wait=0, warmup=0,
                 active=1)(lambda: step_profiler())()
        assert profiler_steps(read_trace(tmp_path / str(run) / "trace_rank_0.json")) == [0]
    assert ds_caplog.text.count("Nsight capture ranges need a CUDA accelerator, this one is 'cpu'") == 1
