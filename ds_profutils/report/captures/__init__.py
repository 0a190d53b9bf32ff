"""Trace captures from the outside: the request ``ds-profutils capture`` writes into a job's output_dir and
waits on (:mod:`.command`), and the capture folders ``report`` lists (:mod:`.listing`).  Neither imports torch:
the job's side is :mod:`ds_profutils.engine.capture`, and the two share only the names in :mod:`ds_profutils.outputs`.
"""
from .listing import capture_lines, read_captures

__all__ = ["capture_lines", "read_captures"]
