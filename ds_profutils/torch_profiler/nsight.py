"""Nsight Systems capture ranges around the profiler's active steps.

Run under ``nsys profile --capture-range=cudaProfilerApi --capture-range-end=repeat``, Nsight records
only between ``cudaProfilerStart`` and ``cudaProfilerStop``; bracketing each active window with them
makes the Nsight report hold the same steps as the torch trace, and a ``ProfilerStep#N`` NVTX range
per step (in the ``instrument_w_nvtx`` domain) lines the two up.  Kernels run after the host queued
them, so the device is synchronized before each call: otherwise the warmup step's last kernels would
fall inside the capture and the last active step's outside it.

CUPTI serves one client at a time, so while ``nsys`` is really attached (it sets
``NSYS_PROFILING_SESSION_ID`` in the process it launches) torch records CPU activity only; without it
the torch trace keeps its CUDA activity and the capture calls cost only the two synchronizes.

The capture API exists on CUDA only (``torch.cuda.profiler.start`` fails on a CPU build), so on any
other accelerator the capture is skipped with one warning and the run goes on.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

from deepspeed.accelerator import get_accelerator

from ..logging import logger, warning_once
from ..nvtx import range_pop, range_push
from ..outputs import STEP_RANGE_PREFIX

__all__ = ["NSYS_SESSION_VARIABLE", "NsightCapture", "nsys_command"]

NSYS_SESSION_VARIABLE = "NSYS_PROFILING_SESSION_ID"
"""Set by ``nsys profile`` in the environment of the processes it profiles."""


def nsys_command(output: str) -> str:
    """The ``nsys`` command line that records exactly the capture ranges this module opens."""
    return f"nsys profile --capture-range=cudaProfilerApi --capture-range-end=repeat -o {output}"


class NsightCapture:
    """Opens and closes the CUDA profiler capture range, and the per-step NVTX ranges inside it."""

    def __init__(self, accelerator: Any, start: Callable[[], None], stop: Callable[[], None]) -> None:
        self._accelerator = accelerator
        self._start = start
        self._stop = stop
        self._capturing = False
        self.nsys_attached = NSYS_SESSION_VARIABLE in os.environ  # read once: nsys attaches at process start

    @classmethod
    def for_accelerator(cls, accelerator: Any = None) -> Optional["NsightCapture"]:
        """A capture on CUDA, else None after a warning (once per process) that Nsight capture is skipped."""
        accelerator = accelerator if accelerator is not None else get_accelerator()
        name = accelerator.device_name()
        if name != "cuda":
            warning_once(f"profiler.nsight_enabled: Nsight capture ranges need a CUDA accelerator, this one is "
                         f"{name!r}; continuing without them")
            return None
        import torch.cuda.profiler as cuda_profiler

        return cls(accelerator, cuda_profiler.start, cuda_profiler.stop)

    def start(self) -> None:
        """Open the capture range (at the first active step of a window), once the device is idle."""
        try:
            self._accelerator.synchronize()
            self._start()
        except Exception as exc:  # a failed capture must not stop training
            warning_once(f"profiler.nsight_enabled: cudaProfilerStart failed ({exc}); "
                         f"continuing without Nsight capture")
            return
        self._capturing = True

    def stop(self) -> None:
        """Close the capture range (after the last active step, or when the run ends inside a window), once
        the device has finished the step's work."""
        if not self._capturing:
            return
        self._capturing = False
        try:
            self._accelerator.synchronize()
            self._stop()
        except Exception as exc:
            logger.warning("profiler.nsight_enabled: cudaProfilerStop failed: %s", exc)

    def push_step(self, step: int) -> None:
        """Open the NVTX range of one active step."""
        range_push(self._accelerator, f"{STEP_RANGE_PREFIX}{step}")

    def pop_step(self) -> None:
        """Close the NVTX range opened by ``push_step``."""
        range_pop(self._accelerator)
