"""Live step metrics: every ``monitor_interval`` optimizer steps, rank 0 sends ``ds_profutils/<name>``
events from all ranks' step figures to where the job already reports (DeepSpeed's monitor, the
frameworks' loggers) and one console line.

:mod:`.interval` packs a rank's interval and makes rank 0's events (the rules, torch-free),
:mod:`.gather` brings the ranks' figures to rank 0 by one small gather per interval, :mod:`.sinks`
holds DeepSpeed's monitor and the console line, and :mod:`.metrics` the LiveMetrics the recorder feeds.
A subpackage so that the engine hub stays within its module budget.
"""
from .interval import EVENT_NAMES, PIPELINE_EVENT_NAMES, Event, StepFigures
from .metrics import LiveMetrics, LiveSettings
from .sinks import ConsoleSink, DeepSpeedMonitorSink, LiveSink, console_line, monitor_sink

__all__ = ["EVENT_NAMES", "ConsoleSink", "DeepSpeedMonitorSink", "Event", "LiveMetrics", "LiveSettings", "LiveSink",
           "PIPELINE_EVENT_NAMES", "StepFigures", "console_line", "monitor_sink"]
