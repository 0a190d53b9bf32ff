"""The GPU suite: what only a CUDA device can show (device clocks against CUDA's own events, a stall on a
side stream, the Nsight capture range against queued device work, NVTX domains on DeepSpeed's CUDA
accelerator, the allocator's history, NCCL).

Run it on a machine with CUDA, from the repository root, in the test venv built with a CUDA torch:
``python -m pytest tests/gpu`` (one GPU runs all but the 2-process NCCL run, which needs two).  Every
test here is marked ``gpu`` and, where no CUDA device exists, skipped with that reason: the suite is
collected everywhere and never passes silently.
"""
from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (tests/gpu)")


def pytest_collection_modifyitems(config, items):
    reason = None if torch.cuda.is_available() else (
        f"no CUDA device (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}): the GPU suite "
        "runs on a machine with one")
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def gpu_sleep():
    """``gpu_sleep(ms)``: that much device time on the current stream (torch.cuda._sleep, calibrated once)."""
    cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles)  # warm up
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    cycles_per_ms = cycles / start.elapsed_time(end)

    def sleep(ms: float) -> None:
        torch.cuda._sleep(int(ms * cycles_per_ms))

    return sleep


@pytest.fixture
def cuda_accelerator():
    """DeepSpeed's CUDA accelerator, installed for the test."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    assert accelerator.device_name() == "cuda", accelerator.device_name()
    assert not accelerator.use_host_timers()
    return accelerator
