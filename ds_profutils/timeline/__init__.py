"""``ds-profutils timeline DIR -o FILE.json``: the ranks' traces merged into one Chrome/Perfetto trace.

:mod:`.merge` places each trace on one clock and streams the events out; :mod:`.command` is the
subcommand.  The traces are read by the report's reader (:mod:`ds_profutils.report.traces`).
"""
from .merge import align, scan_trace, write_timeline

__all__ = ["align", "scan_trace", "write_timeline"]
