"""The hang watchdog and its files (not the torch profiler's stop watchdog): :mod:`.sequence` keeps per group
the collectives' sequence numbers and the one each rank is inside, :mod:`.watchdog` the thread that writes
``hang_rank_{r}.json`` (:mod:`.hang_file`) when no optimizer step ends for ``step_metrics.hang_timeout_s``."""
from .watchdog import EngineWatch, watch_engine

__all__ = ["EngineWatch", "watch_engine"]
