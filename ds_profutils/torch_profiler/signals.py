"""Turn SIGTERM/SIGINT into an exception while a profiler has unsaved data.

The launcher stops a job with SIGTERM (SIGKILL 30 s later) and a user with Ctrl-C.  Python's default
SIGTERM action kills the process on the spot, skipping every ``finally``, so the trace being recorded
is lost.  While installed, the handler here raises ``SystemExit(128 + signal)`` instead, and the
profiler's ``finally`` writes the files on the way out.  Nothing is written inside the handler: it
may interrupt any line, including the profiler's own.

A handler the program installed itself (a Python callable, like Python's default SIGINT handler
that raises KeyboardInterrupt) is called instead, so its behaviour is kept; an ignored signal
(``SIG_IGN``, as for SIGINT in a background job) stays ignored.
"""
from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Dict, Optional

from ..logging import logger

__all__ = ["ExitOnSignal"]

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class ExitOnSignal:
    """Installs the handlers with ``install()`` and puts the previous ones back with ``restore()``."""

    def __init__(self) -> None:
        self._previous: Dict[int, Any] = {}

    def install(self) -> None:
        """Install on SIGTERM and SIGINT; a no-op outside the main thread, where Python forbids it."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for signum in _SIGNALS:
            if signal.getsignal(signum) == signal.SIG_IGN:
                continue
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except (ValueError, OSError) as exc:  # e.g. an embedded interpreter without signals
                logger.debug("profiler: cannot handle signal %s: %s", signum, exc)

    def restore(self) -> None:
        """Put back the handlers that were there before ``install()``."""
        while self._previous:
            signum, previous = self._previous.popitem()
            # None: the previous handler was installed outside Python and cannot be put back.
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)
            return
        raise SystemExit(128 + signum)
