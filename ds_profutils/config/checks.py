"""What in a ds_config silently switches a feature off, or fails it only once the job runs.

DeepSpeed accepts unknown top-level keys, so a misspelt section (``"profiller"``) is read by nobody
and its feature is off without a word.  ``check-config`` reports such keys as errors; a running job
logs the same finding as one WARNING line on rank 0 (:func:`warn_misspelt_sections`, called by
:func:`~.loading.load_config`).  ``check-config`` also catches, before a long job starts, what the
features would refuse at run time: the fetch profiler without ZeRO stage 3, and an ``output_dir``
that cannot be created or written; and it warns of a DeepSpeed monitor the file enables whose package is
not installed here (:func:`missing_monitor_packages`), which would stop the job inside
``deepspeed.initialize``, and of both record sections on below stage 3 (:func:`zero_stage_warnings`), where a job
records its steps but no fetches.
"""
from __future__ import annotations

import difflib
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any, List, Mapping, Optional, Set, Tuple

from pydantic import TypeAdapter, ValidationError

from ..outputs import probe_writable, process_identity
from .errors import ConfigProblem, show_value
from .models import SECTIONS, ProfUtilsConfig

__all__ = ["MONITOR_PACKAGES", "missing_monitor_packages", "misspelt_sections", "output_dir_problems",
           "section_enabled", "warn_misspelt_sections", "zero_stage_problems", "zero_stage_warnings"]

# difflib's similarity ratio from which a top-level key counts as a misspelling of one of our sections.
# 0.75 takes "profiller", "proflier", "nvxt", "partition_param_profiler"; DeepSpeed's own top-level keys
# stay below it ("flops_profiler": 0.73 to "profiler").
_CLOSE = 0.75
_warned: Set[Tuple[str, str]] = set()


def _meant(key: str) -> Optional[str]:
    """The section ``key`` looks like a misspelling of, or None."""
    if key in SECTIONS:
        return None
    close = difflib.get_close_matches(key.lower().replace("-", "_"), list(SECTIONS), n=1, cutoff=_CLOSE)
    return close[0] if close else None


def _misspelt(raw: Any) -> List[Tuple[str, str]]:
    if not isinstance(raw, Mapping):
        return []
    return [(str(key), meant) for key in raw if (meant := _meant(str(key))) is not None]


def _why(raw: Mapping[str, Any], meant: str) -> str:
    off = "" if meant in raw else f" and {meant} stays off"
    return f"DeepSpeed ignores unknown keys, so its settings are never read{off}"


def misspelt_sections(raw: Any) -> List[ConfigProblem]:
    """Top-level keys close to one of our section names (and that section absent), as errors."""
    return [ConfigProblem(key, f"unknown top-level key (did you mean {meant}?); {_why(raw, meant)}")
            for key, meant in _misspelt(raw)]


def warn_misspelt_sections(raw: Any, origin: Optional[str]) -> None:
    """One WARNING line per misspelt section, on rank 0 only and once per process, on DeepSpeed's logger."""
    found = [(key, meant) for key, meant in _misspelt(raw) if (key, meant) not in _warned]
    if not found or process_identity().rank != 0:
        return
    logger = logging.getLogger("DeepSpeed")
    for key, meant in found:
        _warned.add((key, meant))
        where = f" in {origin}" if origin else ""
        logger.warning("ds_profutils: top-level key %s%s is not one of our sections (did you mean %s?); %s",
                       show_value(key), where, meant, _why(raw, meant))


def _zero_stage(raw: Mapping[str, Any]) -> Tuple[Optional[int], str]:
    """``zero_optimization.stage`` as DeepSpeed's pydantic config reads it ("3", 3.0 and 3 are stage 3; None where
    DeepSpeed refuses the value), and how to name it."""
    zero = raw.get("zero_optimization")
    if isinstance(zero, bool):  # DeepSpeed's deprecated form: true is stage 1
        return int(zero), f"{int(zero)} (zero_optimization: {show_value(zero)}, DeepSpeed's deprecated form)"
    stage = zero.get("stage") if isinstance(zero, Mapping) else None
    if stage is None:
        return 0, "not set (DeepSpeed's default: 0)"
    try:
        return TypeAdapter(int).validate_python(stage), show_value(stage)
    except ValidationError:
        return None, show_value(stage)


def _fetches_below_stage_3(raw: Mapping[str, Any], config: ProfUtilsConfig) -> Optional[str]:
    """How ``zero_optimization.stage`` is named where the fetch profiler is on below stage 3, else None."""
    if not config.partitioned_param_profiler.enabled:
        return None
    stage, stage_text = _zero_stage(raw)
    return None if stage == 3 else stage_text


def zero_stage_problems(raw: Mapping[str, Any], config: ProfUtilsConfig) -> List[ConfigProblem]:
    """The fetch profiler alone where ZeRO does not partition parameters (stage below 3): nothing to record."""
    stage_text = _fetches_below_stage_3(raw, config)
    if stage_text is None or config.step_metrics.enabled:
        return []
    return [ConfigProblem("partitioned_param_profiler.enabled",
                          f"true needs zero_optimization.stage 3, but zero_optimization.stage is {stage_text}: "
                          "below stage 3 ZeRO does not partition parameters, so there are no fetches to record")]


def zero_stage_warnings(raw: Mapping[str, Any], config: ProfUtilsConfig) -> List[str]:
    """Both record sections on below stage 3: attach keeps step_metrics' records and switches the fetch records
    off, in one warning; a warning here too."""
    stage_text = _fetches_below_stage_3(raw, config)
    if stage_text is None or not config.step_metrics.enabled:
        return []
    return [f"partitioned_param_profiler is on, but zero_optimization.stage is {stage_text}: below stage 3 ZeRO "
            "does not partition parameters, so the job records no fetches (attach says so once); the step records "
            "of step_metrics go on"]


def _output_dir_problem(key: str, directory: str) -> Optional[ConfigProblem]:
    """Why ``directory`` could not be created or written, or None.  Creates nothing: a probe file is
    written (and removed) in the directory, or in its nearest existing parent when it does not exist yet."""
    path = Path(directory)
    relative = "" if path.is_absolute() else f" (relative to {os.getcwd()}, as here; a job resolves it from its own)"
    existing = path.absolute()
    try:
        while not existing.exists():
            existing = existing.parent
    except OSError as exc:
        return ConfigProblem(key, f"{show_value(directory)} cannot be reached{relative}: {exc.strerror}")
    if not existing.is_dir():
        return ConfigProblem(key, f"{show_value(directory)} cannot be created{relative}: {existing} is not a "
                             "directory")
    try:
        probe_writable(existing)  # exists already: nothing is created
    except OSError as exc:
        if existing == path.absolute():
            return ConfigProblem(key, f"{show_value(directory)} cannot be written{relative}: {existing}: "
                                 f"{exc.strerror}")
        # the OS's reason is for the probe made in the parent (ENOENT in /proc), not for the parent itself
        return ConfigProblem(key, f"{show_value(directory)} cannot be created{relative}: nothing can be created in "
                             f"{existing} ({exc.strerror})")
    return None


def section_enabled(sections: Mapping[str, Any], section: str) -> bool:
    """Whether ``section`` is on in ``sections`` (absent "enabled": the section's default, on for the profiler); a
    bad value, which loading names, counts as off."""
    settings = sections.get(section)
    return isinstance(settings, Mapping) and settings.get("enabled", SECTIONS[section]().enabled) is True


def output_dir_problems(sections: Mapping[str, Any]) -> List[ConfigProblem]:
    """Each enabled section's ``output_dir`` that cannot be created or written (a disabled one writes nothing); a
    null one (trace_capture's) is step_metrics' output_dir, named under step_metrics' key where that is on.  With
    step_metrics on, the records go to its output_dir: the fetch section's is not used, so not checked.

    ``sections``: the resolved settings, or (when other values are bad) the file's own, so that these problems are
    listed beside the others; there an output_dir left out or of a bad type (which loading names) is not checked."""
    problems = []
    metrics_on = section_enabled(sections, "step_metrics")
    for name in SECTIONS:
        if "output_dir" not in SECTIONS[name].model_fields or not section_enabled(sections, name):
            continue
        if name == "partitioned_param_profiler" and metrics_on:
            continue
        key, directory = f"{name}.output_dir", sections[name].get("output_dir", "")
        if directory is None:
            metrics = sections.get("step_metrics")
            if metrics_on or not isinstance(metrics, Mapping):
                continue
            key, directory = f"{name}.output_dir (null: step_metrics.output_dir)", metrics.get("output_dir", "")
        problem = _output_dir_problem(key, directory) if isinstance(directory, str) and directory else None
        if problem is not None:
            problems.append(problem)
    return problems


MONITOR_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}
"""DeepSpeed's monitors (top-level ds_config sections) and the module each imports when enabled; ``csv_monitor``
needs none.  DeepSpeed imports it inside ``deepspeed.initialize``, so a missing one ends the job there."""


def missing_monitor_packages(raw: Mapping[str, Any]) -> List[str]:
    """A warning per DeepSpeed monitor the file enables whose package is not installed in this environment (the
    job's may differ: a warning, not an error)."""
    warnings = []
    for section, module in MONITOR_PACKAGES.items():
        settings = raw.get(section)
        if isinstance(settings, Mapping) and settings.get("enabled") is True and importlib.util.find_spec(module) is None:
            warnings.append(f"{section}.enabled is true, but the {module} package is not installed here: DeepSpeed "
                            f"imports it in deepspeed.initialize, where a job without it stops (pip install {module})")
    return warnings
