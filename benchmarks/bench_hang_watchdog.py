"""The hang watchdog's cost on a ZeRO-2 step: ``step_metrics`` with ``hang_timeout_s`` 300 against 0 (off).

    python benchmarks/bench_hang_watchdog.py [--turns 200] [--runs 3]

A ZeRO-2 training step (2 ranks under the deepspeed launcher, gloo on CPU, garbage collector on) with
``step_metrics`` on, the watchdog on against off ("off" is step_metrics on without it: the watchdog's own cost),
interleaved (``bench_engines.attach_turns``: each mode first and second in turn; attach, close and the garbage
they leave untimed).  The step path pays a few attribute writes per phase and one timestamp per optimizer step;
the thread wakes once a second.  Beside each wall ratio, the CPU time a step added (medians, on less off): the
training thread's (the step path) and every thread's of the process (the watchdog's wakes too), which a neighbour's
load on these 2 shared cores does not stretch the way it stretches wall time.  Per rank and run: the median over the turns of the ratio of a block of steps
11-20 after attach (``attach_turns``' steady block, as bench_step_metrics reads it: the second step after attach
still pays the attach's warm-up); the target (<= 1.01x) is met when the median of the runs' worst-rank ratios
meets it.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench_engines import attach_turns, mlp_engine, ranks_figures  # benchmarks/ is the script's own folder

TARGET = 1.01


def worker(out: Path, turns: int, runs: int) -> None:
    from ds_profutils import attach

    engine, batch, rank, config = mlp_engine({"stage": 2}, step_metrics={
        "enabled": True, "output_dir": str(out / "records"), "console": False, "hang_timeout_s": 300})
    configs = {"off": {**config, "step_metrics": {**config["step_metrics"], "hang_timeout_s": 0}}, "on": config}
    ratios = []
    for _ in range(runs):
        steady: dict = {}
        attach_turns(engine, batch, turns, {mode: lambda mode=mode: attach(engine, config=configs[mode]) for mode in configs},
                     steady=steady)
        wall = steady["wall"]  # a block of steps 11-20 after attach: a job's steps, not the attach's warm-up
        cpu = {kind: statistics.median(steady[kind]["on"]) - statistics.median(steady[kind]["off"])
               for kind in ("cpu", "process")}  # seconds a step: the training thread's, every thread's
        ratios.append({"ratio": statistics.median(b / a for a, b in zip(wall["off"], wall["on"])),
                       "off_ms": statistics.median(wall["off"]) * 1e3, "on_ms": statistics.median(wall["on"]) * 1e3,
                       "thread_us": cpu["cpu"] * 1e6, "process_us": cpu["process"] * 1e6})
    (out / f"rank_{rank}.json").write_text(json.dumps(ratios))


def bench(turns: int, runs: int) -> float:
    results = ranks_figures(Path(__file__), ["--turns", str(turns), "--runs", str(runs)], timeout=1800)
    print(f"ZeRO-2 training step, 2 ranks (gloo, CPU), {runs} runs of {turns} interleaved turns: step_metrics with "
          "the hang watchdog against without it")
    worst = []
    for run in range(runs):
        cells = [f"rank {rank}: off {result[run]['off_ms']:6.2f} ms on {result[run]['on_ms']:6.2f} ms "
                 f"{result[run]['ratio']:5.3f}x (CPU a step: training thread {result[run]['thread_us']:+.0f} us, "
                 f"every thread {result[run]['process_us']:+.0f} us)" for rank, result in results.items()]
        worst.append(max(result[run]["ratio"] for result in results.values()))
        print(f"    run {run + 1}: " + ";  ".join(cells))
    figure = statistics.median(worst)
    print(f"    median of the runs' worst-rank ratios: {figure:5.3f}x (runs: "
          f"{', '.join(f'{ratio:5.3f}x' for ratio in worst)}; target <= {TARGET}x)")
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs, each of --turns turns (the protocol's three)")
    parser.add_argument("--turns", type=int, default=200, help="interleaved turns of the two modes per run")
    for hidden in ("--worker", "--local_rank"):  # the launched ranks' own arguments
        parser.add_argument(hidden, type=Path if hidden == "--worker" else int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is None:
        bench(args.turns, args.runs)
    else:
        worker(args.worker, args.turns, args.runs)


if __name__ == "__main__":
    main()
