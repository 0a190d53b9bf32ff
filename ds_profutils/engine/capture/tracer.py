"""One rank's trace of one capture: torch.profiler over steps S..S+N-1, each step a ``ProfilerStep#N`` range.

What records is the profiler package's :class:`~ds_profutils.torch_profiler.recording.WindowRecording` (the
same torch.profiler options, the same step ranges, ``distributedInfo`` where torch.distributed does not add
it), so a capture's trace reads as a window's does in ``report``, ``timeline``, Perfetto and HTA.  It is
written to a temporary name and renamed into place; with ``gzip`` the exported JSON is compressed into place in
1 MiB blocks, each flushed, so a rank killed while writing leaves a gzip that decompresses up to the cut (the
readers take such a prefix, and say it is cut; the manifest's ``done`` says every chosen rank finished).
"""
from __future__ import annotations

import gzip
from pathlib import Path
from typing import List, Optional

from ...config import ProfilerConfig
from ...logging import logger
from ...outputs import ProcessIdentity, atomic_path, capture_trace_file
from ...torch_profiler.recording import WindowRecording, set_capture_recording
from ...torch_profiler.writer import export_trace

__all__ = ["CaptureTrace"]

_BLOCK = 1 << 20


class CaptureTrace:
    """The torch trace of one capture on this rank, from :meth:`start` to :meth:`write`."""

    def __init__(self, options: ProfilerConfig, folder: Path, identity: ProcessIdentity, gzip_output: bool) -> None:
        self.path = capture_trace_file(folder, identity.rank, gzip_output)
        self.identity = identity
        self._gzip = gzip_output
        self._recording: Optional[WindowRecording] = WindowRecording(options)
        self.steps: List[int] = []  # the steps recorded so far
        self.in_step = False

    def start(self, step: int) -> None:
        """Begin recording with step ``step``'s range open."""
        recording = self._recording
        set_capture_recording(True)
        try:
            recording.prepare()
            recording.start(self.identity)
            self.begin_step(step)
        except BaseException:
            set_capture_recording(False)  # a capture that never began holds no profiler window back
            self._recording = None
            recording.abandon()
            raise

    def begin_step(self, step: int) -> None:
        """Open step ``step``'s range (at its first forward: a job ending between steps leaves no empty one)."""
        self._recording.open_step(step)
        self.steps.append(step)
        self.in_step = True

    def end_step(self) -> None:
        """Close the step range open."""
        self._recording.close_step()
        self.in_step = False

    def write(self) -> bool:
        """Stop recording and write the trace; False (said in one ERROR line) when it could not be written: this rank
        takes no further captures then (the next would most likely fail the same way, a full disk, and each holds
        torch.profiler's recording for its steps)."""
        recording, self._recording = self._recording, None
        if recording is None:
            return False
        set_capture_recording(False)
        try:
            recording.close_step()
            profile = recording.stop()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not self._gzip:
                with atomic_path(self.path, self.identity) as temporary:
                    export_trace(profile, temporary)
                return True
            plain = self.path.with_name(f".{self.path.name}.{self.identity.tag}.json")  # torch's export, compressed
            try:
                export_trace(profile, plain)
                _compress(plain, self.path)  # in place: a rank killed while compressing leaves a readable prefix
            finally:
                plain.unlink(missing_ok=True)
            return True
        except Exception as exc:  # noqa: BLE001 - a capture must never break the training run
            recording.abandon()
            logger.error(f"ds_profutils: the capture trace {self.path} was not written ({type(exc).__name__}: {exc}); "
                         "no further captures here, training goes on")
            return False


def _compress(source: Path, destination: Path) -> None:
    """``source`` gzip-compressed into ``destination`` in flushed blocks (a cut file keeps a readable prefix)."""
    with open(source, "rb") as plain, gzip.open(destination, "wb") as packed:
        while True:
            block = plain.read(_BLOCK)
            if not block:
                break
            packed.write(block)
            packed.flush()  # a sync flush: every byte so far decompresses without the rest

