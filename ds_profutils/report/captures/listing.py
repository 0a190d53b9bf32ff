"""The capture folders of an output_dir (``capture_{S}/``, ``capture_{engine}_{S}/``), read from their manifests,
and the lines ``ds-profutils report`` prints about them."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

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


def capture_lines(captures: Sequence[Mapping[str, Any]]) -> List[str]:
    """``report``'s section on the captures :func:`read_captures` read (none: no lines)."""
    if not captures:
        return []
    lines = [f"Trace captures ({len(captures)}; merge one with: ds-profutils timeline DIR/capture_S -o FILE.json):"]
    for capture in captures:
        first, steps = capture.get("first_step"), capture.get("steps")
        span = f"steps {first}-{first + steps - 1}" if isinstance(first, int) and isinstance(steps, int) else "steps ?"
        state = "done" if capture.get("done") else "not confirmed by every chosen rank"
        lines.append(f"  {capture['folder'].name}: {capture.get('reason', 'no manifest')}, {span}, "
                     f"ranks {capture.get('ranks', '?')}, traces of ranks {capture['traces']} ({state})")
        hosts = _hosts_line(capture.get("hosts"), capture["folder"].name)
        if hosts:
            lines.append(hosts)
        for rank, why in (capture.get("why_these_ranks") or {}).items():
            lines.append(f"    rank {rank}: {why}")
        if capture.get("figures"):
            lines.append(f"    fired by: {json.dumps(capture['figures'], sort_keys=True)}")
    return lines


def _hosts_line(hosts: Any, folder: str) -> Optional[str]:
    """Where the chosen ranks' traces are, by host, when they span more than one: each rank writes its trace on
    its own host, so unless the hosts share a file system the folder read here lacks the other hosts' traces.
    None on one host, and for a manifest without ``hosts`` (written before it was there)."""
    if not isinstance(hosts, dict):
        return None
    by_host: Dict[Optional[str], List[str]] = {}
    for rank, host in hosts.items():
        by_host.setdefault(host if isinstance(host, str) else None, []).append(str(rank))
    if len(by_host) < 2:
        return None
    where = [f"{host} ranks [{', '.join(ranks)}]" for host, ranks in by_host.items() if host is not None]
    if None in by_host:
        where.append(f"host unknown ranks [{', '.join(by_host[None])}]")
    return f"    traces on hosts: {'; '.join(where)} (each host writes its ranks' traces into its own {folder}/)"
