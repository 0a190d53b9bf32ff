"""``ds-profutils capture OUTPUT_DIR``: ask the job writing into OUTPUT_DIR for a trace capture.

The request is ``capture_request.json`` in OUTPUT_DIR, written to a temporary name and renamed into place (the
job never reads half a request).  Rank 0 of the job looks for it once per live interval and renames it when it
takes it; the capture's folder then gets a ``manifest.json`` naming this request's id, ``done`` once every chosen
rank wrote its trace.  A request the job cannot meet is answered in ``capture_request.refused.json``.  With
``--wait`` this command waits for one of those and says what happened, plainly also when no job took it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from ...outputs import CAPTURE_REFUSED, CAPTURE_REQUEST, atomic_path
from .listing import read_captures

__all__ = ["run", "write_request"]

_POLL_S = 0.5


def write_request(output_dir: Path, steps: int, ranks: Union[str, List[int]]) -> Dict[str, Any]:
    """Write the request atomically into ``output_dir``; returns it (its ``id`` names it in the manifest)."""
    request = {"id": uuid.uuid4().hex, "steps": steps, "ranks": ranks, "requested_at": time.time(),
               "host": os.uname().nodename, "pid": os.getpid()}
    path = output_dir / CAPTURE_REQUEST
    with atomic_path(path) as temporary:
        temporary.write_text(json.dumps(request) + "\n", encoding="utf-8")
    return request


def _refusal(output_dir: Path, request_id: str) -> Optional[str]:
    try:
        refused = json.loads((output_dir / CAPTURE_REFUSED).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return refused.get("reason") if isinstance(refused, dict) and refused.get("id") == request_id else None


def _wait(output_dir: Path, request: Dict[str, Any], seconds: float) -> int:
    deadline = time.monotonic() + seconds
    taken = False
    while time.monotonic() < deadline:
        taken = taken or not (output_dir / CAPTURE_REQUEST).exists()
        reason = _refusal(output_dir, request["id"])
        if reason is not None:
            print(f"ds-profutils capture: the job refused the request: {reason}", file=sys.stderr)
            return 1
        for capture in read_captures(output_dir):
            if capture.get("request_id") == request["id"] and capture.get("done"):
                folder = capture["folder"]
                print(f"capture of steps {capture['first_step']}-{capture['first_step'] + capture['steps'] - 1} on "
                      f"ranks {capture['ranks']} written to {folder}")
                print(f"merge it with: ds-profutils timeline {folder} -o {folder / 'timeline.json'}")
                return 0
        time.sleep(_POLL_S)
    if not taken:
        (output_dir / CAPTURE_REQUEST).unlink(missing_ok=True)
        print(f"ds-profutils capture: no job took the request within {seconds:g} s (is a job with "
              f"\"trace_capture\" enabled writing into {output_dir}?); the request was withdrawn", file=sys.stderr)
    else:
        print(f"ds-profutils capture: the job took the request, but its capture was not written within {seconds:g} s "
              f"(see {output_dir}/capture_*/manifest.json later)", file=sys.stderr)
    return 1


def run(args: argparse.Namespace) -> int:
    """Write the request; with ``--wait``, wait for its capture (0) or say why there is none (1)."""
    output_dir: Path = args.output_dir
    if not output_dir.is_dir():
        print(f"ds-profutils capture: {output_dir} is not a directory (the job's trace_capture output_dir)",
              file=sys.stderr)
        return 1
    request = write_request(output_dir, args.steps, args.ranks)
    print(f"ds-profutils capture: request {request['id']} written to {output_dir / CAPTURE_REQUEST}", file=sys.stderr)
    if args.wait is None:
        return 0
    return _wait(output_dir, request, args.wait)
