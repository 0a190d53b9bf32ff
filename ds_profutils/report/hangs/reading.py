"""The HANG section: the ranks' ``hang_rank_{r}.json`` files lined up, and the rank that never arrived named.

Every rank of a hung job writes where it is (docs/hangs.md): the collective it is inside now, if any, with its
sequence number on its group, and how many collectives it issued on each group.  Collectives on one group run
in one order on every member, so where some ranks wait inside collective n of a group, a member that issued
fewer than n there never arrived: it is a *culprit*, whatever it does instead (its stack says: a sleep, a data
loader, a collective on another group, a deadlock).  A member without a file at all (killed, or on a host
whose files are elsewhere) is named too.  Where no rank is inside a collective, the members of a group that issued
fewer collectives there than another member are named (that member waits on one the watchdog does not see as
inside: the program's ``async_op`` handle); with equal counts nobody waits for anybody: the section shows each
rank's stack and names no culprit.  Ranks inside *different* collectives at the same sequence number of one group are
*mismatched*: their programs issued different collectives there (a rank that left the loop early on uneven data
and calls a barrier where the others reduce gradients), so each waits for the others in one they never join.

Where every rank's file says the program closed its engines with no step since (``closed_after_s``: a long evaluation
or save after the last step, or a hang the program stopped waiting for, a caught Ctrl-C or timeout), the section
says that rather than HANG (``closed``); its culprits and stacks are still those of where the ranks waited.

A file that says ``resolved`` was a slow step, not a hang: it is left out here (the step's record shows the
time).  Nothing here needs the step records: a job that hung before its first step is reported too.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

from ...outputs import BETWEEN_STEPS, HANG_SCHEMA, hang_files

__all__ = ["FRAMES_SHOWN", "add_hangs", "hang_reports", "read_hang_files"]

FRAMES_SHOWN = 5
"""Frames of a culprit's stack the text shows (innermost first); ``--json`` has the whole stack."""


def read_hang_files(directory: Path) -> Tuple[Dict[int, Dict[str, Any]], List[Dict[str, Any]]]:
    """The unresolved hang files of ``directory`` by rank, and the files that could not be read (as the report's
    ``incomplete`` entries)."""
    found: Dict[int, Dict[str, Any]] = {}
    unread: List[Dict[str, Any]] = []
    for rank, path in hang_files(directory).items():
        try:
            content = json.loads(path.read_bytes())
        except (OSError, ValueError) as exc:
            unread.append({"kind": "hang", "engine": None, "rank": rank, "file": path.name,
                           "reason": f"not read: {getattr(exc, 'strerror', None) or exc}"})
            continue
        if not isinstance(content, dict) or content.get("schema") != HANG_SCHEMA:
            unread.append({"kind": "hang", "engine": None, "rank": rank, "file": path.name,
                           "reason": f"not read: not a hang file of schema {HANG_SCHEMA}"})
        elif not content.get("resolved"):
            found[rank] = content
    return found, unread


def _stack(content: Mapping[str, Any]) -> List[str]:
    """The training thread's stack (the main thread where the file does not say), innermost first."""
    threads = content.get("threads") or []
    thread = next((t for t in threads if t.get("training")), None) or next(
        (t for t in threads if t.get("name") == "MainThread"), None)
    if thread is None:
        return []
    return [f"{frame['file']}:{frame['line']} {frame['function']}" for frame in thread.get("stack") or []]


def _issued(content: Mapping[str, Any], group: Tuple[int, ...]) -> int:
    """How many collectives the rank of ``content`` issued on ``group`` (the one it is inside counts)."""
    for entry in content.get("groups") or []:
        if tuple(entry["group"]) == group:
            return int(entry["seq"])
    return 0


def _issued_most(files: Mapping[int, Mapping[str, Any]]) -> Dict[Tuple[int, ...], int]:
    """Per group every member of which wrote a file: the most collectives a member issued there (the members that
    issued fewer are behind; with equal counts none is).  Where no rank is inside a collective, a rank ahead waits on one that is not marked (the
    program's ``async_op`` handle, a ``wait()`` in a step ``log_interval`` skips) for the ranks behind."""
    groups = {tuple(entry["group"]) for content in files.values() for entry in content.get("groups") or []}
    return {group: max(_issued(files[rank], group) for rank in group) for group in groups
            if all(rank in files for rank in group)}


def _culprits(files: Mapping[int, Mapping[str, Any]]) -> Tuple[List[int], List[int]]:
    """The ranks that never arrived where others wait, and the ranks without a file among those awaited; where no
    rank is inside a collective, the ranks behind on a group whose members issued different numbers."""
    awaited: Dict[Tuple[int, ...], int] = {}  # per group: the highest sequence number a rank waits inside
    for content in files.values():
        inside = content.get("collective")
        if inside:
            group = tuple(inside["group"])
            awaited[group] = max(awaited.get(group, 0), int(inside["seq"]))
    awaited = awaited or _issued_most(files)
    culprits, missing = set(), set()
    for group, seq in awaited.items():
        for rank in group:
            if rank not in files:
                missing.add(rank)
            elif _issued(files[rank], group) < seq:
                culprits.add(rank)
    return sorted(culprits), sorted(missing)


_P2P_END = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}
"""A pipeline's point-to-point calls by the end of the pair they are: a matched pair is one send and one receive."""


def _matched(names: Sequence[str]) -> bool:
    """Whether the ranks inside one sequence number of a group called the same collective (for a send/receive pair:
    one each way)."""
    ends = sorted(_P2P_END.get(name, name) for name in names)
    if any(name in _P2P_END for name in names):
        return ends == ["recv", "send"]
    return len(set(names)) == 1


def _mismatched(files: Mapping[int, Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """Per group and sequence number that two or more ranks are inside different collectives at (two sends, where
    a pair's receive was due): the group, the number, and each of those ranks' collective."""
    inside_at: Dict[Tuple[Tuple[int, ...], int], Dict[int, str]] = {}
    for rank, content in sorted(files.items()):
        inside = content.get("collective")
        if inside:
            inside_at.setdefault((tuple(inside["group"]), int(inside["seq"])), {})[rank] = inside["name"]
    return [{"group": list(group), "seq": seq, "collectives": names,
             "p2p": all(name in _P2P_END for name in names.values())}  # a pair's ends both sending (or receiving)
            for (group, seq), names in sorted(inside_at.items())
            if len(names) > 1 and not _matched(list(names.values()))]


def _rank_entry(content: Mapping[str, Any], engine: Mapping[str, Any]) -> Dict[str, Any]:
    inside = content.get("collective")
    return {
        "state": "in_collective" if inside else "outside_collectives",
        "collective": inside["name"] if inside else None,
        "group": inside["group"] if inside else None,
        "seq": inside["seq"] if inside else None,
        "bytes": inside["bytes"] if inside else None,
        "waiting_s": inside["waiting_s"] if inside else None,
        "last_collective": content.get("last_collective"),
        "global_step": engine.get("global_step"),
        "phase": engine.get("phase"),
        "stuck_s": content.get("stuck_s"),
        "host": content.get("host"),
        "pid": content.get("pid"),
        "memory": content.get("memory"),
        "stack": _stack(content),
    }


def hang_reports(files: Mapping[int, Mapping[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per engine named in the files, ``engines.{name}.hang`` of the report (docs/hangs.md): the step and phase
    the job is stuck in, the culprits, the waiting ranks, and each rank's state and stack."""
    if not files:
        return {}
    culprits, missing = _culprits(files)
    mismatched = _mismatched(files)
    names: List[str] = []
    for content in files.values():
        names += [engine["name"] for engine in content.get("engines") or [] if engine["name"] not in names]
    # Several engines attached: the hang is that of the engines some rank is inside (a collective belongs to the step
    # running it); an engine between steps on every rank meanwhile only waits for them.
    inside = [name for name in names if any(engine["name"] == name and engine.get("phase") != BETWEEN_STEPS
                                            for content in files.values() for engine in content.get("engines") or [])]
    names = inside or names
    reports = {}
    for name in names:
        ranks = {}
        for rank, content in sorted(files.items()):
            engine = next((e for e in content.get("engines") or [] if e["name"] == name), None)
            if engine is not None:
                ranks[rank] = _rank_entry(content, engine)
        steps = [entry["global_step"] for entry in ranks.values() if entry["global_step"] is not None]
        first = ranks.get(culprits[0]) if culprits and culprits[0] in ranks else next(iter(ranks.values()))
        reports[name] = {
            "global_step": min(steps) if steps else None,
            "phase": first["phase"],
            "culprits": culprits,
            "missing": missing,
            "mismatched": mismatched,
            "waiting": [rank for rank, entry in ranks.items()
                        if entry["state"] == "in_collective" and rank not in culprits],
            # every rank said so: a rank without a file (the others wait for it) cannot have
            "closed": not missing and all(content.get("closed_after_s") is not None for content in files.values()),
            "timeout_s": min(content.get("timeout_s") or 0 for content in files.values()),
            "stuck_s": max(content.get("stuck_s") or 0 for content in files.values()),
            "ranks": ranks,
        }
    return reports


def add_hangs(engines: Dict[str, Any], hangs: Mapping[str, Any], files: Mapping[int, Mapping[str, Any]],
              empty_engine: Callable[[str], Dict[str, Any]]) -> None:
    """Give each engine report its ``hang`` (None: no hang file names it); an engine named only by hang files (a
    hang before its first record) gets ``empty_engine(name)``, an engine report without records."""
    for name in hangs:
        if name not in engines:
            engines[name] = empty_engine(name)
            engines[name]["world_size"] = max(content.get("world_size") or 0 for content in files.values())
    for name, engine in engines.items():
        engine["hang"] = hangs.get(name)
