"""``ds-profutils report``: a run's per-rank fetch records and traces read back and explained.

:mod:`.records` and :mod:`.traces` read the files, :mod:`.build` computes the numbers, :mod:`.text`
and :mod:`.plot` show them, :mod:`.command` is the subcommand.  Nothing here imports torch or
DeepSpeed; the file names come from :mod:`ds_profutils.outputs`.
"""
from .build import ReportError, build_report
from .plot import plot_report
from .text import render_text

__all__ = ["ReportError", "build_report", "plot_report", "render_text"]
