"""What records one run's windows: torch.profiler, the Nsight capture ranges and the ``ProfilerStep#N``
ranges of the active steps.

:mod:`.run` decides *when* (the schedule's windows, interruptions, the run's end); this module is *what*
happens then, in the order torch and Nsight need: torch.profiler is created and prepared at a window's
first warmup step, started at its first active step (with the Nsight capture range), each active step
is one range in both, and at the window's end the Nsight range closes before torch stops (its stop
synchronizes the device, which the capture range should not include).
"""
from __future__ import annotations

import contextlib
import json
from typing import List, Optional

import torch
from torch.autograd.profiler import record_function

from ..config import ProfilerConfig
from ..nvtx import set_torch_profiler_recording
from ..outputs import STEP_RANGE_PREFIX, ProcessIdentity
from .nsight import NsightCapture, nsys_command

__all__ = ["WindowRecording", "capture_recording", "set_capture_recording"]

_capture_recording = False  # a trace capture (ds_profutils.engine.capture) records in this process now


def set_capture_recording(on: bool) -> None:
    """A trace capture began (or ended) recording with torch.profiler in this process: one profiler at a time,
    so a profiler window whose start falls inside it is skipped (:class:`.run.ProfilerRun`)."""
    global _capture_recording
    _capture_recording = on


def capture_recording() -> bool:
    """Whether a trace capture records in this process now."""
    return _capture_recording


def _stop_trace(profile: torch.profiler.profile, started: bool) -> None:
    """``profile.stop_trace()``; where it fails before switching recording off and ``started`` (ours records: no other
    profiler can start while it does), recording is switched off here, or every later operator would be recorded."""
    try:
        profile.stop_trace()
    finally:
        if started and torch.autograd._profiler_enabled():
            with contextlib.suppress(Exception):
                torch.autograd._disable_profiler()
            torch.autograd.profiler._set_is_profiler_enabled(False)


class WindowRecording:
    """torch.profiler and Nsight for one run's windows, one window at a time."""

    def __init__(self, settings: ProfilerConfig) -> None:
        self.settings = settings
        self._torch: Optional[torch.profiler.profile] = None
        self._started = False  # torch.profiler records (its start_trace returned)
        self._step_range: Optional[record_function] = None
        self._nsight: Optional[NsightCapture] = None

    def begin(self, rank: int) -> None:
        """Find the Nsight capture (when the settings ask for it) and say on rank 0 how it captures."""
        if self.settings.nsight_enabled:
            self._nsight = NsightCapture.for_accelerator()
            if self._nsight is not None and rank == 0:
                print(self._nsight_note(), flush=True)

    def prepare(self) -> None:
        """A window's first warmup step: torch.profiler made and prepared, not recording."""
        settings = self.settings
        self._torch = torch.profiler.profile(activities=self._activities(),
                                             record_shapes=settings.record_shapes,
                                             profile_memory=settings.profile_memory,
                                             with_stack=settings.with_stack,
                                             with_flops=settings.with_flops,
                                             with_modules=settings.with_modules)
        self._torch.prepare_trace()

    def start(self, identity: ProcessIdentity) -> None:
        """The window's first active step: recording begins (torch, the NVTX flag, the Nsight range)."""
        self._torch.start_trace()
        self._started = True
        if identity.source != "torch.distributed":  # torch records distributedInfo only from torch.distributed
            self._torch.add_metadata_json("distributedInfo",
                                          json.dumps({"rank": identity.rank, "world_size": identity.world_size}))
        set_torch_profiler_recording(True)
        if self._nsight is not None:
            self._nsight.start()

    def open_step(self, number: int) -> str:
        """Open the range of active step ``number``; returns its name."""
        name = f"{STEP_RANGE_PREFIX}{number}"
        self._step_range = record_function(name)
        self._step_range.__enter__()
        if self._nsight is not None:
            self._nsight.push_step(number)
        return name

    def close_step(self) -> None:
        """Close the open step range, if any."""
        step_range, self._step_range = self._step_range, None
        if step_range is None:
            return
        if self._nsight is not None:
            self._nsight.pop_step()
        step_range.__exit__(None, None, None)

    def add_metadata(self, key: str, value: str) -> None:
        """Add ``key`` to the trace being recorded (torch's ``add_metadata_json``)."""
        self._torch.add_metadata_json(key, value)

    def stop_capture(self) -> None:
        """Close the Nsight capture range (before torch stops: its stop synchronizes the device)."""
        if self._nsight is not None:
            self._nsight.stop()

    def stop(self) -> Optional[torch.profiler.profile]:
        """Stop torch.profiler (it synchronizes the device) and hand over what it recorded.  Where its stop fails
        before switching recording off, recording is switched off here: else every operator of the rest of the job
        would be recorded (slower steps, growing memory), and no profiler could start again."""
        set_torch_profiler_recording(False)
        profile, self._torch = self._torch, None
        started, self._started = self._started, False
        if profile is not None:
            _stop_trace(profile, started)
        return profile

    def discard_warmup(self) -> None:
        """The run ended during a warmup: torch's own way out of a prepared, never-started profiler."""
        profile, self._torch = self._torch, None
        profile.start_trace()
        _stop_trace(profile, started=True)

    def abandon(self) -> None:
        """After a failure: stop whatever still runs, each on its own (one failing does not keep the rest)."""
        for stop in (self.close_step, self.stop_capture, self.stop):
            with contextlib.suppress(Exception):
                stop()

    def _activities(self) -> List[torch.profiler.ProfilerActivity]:
        if self._nsight is not None and self._nsight.nsys_attached:  # CUPTI serves one client: nsys here
            return [torch.profiler.ProfilerActivity.CPU]
        return sorted(torch.profiler.supported_activities(), key=lambda activity: activity.value)

    def _nsight_note(self) -> str:
        command = nsys_command(self.settings.nsight_output)
        if self._nsight.nsys_attached:
            return ("ds_profutils profiler: Nsight capture ranges bracket each active window (the device is synchronized "
                    "at each end); nsys is attached, so the torch trace holds CPU activity only (CUPTI serves one "
                    "client)")
        return ("ds_profutils profiler: Nsight capture ranges bracket each active window (the device is synchronized at "
                f"each end); nsys is not attached, so the torch trace keeps CUDA activity; to capture, run: {command} "
                "<your launch command>")
