"""The diff of a pipeline-parallel engine, stage by stage: each stage's compute and bubble in BASE and NEW.

Stages do different work, so a stage is compared only with itself in the other run: its per-step compute and
bubble (the report's ``pipeline.per_step``, the median over the stage's ranks) after warm-up, by the diff's own
test with every run of each side (:func:`.stats.compare_runs`: within the runs for one run a side, between them
for several, as the step time).  Nothing here where a run of either side is not a pipeline.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

from ..report.tables import wrap
from .stats import compare_runs, verdict_words, warmup_steps

__all__ = ["STAGE_FIGURES", "stage_changes", "stage_lines"]

STAGE_FIGURES = ("compute_ms", "bubble_ms")


def _after_warmup(pipeline: Mapping[str, Any], figure: str, stage: str) -> List[float]:
    values = pipeline["per_step"][figure][stage]
    return [value for value in values[warmup_steps(len(values)):] if value is not None]


def stage_changes(base: Sequence[Optional[Mapping[str, Any]]],
                  new: Sequence[Optional[Mapping[str, Any]]]) -> Optional[Dict[str, Dict[str, Any]]]:
    """Per stage of every run of both sides (``"0"``, ``"1"``, ...), :func:`.stats.compare_runs` of its compute and
    bubble; None unless every run is a pipeline (its report's ``pipeline`` section, with ``per_step``)."""
    runs = [*base, *new]
    if any(pipeline is None or "per_step" not in pipeline for pipeline in runs):
        return None
    stages = [stage for stage in base[0]["stages"] if all(stage in pipeline["stages"] for pipeline in runs)]
    return {stage: {figure: compare_runs([_after_warmup(pipeline, figure, stage) for pipeline in base],
                                         [_after_warmup(pipeline, figure, stage) for pipeline in new])
                    for figure in STAGE_FIGURES}
            for stage in stages}


def _figure(name: str, figure: Mapping[str, Any]) -> str:
    if figure["base"] is None or figure["new"] is None:
        return f"{name} not in both runs"
    verdict = verdict_words(figure)
    p_value = "-" if figure["p_value"] is None else f"{figure['p_value']:.3g}"
    return f"{name} {figure['base']:.3f} -> {figure['new']:.3f} ms ({verdict}, p = {p_value})"


def stage_lines(stages: Optional[Mapping[str, Mapping[str, Any]]]) -> List[str]:
    """The diff's text per stage (nothing unless both runs are pipelines)."""
    if not stages:
        return []
    lines = ["", *wrap("Pipeline stages (median per train step after warm-up; each stage against itself):")]
    for stage, figures in stages.items():
        lines += wrap(f"stage {stage}: " + "; ".join(_figure(name.split("_")[0], figures[name])
                                                      for name in STAGE_FIGURES))
    return lines
