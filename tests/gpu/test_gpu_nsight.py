"""Nsight capture on a real GPU: the capture range holds exactly the active steps' device work.

Without ``nsys`` the check is the device's own state at each capture call: every kernel queued before
``cudaProfilerStart`` (the warmup step's) has finished when it is called, and every kernel of the last
active step has finished when ``cudaProfilerStop`` is called.  Each step queues a kernel of
``KERNEL_MS`` and goes straight on to ``step_profiler()``, so without the profiler's synchronize that
kernel would still be running at the call, and this test fails.
"""
import torch
import torch.cuda.profiler as cuda_profiler

from ds_profutils import profiler, step_profiler
from profiler_testing import profiler_steps, read_trace

KERNEL_MS = 200


def test_the_capture_range_holds_exactly_the_active_steps_device_work(cuda_accelerator, gpu_sleep, tmp_path,
                                                                      monkeypatch):
    monkeypatch.delenv("NSYS_PROFILING_SESSION_ID", raising=False)
    calls = []

    def recorded(name, call):

        def capture_call():
            calls.append((name, torch.cuda.current_stream().query()))  # True: no queued work left
            call()

        return capture_call

    monkeypatch.setattr(cuda_profiler, "start", recorded("cudaProfilerStart", cuda_profiler.start))
    monkeypatch.setattr(cuda_profiler, "stop", recorded("cudaProfilerStop", cuda_profiler.stop))

    @profiler(output_dir=str(tmp_path), nsight_enabled=True, skip_first=0, wait=1, warmup=1, active=2, repeat=1)
    def train():
        for _ in range(6):
            gpu_sleep(KERNEL_MS)  # the step's device work, queued without waiting for it
            step_profiler()

    train()
    assert calls == [("cudaProfilerStart", True), ("cudaProfilerStop", True)]
    trace = read_trace(tmp_path / "trace_rank_0.json")
    assert profiler_steps(trace) == [2, 3]
    # No nsys attached: the torch trace keeps the device's activity.
    assert any(event.get("cat") == "kernel" for event in trace["traceEvents"])
