"""``@profiler`` and ``step_profiler()``: torch.profiler (and Nsight capture ranges) around training.

Named ``torch_profiler`` because ``profiler`` is the decorator's public name.  :mod:`.decorator`
resolves the settings, :mod:`.run` drives one profiled call through :mod:`.schedule`'s windows,
:mod:`.signals` keeps interruptions from losing a window, :mod:`.nsight` brackets the active steps
for Nsight, :mod:`.export` writes the run trace and :mod:`.summary` the operator table.
"""
from .decorator import Profiler, profiler
from .run import step_profiler

__all__ = ["Profiler", "profiler", "step_profiler"]
