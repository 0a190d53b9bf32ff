"""Trace capture armed and idle: a ZeRO-2 step with ``trace_capture`` on (no request, no anomaly) against ``step_metrics``
on without it ("off": the capture's own cost, DESIGN's protocol).

    python benchmarks/bench_trace_capture.py [--turns 200] [--runs 3]

2 ranks under the deepspeed launcher, gloo on CPU, garbage collector on, the modes interleaved
(``bench_engines.attach_turns``: attach, close and their garbage untimed).  ``monitor_interval`` is 1 in both
modes, so every timed step ends an interval: the armed step (``on_request``, nobody asking) pays its worst case, the
capture columns in the row, rank 0's one rename attempt for a request and the decision on the rows, besides the
listener's hooks.  Per rank
and run: the median over the turns of the ratio of a block of steps 11-20 after attach (``attach_turns``' steady
block, as the other step benchmarks read it: the second step after attach still pays the attach's warm-up), with
the CPU time a step added beside it (the training thread's, and every thread's of the process); the target
(<= 1.01x) is met when the median of the runs' worst-rank ratios meets it.
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
        "enabled": True, "output_dir": str(out / "records"), "console": False, "monitor_interval": 1,
        "hang_timeout_s": 0})
    configs = {"off": config, "armed": {**config, "trace_capture": {"enabled": True}}}  # on_request, nobody asks
    results = []
    for _ in range(runs):
        steady: dict = {}
        attach_turns(engine, batch, turns, {mode: lambda mode=mode: attach(engine, config=configs[mode]) for mode in configs},
                     steady=steady)
        wall = steady["wall"]  # a block of steps 11-20 after attach, every one ending an interval
        results.append({mode: statistics.median(values) * 1e3 for mode, values in wall.items()})
        results[-1]["ratio"] = statistics.median(b / a for a, b in zip(wall["off"], wall["armed"]))
        results[-1].update({f"{kind}_us": (statistics.median(steady[kind]["armed"]) - statistics.median(steady[kind]["off"]))
                            * 1e6 for kind in ("cpu", "process")})  # CPU a step: the training thread's, every thread's
    (out / f"rank_{rank}.json").write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs, each of --turns turns (the protocol's three)")
    parser.add_argument("--turns", type=int, default=200, help="interleaved turns of the two modes per run")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.turns, args.runs)
        return
    ranks = list(ranks_figures(Path(__file__), ["--turns", str(args.turns), "--runs", str(args.runs)],
                               timeout=3600).values())
    print(f"ZeRO-2 training step, 2 ranks (gloo, CPU), monitor_interval 1, {args.runs} runs of {args.turns} "
          "interleaved turns: trace_capture armed and idle against step_metrics alone")
    worst = [max(rank[run]["ratio"] for rank in ranks) for run in range(args.runs)]
    for run, ratio in enumerate(worst):
        print(f"    run {run + 1}: " + ";  ".join(f"rank {r}: off {rank[run]['off']:6.2f} ms armed "
                                                  f"{rank[run]['armed']:6.2f} ms {rank[run]['ratio']:5.3f}x "
                                                  f"(CPU a step: training thread {rank[run]['cpu_us']:+.0f} us, every "
                                                  f"thread {rank[run]['process_us']:+.0f} us)"
                                                  for r, rank in enumerate(ranks)) + f"  (worst {ratio:5.3f}x)")
    print(f"    median of the runs' worst-rank ratios: {statistics.median(worst):5.3f}x (target <= {TARGET}x)")


if __name__ == "__main__":
    main()
