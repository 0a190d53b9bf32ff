"""``@profiler(...)``: torch.profiler (and Nsight capture ranges) around a training function.

Usage::

    @profiler(config="ds_config.json")          # the "profiler" section of the job's config
    def train(...):
        for batch in loader:
            ...
            step_profiler()                      # once per training step

    with profiler(active=5, with_flops=True):    # the same, as a block
        ...

Settings follow the package-wide order: ``DS_PROFUTILS_PROFILER_*`` environment > keyword arguments >
the config's ``"profiler"`` section > off.  A config without a ``"profiler"`` section switches it off
(the job's config is the switch: the same script profiles only the jobs whose config asks), and says
so in one line when keyword settings were given, which then apply only with ``enabled=True``; with no
config at all the section's defaults apply, since decorating is itself the request.  Given a DeepSpeed
engine as ``config``, the profiler names steps by its global step from the call's first step.

A profiler that is off returns the decorated function itself, so it costs nothing.  Whether this rank
is one of ``ranks`` is decided at the first call (under mpirun or SLURM the rank may only be known
then); a rank left out runs the function as it is, and never enters a collective on the profiler's
account.
"""
from __future__ import annotations

import functools
from types import TracebackType
from typing import Any, Callable, List, Optional, Type, TypeVar

from ..config import ConfigSource, ProfilerConfig, load_config, resolve_section
from ..logging import logger
from ..nvtx import configure_nvtx
from ..outputs import process_identity
from .calls import RunBlock, step_profiler
from .signals import ends_a_run

__all__ = ["Profiler", "profiler", "step_profiler"]

F = TypeVar("F", bound=Callable[..., Any])


class Profiler:
    """Resolved profiler settings, used as a decorator or as a ``with`` block.

    Each decorated call (or block) is one profiled run; a run started while another is active in the
    process (nested, or in another thread) runs unprofiled with one warning.  ``engine``, if known, names
    the steps from the first one (see :class:`~.run.ProfilerRun`).
    """

    def __init__(self, settings: ProfilerConfig, enabled: bool, engine: Any = None) -> None:
        self.settings = settings
        self.enabled = enabled
        self.engine = engine
        self._profiles_this_rank: Optional[bool] = None
        self._blocks: List[Optional[RunBlock]] = []

    def profiles_this_rank(self) -> bool:
        """Whether this rank records, decided at the first call from the rank known then.

        Raises ConfigError (on every rank alike, before the call runs) for a rank outside the world size.
        """
        if self._profiles_this_rank is None:
            identity = process_identity()
            self.settings.check_world(identity.world_size)
            self._profiles_this_rank = self.settings.profiles_rank(identity.rank)
        return self._profiles_this_rank

    def __call__(self, func: F) -> F:
        if not self.enabled:
            return func

        @functools.wraps(func)
        def profiled(*args: Any, **kwargs: Any) -> Any:
            if not self.profiles_this_rank():
                return func(*args, **kwargs)
            with RunBlock(self.settings, self.engine):
                return func(*args, **kwargs)

        return profiled  # type: ignore[return-value]

    def __enter__(self) -> "Profiler":
        block = RunBlock(self.settings, self.engine) if self.enabled and self.profiles_this_rank() else None
        if block is not None:
            block.__enter__()
        self._blocks.append(block)
        return self

    @ends_a_run
    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 traceback: Optional[TracebackType]) -> None:
        block = self._blocks.pop()
        if block is not None:
            block.__exit__(exc_type, exc, traceback)


def profiler(config: ConfigSource = None,
             *,
             enabled: Optional[bool] = None,
             output_dir: Optional[str] = None,
             skip_first: Optional[int] = None,
             wait: Optional[int] = None,
             warmup: Optional[int] = None,
             active: Optional[int] = None,
             repeat: Optional[int] = None,
             with_stack: Optional[bool] = None,
             with_flops: Optional[bool] = None,
             with_modules: Optional[bool] = None,
             record_shapes: Optional[bool] = None,
             profile_memory: Optional[bool] = None,
             nsight_enabled: Optional[bool] = None,
             nsight_output: Optional[str] = None,
             ranks: Optional[Any] = None,
             summary_ranks: Optional[Any] = None,
             summary_sort_by: Optional[str] = None,
             summary_row_limit: Optional[int] = None,
             peak_tflops: Optional[float] = None) -> Profiler:
    """A profiler configured from ``config`` (a ds_config path or dict, an engine, launcher ``args``)
    and the keyword arguments, which override the config's ``"profiler"`` section.

    The keywords are the section's keys (see docs/profiler.md); None leaves a setting to the config.
    Over a config without a ``"profiler"`` section they apply only with ``enabled=True`` (one line says
    so otherwise).  The config's ``"nvtx"`` section, if any, is applied too.
    ``ranks="all"`` profiles every rank.  Raises ConfigError for a bad value here, and for a rank
    outside the world size at the first call, before the function runs.
    """
    options = dict(enabled=enabled, output_dir=output_dir, skip_first=skip_first, wait=wait, warmup=warmup,
                   active=active, repeat=repeat, with_stack=with_stack, with_flops=with_flops,
                   with_modules=with_modules, record_shapes=record_shapes, profile_memory=profile_memory,
                   nsight_enabled=nsight_enabled, nsight_output=nsight_output, ranks=ranks,
                   summary_ranks=summary_ranks, summary_sort_by=summary_sort_by,
                   summary_row_limit=summary_row_limit, peak_tflops=peak_tflops)
    loaded = load_config(config)  # None: no file, only DS_PROFUTILS_* variables
    if loaded.nvtx is not None:  # the job's "nvtx" section holds also when only the profiler reads the config
        configure_nvtx(loaded.nvtx.enabled, loaded.nvtx.domain)
    section = ProfilerConfig() if config is None else loaded.profiler
    settings = resolve_section(section, options)
    given = [f"{key}={value!r}" for key, value in options.items() if value is not None and key != "enabled"]
    if given and not settings.enabled and config is not None and "profiler" not in loaded.model_fields_set \
            and process_identity().rank == 0:
        logger.warning("profiler: off: the config has no \"profiler\" section, which is what switches it on; the "
                       "keyword settings (%s) apply once it has one, or with enabled=True", ", ".join(given))
    return Profiler(settings, enabled=settings.enabled, engine=config if _is_engine(config) else None)


def _is_engine(config: ConfigSource) -> bool:
    """A DeepSpeed engine (or anything counting steps as one does), as opposed to a path, dict or args."""
    return hasattr(config, "global_steps") and hasattr(config, "gradient_accumulation_steps")
