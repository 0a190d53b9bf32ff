"""``@profiler`` and ``step_profiler()``: torch.profiler (and Nsight capture ranges) around training.

Named ``torch_profiler`` because ``profiler`` is the decorator's public name.  :mod:`.decorator`
resolves the settings, :mod:`.calls` routes ``step_profiler()`` to the process's run (and begins and
ends runs as plain calls, with or without a decorated frame), :mod:`.run` drives one profiled call
through :mod:`.schedule`'s windows and :mod:`.recording` records them, :mod:`.signals` keeps
interruptions from losing a window (its clock is :mod:`.watchdog`, which keeps every hold of a signal
to its deadline), :mod:`.nsight` brackets the active steps for Nsight, :mod:`.writer` writes each cycle's files as it ends (splicing it into the run trace with
:mod:`.export`) and :mod:`.summary` builds the operator table.
"""
from .decorator import Profiler, profiler
from .calls import step_profiler

__all__ = ["Profiler", "profiler", "step_profiler"]
