"""Step records from ``"step_metrics"`` on a ZeRO-2 engine, measured against no records in one run.

    python benchmarks/bench_step_metrics.py [--turns 200] [--runs 3]

A ZeRO-2 training step (2 ranks under the deepspeed launcher, gloo on CPU, garbage collector on) with
``step_metrics`` on (``attach`` before twenty steps, ``close`` after them) against off, interleaved: each
turn runs off, on, and on with ``memory: false`` (on CPU the memory figures are RSS reads at each phase
boundary), each mode first, second and third in turn.  The garbage ``attach`` and ``close`` leave is collected untimed.
Figures per rank, medians over the turns of the ratio of adjacent steps (wall time, the target's; and the
training thread's CPU time, which a loaded machine does not stretch the way it stretches waiting):

* steps 11-20 after ``attach``, timed as one block (target <= 1.02x): the per-step cost of a job long after
  its one attach, FLOPs looked up by shape (the live exchange stopped after step 10: with the console line off
  and no monitor nothing reads it, docs/live_metrics.md; bench_live.py measures it with a sink);
* the second step after ``attach`` (the figure printed before: still part of the attach's warm-up);
* the first step after ``attach``: it pays the FLOP count of the new input shape (every operator of that
  micro step through ``FlopCounterMode``'s Python dispatch) and the file's opening -- once per shape per
  attach in a job, printed without a target; the counting attempts say the count was taken once.
"""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

# benchmarks/ is the script's own folder
from bench_engines import attach_turns, mlp_engine, ranks_figures, turns_and_runs_main

STEP_TARGET = 1.02


def worker(out: Path, turns: int) -> None:
    from ds_profutils import attach

    engine, batch, rank, config = mlp_engine({"stage": 2}, step_metrics={
        "enabled": True, "output_dir": str(out / "records"), "console": False})
    configs = {"off": {**config, "step_metrics": {"enabled": False}}, "on": config,
               "on, no memory": {**config, "step_metrics": {**config["step_metrics"], "memory": False}}}
    attempts, cpu_seconds, steady = [], {}, {}
    seconds, first_steps = attach_turns(
        engine, batch, turns, {mode: lambda mode=mode: attach(engine, config=configs[mode]) for mode in configs},
        before_close=lambda attachment: attempts.append(attachment.recorder.flops.counting_attempts),
        cpu_seconds=cpu_seconds, steady=steady)
    figures = {"seconds": seconds, "first_steps": first_steps, "cpu": cpu_seconds, "steady": steady,
               "counting_attempts": sorted(set(attempts))}
    (out / f"rank_{rank}.json").write_text(json.dumps(figures))
    import torch.distributed

    torch.distributed.destroy_process_group()  # the documented shutdown, last


def one_run(turns: int) -> dict:
    """One launcher job of ``turns`` turns: its result files by rank."""
    return ranks_figures(Path(__file__), ["--turns", str(turns)], timeout=120 + 12 * turns)


def _ratio(seconds: dict, mode: str) -> float:
    """Median over the turns of ``mode``'s time over off's."""
    return statistics.median(b / a for a, b in zip(seconds["off"], seconds[mode]))


def _rank_lines(rank: int, result: dict) -> dict:
    """Print one rank's figures; returns its on/off ratios: "second" (the second step after attach), "steady"."""
    seconds, first_steps, cpu, steady = result["seconds"], result["first_steps"], result["cpu"], result["steady"]
    ratios = {"second": _ratio(seconds, "on"), "steady": _ratio(steady["wall"], "on")}
    print(f"    rank {rank}: off {statistics.median(seconds['off']) * 1e3:6.2f} ms a step; first step after attach "
          f"(counts the shape's FLOPs) {_ratio(first_steps, 'on'):5.3f}x, FLOP counting attempts per attach "
          f"{result['counting_attempts']}")
    for label, wall, thread in (("second step after attach", seconds, cpu),
                                ("steps 11-20 after attach", steady["wall"], steady["cpu"])):
        added_us = (statistics.median(thread["on"]) - statistics.median(thread["off"])) * 1e6
        print(f"      {label}: on/off {_ratio(wall, 'on'):5.3f}x, without memory figures "
              f"{_ratio(wall, 'on, no memory'):5.3f}x; CPU time of the training thread {_ratio(thread, 'on'):5.3f}x "
              f"({added_us:+.0f} us a step, off {statistics.median(thread['off']) * 1e3:.2f} ms)")
    return ratios


def bench(turns: int, runs: int) -> float:
    """``runs`` launcher jobs; each run's figure is its worst rank's median ratio, the verdict their median."""
    print(f"ZeRO-2 training step, 2 ranks (gloo, CPU), {turns} interleaved turns of off / step_metrics on / "
          f"on without memory figures, per run")
    figures: dict = {"second": [], "steady": []}
    for run in range(runs):
        load_before = os.getloadavg()[0]
        results = one_run(turns)
        print(f"  run {run + 1} (load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, "
              f"{os.cpu_count()} CPUs)")
        ranks = [_rank_lines(rank, result) for rank, result in results.items()]
        for kind, values in figures.items():
            values.append(max(ratios[kind] for ratios in ranks))
    for kind, label in (("second", "the second step after attach"), ("steady", "steps 11-20 after attach")):
        verdict = statistics.median(figures[kind])
        print(f"step_metrics on against off, {label}, worst rank of each run: "
              f"{' / '.join(f'{f:.3f}' for f in figures[kind])}; median {verdict:.3f}x  "
              f"(target <= {STEP_TARGET}x: {'ok' if verdict <= STEP_TARGET else 'OVER TARGET'})")
    return statistics.median(figures["steady"])


def main() -> None:
    turns_and_runs_main(__doc__.splitlines()[0], worker, bench, "the three modes")


if __name__ == "__main__":
    main()
