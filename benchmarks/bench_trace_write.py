"""Writing a large active window when the launcher's SIGTERM arrives, with ranks writing at once.

    python benchmarks/bench_trace_write.py [--steps 1400] [--ranks 2] [--verify]

Each of ``--ranks`` processes (``RANK``/``WORLD_SIZE`` set as a launcher sets them) records a window
of ``--steps`` small training steps (about 100 MB of Chrome trace at the default, 250k events), then
waits inside its last active step; the parent sends SIGTERM to all of them at the same moment and
times each until it has exited, as DeepSpeed's launcher would see it (it sends SIGKILL at 30 s).
Target (DESIGN.md): at most 20 s per rank.  Two cases:

(a) the first cycle is in flight: its trace is exported, and the run trace is that file, linked;
(b) a cycle of the same size is already on disk and the second is in flight: the run trace is the
    previous one's bytes and the new cycle's events streamed after them (link ids shifted).

Each rank reports how long torch took to stop recording and to export (C++ work no signal
interrupts); the rest of the time is ds_profutils' own.  ``--verify`` also ``json.load``s every run
trace afterwards and counts its steps (slow: seconds per 100 MB).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Dict, List

TARGET_S = 20.0

_RANK = textwrap.dedent("""
    import sys, time, torch
    from ds_profutils import profiler, step_profiler

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1400, help="active steps per cycle (1400: about 100 MB)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--verify", action="store_true", help="json.load every run trace afterwards")
    args = parser.parse_args()
    _run_case("a", args.steps, 1, args.ranks, args.verify)
    print()
    _run_case("b", args.steps, 2, args.ranks, args.verify)


if __name__ == "__main__":
    main()
