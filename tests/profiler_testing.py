"""Helpers shared by the profiler tests: a tiny training step and trace readers."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import torch

PROFILED_JOB_ACTIVE, PROFILED_JOB_REPEAT = 2, 2
"""The schedule of the shared 2-rank launcher job (conftest.profiled_job)."""

MODEL = torch.nn.Linear(16, 16)
BATCH = torch.randn(4, 16)


def train_step() -> None:
    """A real forward and backward: matmuls give FLOPs, the backward gives flow events."""
    MODEL(BATCH).sum().backward()


def read_trace(path: Path) -> Dict[str, Any]:
    with open(path) as handle:
        return json.load(handle)


def cycle_steps(output_dir: Path, rank: int = 0) -> List[List[int]]:
    """The first and last step of each cycle, as the per-cycle files' ``ds_profutils`` metadata says, in order."""
    files = sorted((Path(output_dir) / f"rank_{rank}").glob("*.pt.trace.json"))
    return [entry["steps"] for path in files for entry in read_trace(path)["ds_profutils"]["cycles"]]


def profiler_steps(trace: Dict[str, Any]) -> List[int]:
    """The N of every host ``ProfilerStep#N`` range in a Chrome trace, sorted (with CUDA activity, kineto also
    draws each step on the device timeline as a ``gpu_user_annotation``: not counted)."""
    prefix = "ProfilerStep#"
    return sorted(int(e["name"][len(prefix):]) for e in trace["traceEvents"]
                  if e.get("name", "").startswith(prefix) and e.get("cat") != "gpu_user_annotation")


