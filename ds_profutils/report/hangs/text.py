"""The HANG section of the text report (first, before everything else): who never arrived, and who waits."""
from __future__ import annotations

from typing import Any, List, Mapping

from .reading import FRAMES_SHOWN
from ...units import rank_ranges
from ..tables import wrap

__all__ = ["hang_lines"]


def _where(entry: Mapping[str, Any]) -> str:
    if entry["state"] == "in_collective":
        return (f"inside {entry['collective']} (group {rank_ranges(entry['group'])}, seq {entry['seq']}) for "
                f"{entry['waiting_s']:.0f} s")
    return "outside collectives"


def hang_lines(report: Mapping[str, Any]) -> List[str]:
    """The HANG section for every engine with unresolved hang files; no lines when there are none."""
    lines: List[str] = []
    for name, engine in report["engines"].items():
        hang = engine.get("hang")
        if not hang:
            continue
        if hang.get("closed"):  # (files of earlier versions never are)
            lines += wrap(f"NO STEP BEFORE THE CLOSE: engine {name} at global step {hang['global_step']}, {hang['phase']}: "
                          f"no optimizer step for {hang['stuck_s']:.0f} s or more (timeout {hang['timeout_s']:g} s), then "
                          "every rank's program closed it: a long evaluation or save after the last step, or a hang "
                          "the program stopped waiting for (a caught Ctrl-C or timeout); where each rank was:")
        else:
            lines += wrap(f"HANG: engine {name} at global step {hang['global_step']}, {hang['phase']}: no optimizer "
                          f"step for {hang['stuck_s']:.0f} s (timeout {hang['timeout_s']:g} s)")
        ranks = hang["ranks"]
        if hang["culprits"] or hang["missing"]:
            named = [f"{'rank' if len(hang['culprits']) == 1 else 'ranks'} {rank_ranges(hang['culprits'])}"
                     ] if hang["culprits"] else []
            if hang["missing"]:
                named.append(f"ranks {rank_ranges(hang['missing'])}, which wrote no hang file here")
            lines += wrap("  never arrived: " + "; ".join(named))
        for mismatch in hang.get("mismatched") or []:  # (files of earlier versions have none)
            inside = ", ".join(f"rank {rank} in {name}" for rank, name in mismatch["collectives"].items())
            why = ("both ends of the pair wait on the same side of a transfer: the stages' schedules do not match "
                   "there" if mismatch.get("p2p") else "the ranks' programs issued different collectives there (a rank "
                   "that left the loop early on uneven data, or a collective only some ranks call)")
            lines += wrap(f"  mismatched collectives: group {rank_ranges(mismatch['group'])}, seq {mismatch['seq']}: "
                          f"{inside}: {why}")
        if not (hang["culprits"] or hang["missing"] or hang.get("mismatched")):
            lines.append("  no rank waits inside a collective for another: see each rank's stack" if not hang["waiting"]
                         else "  no rank is behind: the ranks waiting are inside the same collective, which does not "
                              "end (the network or the backend): see each rank's stack")
        for rank in [rank for rank in hang["culprits"] or list(ranks) if rank in ranks]:
            entry = ranks[rank]
            lines += wrap(f"  rank {rank} ({entry['host']}, pid {entry['pid']}): {_where(entry)}, phase "
                          f"{entry['phase']}; top of its stack:")
            lines += [f"      {frame}" for frame in entry["stack"][:FRAMES_SHOWN]]
        if hang["waiting"]:
            shown = [f"rank {rank} {_where(ranks[rank])}, {ranks[rank]['phase']}" for rank in hang["waiting"][:8]]
            more = len(hang["waiting"]) - len(shown)
            lines += wrap("  waiting: " + "; ".join(shown) + (f"; ... {more} more" if more > 0 else ""))
    return lines
