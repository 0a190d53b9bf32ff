"""What writing a cycle costs: a large window at the launcher's SIGTERM, and cycle after cycle of a long run.

    python benchmarks/bench_trace_write.py [--cases a,b,flat] [--steps 1400] [--ranks 2] [--verify]
                                           [--cycles 50] [--cycle-steps 40]

(a), (b): each of ``--ranks`` processes (``RANK``/``WORLD_SIZE`` set as a launcher sets them) records a
window of ``--steps`` small training steps (about 100 MB of Chrome trace at the default, 250k events),
then waits inside its last active step; the parent sends SIGTERM to all of them at the same moment and
times each until it has exited, as DeepSpeed's launcher would see it (it sends SIGKILL at 30 s).
Target (DESIGN.md): at most 20 s per rank.  The ranks set ``GRACE_S`` to 0: a step that waits
for ever never reaches its boundary, so the window is written as the profiled call unwinds (the same
write).  (a): the first cycle is in flight: its trace is exported and the run trace written whole;
(b): a cycle of the same size is on disk and the second is in flight: it is spliced into the run trace.
Each rank reports how long torch took to stop recording and to export (C++ work no signal interrupts);
the rest of the time is ds_profutils' own.  ``--verify`` also ``json.load``s every run trace afterwards
and counts its steps (slow: seconds per 100 MB).

(flat): a ``repeat: 0`` run of ``--cycles`` cycles of ``--cycle-steps`` active steps each, in this
process; each cycle's write (export, run trace, per-cycle file) is timed.  Target (DESIGN.md): cycle 50
costs at most 1.5x cycle 1.  Each figure is the median of the cycle and its two neighbours (cycle 1: cycles
1-3), as single writes on a shared machine vary by more than that.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Dict, List

TARGET_S = 20.0
FLAT_TARGET = 1.5

_RANK = textwrap.dedent("""
    import sys, time, torch
    from ds_profutils import profiler, step_profiler
    from ds_profutils.torch_profiler import watchdog

    watchdog.GRACE_S = 0.0  # the last step never ends: unwind at once (see the module doc)
    output_dir, active, cycles = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    for name in ("stop_trace", "export_chrome_trace"):  # how long torch's own C++ work takes
        def timed(self, *args, _original=getattr(torch.profiler.profile, name), _name=name):
            began = time.perf_counter()
            try:
                return _original(self, *args)
            finally:
                print(f"torch {_name} {time.perf_counter() - began:.2f} s", flush=True)
        setattr(torch.profiler.profile, name, timed)

    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    batch = torch.randn(2, 8)
    last = cycles * (active + 1) - 1  # one warmup step per cycle

    @profiler(output_dir=output_dir, skip_first=0, wait=0, warmup=1, active=active, repeat=0, record_shapes=True,
              summary_ranks=[])
    def train():
        for step in range(last + 1):
            model(batch).sum().backward()
            if step == last:
                print("recording", flush=True)
                time.sleep(600)  # SIGTERM comes here
            step_profiler()

    train()
""")


def _run_case(name: str, active: int, cycles: int, ranks: int, verify: bool) -> None:
    with tempfile.TemporaryDirectory() as output_dir:
        jobs = []
        for rank in range(ranks):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank))
            jobs.append(subprocess.Popen([sys.executable, "-c", _RANK, output_dir, str(active), str(cycles)],
                                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        lines: Dict[int, List[str]] = {rank: [] for rank in range(ranks)}
        ready = threading.Barrier(ranks + 1)

        def read(rank: int) -> None:
            for line in jobs[rank].stdout:
                lines[rank].append(line)
                if line.strip() == "recording":
                    ready.wait()

        readers = [threading.Thread(target=read, args=(rank, ), daemon=True) for rank in range(ranks)]
        for reader in readers:
            reader.start()
        ready.wait(timeout=1200)
        began = time.perf_counter()
        for job in jobs:
            job.send_signal(signal.SIGTERM)
        ended = {}
        for rank, job in enumerate(jobs):
            job.wait(timeout=120)
            ended[rank] = time.perf_counter() - began
        for reader in readers:
            reader.join()
        print(f"({name}) {ranks} ranks, {cycles} cycle(s) of {active} steps, SIGTERM to all at once")
        for rank, job in enumerate(jobs):
            cycle_files = sorted((Path(output_dir) / f"rank_{rank}").glob("*.pt.trace.json"))
            window_mb = cycle_files[-1].stat().st_size / 1e6 if cycle_files else 0.0
            run_trace = Path(output_dir) / f"trace_rank_{rank}.json"
            torch_times = [line.strip() for line in lines[rank] if line.startswith("torch ")][-2:]
            within = ended[rank] <= TARGET_S and job.returncode == -signal.SIGTERM
            verdict = "ok" if within else "OVER TARGET"
            print(f"    rank {rank}: window {window_mb:6.1f} MB, run trace {run_trace.stat().st_size / 1e6:6.1f} MB, "
                  f"SIGTERM to exit {ended[rank]:5.1f} s (target <= {TARGET_S:g}: {verdict}), "
                  f"exit {job.returncode}; {', '.join(torch_times)}")
            if verify:
                with open(run_trace) as handle:
                    events = json.load(handle)["traceEvents"]
                steps = sum(1 for e in events if e.get("name", "").startswith("ProfilerStep#"))
                print(f"             run trace parses: {len(events)} events, {steps} steps "
                      f"(expected {cycles * active})")


def _flat_case(cycles: int, cycle_steps: int) -> None:
    """Time every cycle's write in one ``repeat: 0`` run."""
    import torch

    from ds_profutils import profiler, step_profiler
    from ds_profutils.torch_profiler.writer import RunWriter

    seconds: List[float] = []
    save_cycle = RunWriter.save_cycle

    def timed(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        began = time.perf_counter()
        try:
            return save_cycle(self, *args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - began)

    RunWriter.save_cycle = timed  # type: ignore[method-assign]
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    batch = torch.randn(2, 8)
    with tempfile.TemporaryDirectory() as output_dir:
        profiled = profiler(output_dir=output_dir, skip_first=0, wait=0, warmup=1, active=cycle_steps, repeat=0,
                            record_shapes=True, summary_ranks=[])
        with profiled:
            for _ in range(cycles * (cycle_steps + 1)):
                model(batch).sum().backward()
                step_profiler()
        run_trace = Path(output_dir) / "trace_rank_0.json"
        size_mb = run_trace.stat().st_size / 1e6
    RunWriter.save_cycle = save_cycle  # type: ignore[method-assign]

    def around(cycle: int) -> float:  # cycle counts from 1; the median of it and its neighbours
        index = min(max(cycle - 1, 1), len(seconds) - 2)
        return statistics.median(seconds[index - 1:index + 2])

    points = [point for point in (1, 10, cycles) if point <= len(seconds)]
    print(f"(flat) repeat: 0, {len(seconds)} cycles of {cycle_steps} active steps; run trace {size_mb:.1f} MB at the "
          "end; write per cycle (median of 3):")
    for point in points:
        print(f"    cycle {point:3d}: {around(point) * 1e3:8.1f} ms")
    ratio = around(points[-1]) / around(1)
    print(f"    cycle {points[-1]} / cycle 1 = {ratio:.2f}x (target <= {FLAT_TARGET:g}x: "
          f"{'ok' if ratio <= FLAT_TARGET else 'OVER TARGET'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="a,b,flat", help="which cases to run, comma-separated")
    parser.add_argument("--steps", type=int, default=1400, help="(a), (b): active steps (1400: about 100 MB)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--verify", action="store_true", help="json.load every run trace afterwards")
    parser.add_argument("--cycles", type=int, default=50, help="(flat): cycles of the run")
    parser.add_argument("--cycle-steps", type=int, default=40, help="(flat): active steps per cycle")
    args = parser.parse_args()
    cases = args.cases.split(",")
    if "a" in cases:
        _run_case("a", args.steps, 1, args.ranks, args.verify)
        print()
    if "b" in cases:
        _run_case("b", args.steps, 2, args.ranks, args.verify)
        print()
    if "flat" in cases:
        _flat_case(args.cycles, args.cycle_steps)


if __name__ == "__main__":
    main()
