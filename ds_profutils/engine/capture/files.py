"""Rank 0's capture files: taking ``capture_request.json`` (one rename per interval, no collective), and
writing a capture's ``manifest.json`` or a request's refusal, each to a temporary name renamed into place.

The request's format is what ``ds-profutils capture`` writes (:mod:`ds_profutils.report.captures.request`):
``{"id", "steps", "ranks", "requested_at"}``; ``ranks`` is "suspects", "all" or a list of global ranks.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Dict, Optional

from ...config.models import MAX_LISTED_RANK
from ...logging import logger
from ...outputs import CAPTURE_MANIFEST, CAPTURE_REFUSED, CAPTURE_REQUEST, atomic_path
from .decide import Plan, Request

__all__ = ["take_request", "write_manifest", "write_refusal"]



def take_request(output_dir: Path, number: int) -> Optional[Request]:
    """The request waiting in ``output_dir``, renamed so that it is taken once (None when there is none: one
    failed rename).  A request that cannot be read is refused in :data:`CAPTURE_REFUSED`, training goes on."""
    path = output_dir / CAPTURE_REQUEST
    taken = output_dir / f"capture_request.taken.{number}.json"
    try:
        os.rename(path, taken)
    except OSError:
        return None  # none waiting (or another engine in this directory took it first)
    try:
        raw = json.loads(taken.read_text(encoding="utf-8"))
        steps, ranks = raw.get("steps", 2), raw.get("ranks", "suspects")
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 1000:
            raise ValueError(f"steps: expected an integer 1..1000, got {steps!r}")
        if ranks == "all":
            ranks = None
        elif ranks != "suspects" and not (isinstance(ranks, list) and ranks and
                                          all(type(r) is int and 0 <= r <= MAX_LISTED_RANK for r in ranks)):
            raise ValueError(f"ranks: expected \"suspects\", \"all\" or global ranks 0..{MAX_LISTED_RANK}, "
                             f"got {ranks!r}")
        return Request(number, steps, ranks, str(raw.get("id", "")), raw.get("requested_at"))
    except (OSError, ValueError, AttributeError) as exc:
        write_refusal(output_dir, "", f"{taken.name} cannot be read as a capture request: {exc}")
        return None


def _write_json(path: Path, content: Dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as temporary:
        temporary.write_text(json.dumps(content, indent=1) + "\n", encoding="utf-8")


def write_refusal(output_dir: Path, request_id: str, reason: str) -> None:
    """Say, for ``ds-profutils capture --wait`` and in the log, why a request was not met."""
    logger.warning(f"ds_profutils: capture request refused: {reason}")
    try:
        _write_json(output_dir / CAPTURE_REFUSED, {"id": request_id, "reason": reason, "written_at": time.time()})
    except OSError as exc:
        logger.error(f"ds_profutils: {output_dir / CAPTURE_REFUSED} cannot be written: {exc}")


def write_manifest(folder: Path, plan: Plan, engine: str, request: Optional[Request], done: bool,
                   hosts: Dict[str, Optional[str]]) -> None:
    """The capture's ``manifest.json`` (docs/capture.md); rewritten with ``done`` once every chosen rank wrote.
    ``hosts``: each chosen rank's host by rank, as ``why_these_ranks`` (where each trace is to be fetched)."""
    content = {"reason": plan.reason, "engine": engine, "first_step": plan.first_step, "steps": plan.steps,
               "ranks": plan.ranks, "hosts": hosts, "why_these_ranks": plan.why, "figures": plan.figures,
               "request_id": request.request_id if request else None,
               "requested_at": request.requested_at if request else None,
               "written_at": time.time(), "done": done}
    try:
        _write_json(folder / CAPTURE_MANIFEST, content)
    except OSError as exc:
        logger.error(f"ds_profutils: {folder / CAPTURE_MANIFEST} cannot be written: {exc}")
