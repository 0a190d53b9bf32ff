"""The capture folders of an output_dir (``capture_{S}/``, ``capture_{engine}_{S}/``), read from their manifests,
and the lines ``ds-profutils report`` prints about them."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

from ...outputs import CAPTURE_DIR_PATTERN, CAPTURE_MANIFEST, trace_files

__all__ = ["capture_lines", "read_captures"]


def read_captures(directory: Path) -> List[Dict[str, Any]]:
    """Every capture folder in ``directory``, oldest step first: its manifest (``{}`` where it cannot be read),
    with ``folder`` and ``traces`` (the ranks whose trace is there) added."""
    found = []
    if not directory.is_dir():
        return found
    for folder in directory.iterdir():
        match = CAPTURE_DIR_PATTERN.fullmatch(folder.name)
        if not (match and folder.is_dir()):
            continue
        try:
            manifest = json.loads((folder / CAPTURE_MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            manifest = {}
        if not isinstance(manifest, dict):
            manifest = {}
        manifest.update(folder=folder, traces=sorted(trace_files(folder)))
        found.append((match.group(1) or "", int(match.group(2)), manifest))
    return [manifest for _, _, manifest in sorted(found, key=lambda item: (item[0], item[1]))]


def capture_lines(directory: Path) -> List[str]:
    """``report``'s section on the captures in ``directory`` (none: no lines)."""
    captures = read_captures(directory)
    if not captures:
        return []
    lines = [f"Trace captures ({len(captures)}; merge one with: ds-profutils timeline DIR/capture_S -o FILE.json):"]
    for capture in captures:
        first, steps = capture.get("first_step"), capture.get("steps")
        span = f"steps {first}-{first + steps - 1}" if isinstance(first, int) and isinstance(steps, int) else "steps ?"
        state = "done" if capture.get("done") else "not confirmed by every chosen rank"
        lines.append(f"  {capture['folder'].name}: {capture.get('reason', 'no manifest')}, {span}, "
                     f"ranks {capture.get('ranks', '?')}, traces of ranks {capture['traces']} ({state})")
        for rank, why in (capture.get("why_these_ranks") or {}).items():
            lines.append(f"    rank {rank}: {why}")
        if capture.get("figures"):
            lines.append(f"    fired by: {json.dumps(capture['figures'], sort_keys=True)}")
    return lines
