"""The report's reading of a pipeline-parallel engine (docs/pipeline.md): its own folder so that report/ stays
within its module budget as it grows (readers and rendering of the common tables stay in report/)."""
from .stages import ideal_bubble_share, pipeline_lines, pipeline_report, staged_view

__all__ = ["ideal_bubble_share", "pipeline_lines", "pipeline_report", "staged_view"]
