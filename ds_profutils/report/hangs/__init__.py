"""The report's HANG section: :mod:`.reading` reads the ranks' ``hang_rank_{r}.json`` files and lines them up
(the culprits), :mod:`.text` shows it first in the text report (docs/hangs.md)."""
from .reading import FRAMES_SHOWN, add_hangs, hang_reports, read_hang_files
from .text import hang_lines

__all__ = ["FRAMES_SHOWN", "add_hangs", "hang_lines", "hang_reports", "read_hang_files"]
