"""``ds-profutils report``: a run's per-rank fetch records and traces read back and explained.

:mod:`.records` and :mod:`.traces` read the files, :mod:`.steps` joins them per step and finds the
straggler (tested against chance by :mod:`.chance`), :mod:`.memory` finds the memory peaks and jumps,
:mod:`.build` computes the tables, :mod:`.text` (from the blocks of :mod:`.tables`), :mod:`.plot` show
them, :mod:`.command` is the subcommand (and its JSON).  :mod:`.run_files` says which files of a run are read and
which are missing, torn or left out.  The readers are shared: :mod:`ds_profutils.diff` compares two
runs through them and :mod:`ds_profutils.timeline` merges the ranks' traces (both import this package,
never the reverse).
Nothing here imports torch, DeepSpeed or pydantic; the file names come from :mod:`ds_profutils.outputs`.
"""
from .build import ReportError, build_report
from .command import report_json
from .text import render_text

__all__ = ["ReportError", "build_report", "report_json", "render_text"]
