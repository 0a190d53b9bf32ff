"""Live metrics' cost on a ZeRO-2 training step, measured in one run.

    python benchmarks/bench_live.py [--turns 60] [--interval 10]

A ZeRO-2 engine (2 ranks under the deepspeed launcher, gloo on CPU, garbage collector on, DeepSpeed's
``csv_monitor`` enabled) trains in blocks of ``--interval`` optimizer steps: a block without live
metrics, and a block where each step's figures are taken (clock reads, as the recorder takes them) and
handed to ``LiveMetrics.step_finished`` with the console line and the engine's monitor as sinks, so
each such block holds one interval end: the gather to rank 0, the events, the CSV rows and the line.
The two kinds of block alternate which goes first; the figure is the median over turns of the ratio of
the blocks' times, per rank (target <= 1.03x for the live events; the step records themselves are the
recorder's benchmark).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List

from bench_engines import mlp_engine, ranks_figures  # benchmarks/ is the script's own folder

TARGET = 1.03


def worker(out: Path, turns: int, interval: int) -> None:
    from ds_profutils.engine.live import LiveMetrics, StepFigures, monitor_sink

    engine, batch, rank, _ = mlp_engine({"stage": 2}, csv_monitor={
        "enabled": True, "output_path": str(out / "csv"), "job_name": "bench"})
    live = LiveMetrics(SimpleNamespace(monitor_interval=interval, console=True), 100.0, [monitor_sink(engine)])
    last_end = [None]

    def step(with_live: bool) -> None:
        began = time.perf_counter()
        engine.backward(engine(batch).pow(2).mean())
        engine.step()
        if with_live:
            end = time.perf_counter()
            iteration = None if last_end[0] is None else (end - last_end[0]) * 1e3
            step_ms = (end - began) * 1e3
            live.step_finished(StepFigures(engine.global_steps, step_ms, iteration,
                                           None if iteration is None else iteration - step_ms, 10**9, 1024, 8,
                                           0.5, 1.0, None))
            last_end[0] = end

    def block(with_live: bool) -> float:
        began = time.perf_counter()
        for _ in range(interval):
            step(with_live)
        return time.perf_counter() - began

    for _ in range(2):
        block(False)
        block(True)
    seconds: Dict[str, List[float]] = {"off": [], "live": []}
    for turn in range(turns):
        order = ("off", "live") if turn % 2 == 0 else ("live", "off")
        for mode in order:
            seconds[mode].append(block(mode == "live"))
    live.close()
    (out / f"rank_{rank}.json").write_text(json.dumps(seconds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=60)
    parser.add_argument("--interval", type=int, default=10, help="monitor_interval: steps per block")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.turns, args.interval)
        return
    results = ranks_figures(Path(__file__), ["--turns", str(args.turns), "--interval", str(args.interval)],
                            timeout=900)
    print(f"ZeRO-2 step, 2 ranks, {args.turns} turns of a {args.interval}-step block off and one with live metrics")
    worst = 0.0
    for rank, seconds in results.items():
        ratio = statistics.median(live / off for off, live in zip(seconds["off"], seconds["live"]))
        worst = max(worst, ratio)
        print(f"    rank {rank}: off {statistics.median(seconds['off']) / args.interval * 1e3:6.2f} ms a step   "
              f"live {statistics.median(seconds['live']) / args.interval * 1e3:6.2f} ms a step   {ratio:5.3f}x")
    print(f"    worst rank, live events on against off: {worst:5.3f}x  (target <= {TARGET}x)")


if __name__ == "__main__":
    main()
