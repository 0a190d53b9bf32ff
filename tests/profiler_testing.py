"""Helpers shared by the profiler tests: a tiny training step, trace readers, log capture."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

import ds_profutils

MODEL = torch.nn.Linear(16, 16)
BATCH = torch.randn(4, 16)


def train_step() -> None:
    """A real forward and backward: matmuls give FLOPs, the backward gives flow events."""
    MODEL(BATCH).sum().backward()


def read_trace(path: Path) -> Dict[str, Any]:
    with open(path) as handle:
        return json.load(handle)


def profiler_steps(trace: Dict[str, Any]) -> List[int]:
    """The N of every ``ProfilerStep#N`` range in a Chrome trace, sorted."""
    prefix = "ProfilerStep#"
    return sorted(int(e["name"][len(prefix):]) for e in trace["traceEvents"] if e.get("name", "").startswith(prefix))


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Tests decide rank and overrides themselves; nothing leaks in from the shell or tox."""
    import os

    for name in list(os.environ):
        if name.startswith("DS_PROFUTILS_") or name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(name)


@pytest.fixture
def ds_caplog(caplog):
    """Capture the DeepSpeed logger's records (it does not propagate to root, so attach directly)."""
    ds_profutils.logger.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG, logger="DeepSpeed")
    yield caplog
    ds_profutils.logger.removeHandler(caplog.handler)
