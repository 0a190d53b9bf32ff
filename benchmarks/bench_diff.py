"""``ds-profutils diff`` at scale, and its start, measured in one run (records generated as ``bench_report.py`` does).

    python benchmarks/bench_diff.py [--ranks 1024] [--steps 1000] [--skip-big]

(a) Start to finish on two small runs (2 ranks x 10 steps each): ``diff`` and ``diff --json``, median
    of 7 fresh processes (target <= 0.5 s), and which heavy modules they import (none).
(b) Two ``--ranks`` x ``--steps`` runs (1024 x 1000, ~2.5 GB of records each): the diff's time per GB
    of both runs' records (target: the report's budget, <= 10 s per GB) and its peak memory, text and
    ``--json``; and, measured in the same run so that the machine's load falls on both, its time over
    that of ``report`` on each run (the diff reads each run with the report, so ~1x).  Each run is read
    by the report and reduced before the other is read, so the peak is one report's (170 bytes per rank
    and step: 10 columns read per rank, 11 in the joined view) plus the reduction, not two.
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from pathlib import Path

from bench_report import SECONDS_PER_GB_TARGET, START_TARGET, _variants, heavy_imports, run_command, \
    start_to_finish, write_rank


def generate_pair(directory: Path, ranks: int, steps: int) -> int:
    """BASE and NEW under ``directory``: the same job, NEW's events drawn anew; returns both runs' bytes."""
    size = 0
    for run, seed in (("base", 0), ("new", 1)):
        (directory / run).mkdir()
        variants = _variants(random.Random(seed))
        size += sum(write_rank(directory / run, rank, ranks, steps, variants) for rank in range(ranks))
    return size


def bench_start() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        generate_pair(Path(tmp), 2, 10)
        runs = (f"{tmp}/base", f"{tmp}/new")
        print("(a) start to finish on two small runs (2 ranks x 10 steps each), median of 7 fresh processes:")
        for name, args in (("diff", ("diff", *runs)), ("diff --json", ("diff", *runs, "--json"))):
            seconds = statistics.median(start_to_finish(*args) for _ in range(7))
            print(f"    ds-profutils {name:12s} {seconds:5.2f} s (target <= {START_TARGET} s); heavy imports: "
                  f"{', '.join(heavy_imports(*args)) or 'none'}")


def bench_big(ranks: int, steps: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        size = generate_pair(Path(tmp), ranks, steps)
        gigabytes = size / 2**30
        print(f"(b) two runs of {ranks} ranks x {steps} steps: {gigabytes:.2f} GB of records in all")
        for extra in ((), ("--json",)):
            reports = sum(run_command("report", f"{tmp}/{run}", *extra)["seconds"] for run in ("base", "new"))
            result = run_command("diff", f"{tmp}/base", f"{tmp}/new", *extra)
            print(f"    ds-profutils diff {' '.join(extra):6s} {result['seconds']:6.1f} s -> "
                  f"{result['seconds'] / gigabytes:.1f} s per GB (target <= {SECONDS_PER_GB_TARGET:.0f} s per GB); "
                  f"{result['seconds'] / reports:.2f}x report {' '.join(extra)} on each run ({reports:.1f} s); peak RSS "
                  f"{result['peak_mb']:.0f} MB (readers {result['workers_peak_mb']:.0f} MB); one report's arrays: "
                  f"{96 * ranks * steps / 2**20:.0f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024, help="(b) ranks of each run")
    parser.add_argument("--steps", type=int, default=1000, help="(b) steps of each run")
    parser.add_argument("--skip-big", action="store_true", help="skip (b) (it writes ~5 GB to the temp dir)")
    args = parser.parse_args()
    bench_start()
    if not args.skip_big:
        bench_big(args.ranks, args.steps)


if __name__ == "__main__":
    main()
