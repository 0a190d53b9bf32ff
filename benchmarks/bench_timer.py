"""A training step's use of the timers with ``wall_clock_breakdown``, ours against DeepSpeed's, and memory
over a long run without reads.

Run: ``python benchmarks/bench_timer.py [--runs 3] [--turns 401]`` (CPU is fine: both use host timers there).

What is measured is everything DeepSpeed 0.19's engine does with its timer group in one step when
``wall_clock_breakdown`` is on (``runtime/engine.py``), in its order:

* its ten timers (micro and global, for forward, backward, backward inner, allreduce and step) started
  and stopped through ``_start_timers``/``_stop_timers``: each looked up by name (``self.timers(name)``),
  micro and global together, backward's pair open around the inner and allreduce pairs, ``stop(record=...)``;
* ``_update_wall_clock_timers``: ``elapsed(reset=False)`` of all ten;
* ``self.timers.log(names=micro_timers, memory_breakdown=...)`` and ``self.timers.log(global_timers)``:
  each reads its five timers with reset and prints its line through ``print_dist`` (the rank asked of
  ``deepspeed.comm``, the line formatted and printed).

The world is one gloo rank (``deepspeed.init_distributed``), so each log pays the rank lookup an engine's
log pays; the printed lines go to ``os.devnull`` (stdout redirected: what the engine prints, written and
thrown away; a terminal or a file costs both sides the same more).  The garbage collector is on
(``timeit`` turns it off; a training job does not); each turn makes a fresh timer group per side and
times ``--steps`` steps on it (short, so that on a shared machine most turns run undisturbed), in the
thread's CPU time (a turn waiting for a CPU says nothing about either timer).  Ours and DeepSpeed's
alternate, the order flipping each turn.

DESIGN.md's protocol: a run's figure is the median of the per-turn ratios ours/DeepSpeed's over
``--turns`` (>= 200) turns; the target (<= 0.9x) is met when the median of ``--runs`` (3) runs' figures
meets it; every run's figure is printed.  The ratio of the two sides' lower deciles, less sensitive to
other processes, is printed beside each.

The long run (no target, shown for what it costs) times the start/stop part alone on one group per side
never read, each turn ``FOLD_EVERY`` steps (every turn of ours pays one fold of its pending durations per
timer into the bounded sample; DeepSpeed's lists keep growing); the memory figure is traced over
``--memory-steps`` steps without reads.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import socket
import statistics
import time
import tracemalloc
from typing import Any, Callable, Dict, List

from deepspeed.utils import timer as deepspeed_timer

from ds_profutils._stats import FOLD_EVERY
from ds_profutils.timer import SynchronizedWallClockTimer as OurTimers

GROUPS: Dict[str, Callable[[], Any]] = {
    "deepspeed": deepspeed_timer.SynchronizedWallClockTimer,
    "ds_profutils": OurTimers,
}
# (micro, global) per phase: the lists of DeepSpeed's EngineTimers with wall_clock_breakdown.
FORWARD, BACKWARD, BACKWARD_INNER, BACKWARD_REDUCE, STEP = PHASES = [
    [deepspeed_timer.FORWARD_MICRO_TIMER, deepspeed_timer.FORWARD_GLOBAL_TIMER],
    [deepspeed_timer.BACKWARD_MICRO_TIMER, deepspeed_timer.BACKWARD_GLOBAL_TIMER],
    [deepspeed_timer.BACKWARD_INNER_MICRO_TIMER, deepspeed_timer.BACKWARD_INNER_GLOBAL_TIMER],
    [deepspeed_timer.BACKWARD_REDUCE_MICRO_TIMER, deepspeed_timer.BACKWARD_REDUCE_GLOBAL_TIMER],
    [deepspeed_timer.STEP_MICRO_TIMER, deepspeed_timer.STEP_GLOBAL_TIMER],
]
MICRO_TIMERS = [micro for micro, _ in PHASES]
GLOBAL_TIMERS = [whole for _, whole in PHASES]
ACTIVE_TIMERS = MICRO_TIMERS + GLOBAL_TIMERS  # EngineTimers.active_timers()
TIMERS_PER_STEP = len(ACTIVE_TIMERS)
TARGET_RATIO = 0.9


def _start_timers(timers: Any, names: List[str]) -> None:
    for name in names:
        timers(name).start()


def _stop_timers(timers: Any, names: List[str]) -> None:
    for name in names:
        timers(name).stop(record=False)


def timed_regions(timers: Any) -> None:
    """The starts and stops of one step: forward(), backward() (inner and allreduce inside it), step()."""
    _start_timers(timers, FORWARD)
    _stop_timers(timers, FORWARD)
    _start_timers(timers, BACKWARD)
    _start_timers(timers, BACKWARD_INNER)
    _stop_timers(timers, BACKWARD_INNER)
    _start_timers(timers, BACKWARD_REDUCE)
    _stop_timers(timers, BACKWARD_REDUCE)
    _stop_timers(timers, BACKWARD)
    _start_timers(timers, STEP)
    _stop_timers(timers, STEP)


def engine_step(timers: Any) -> None:
    """What the engine does with its timers in one step (gradient accumulation boundary, no monitor)."""
    timed_regions(timers)
    cache = {}  # _update_wall_clock_timers
    for name in ACTIVE_TIMERS:
        cache[name] = timers(name).elapsed(reset=False)
    timers.log(names=MICRO_TIMERS, memory_breakdown=False)
    timers.log(GLOBAL_TIMERS)


def cpu_ns(step: Callable[[Any], None], timers: Any, steps: int) -> int:
    """CPU nanoseconds of this thread for ``steps`` calls of ``step(timers)``."""
    began = time.thread_time_ns()
    for _ in range(steps):
        step(timers)
    return time.thread_time_ns() - began


def interleaved(step: Callable[[Any], None], steps: int, turns: int, fresh: bool) -> Dict[str, List[float]]:
    """ns per step for each group, per turn, the two sides alternating (order flipped each turn)."""
    gc.enable()
    kept = {name: make() for name, make in GROUPS.items()}
    samples: Dict[str, List[float]] = {name: [] for name in GROUPS}
    names = list(GROUPS)
    for turn in range(turns):
        for name in (names if turn % 2 == 0 else names[::-1]):
            timers = GROUPS[name]() if fresh else kept[name]
            samples[name].append(cpu_ns(step, timers, steps) / steps)
    return samples


def memory_growth(make: Callable[[], Any], steps: int) -> Dict[str, int]:
    """Bytes traced after half of ``steps`` steps of starts and stops and after all, no timer read in between
    (ours holds a full sample of ``SAMPLE_SIZE`` durations per timer from then on: the default passes it)."""
    timers = make()
    timed_regions(timers)  # the timers exist before the count starts
    checkpoints = {steps // 2: "after_half", steps: "after_all"}
    result = {}
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for done in range(1, steps + 1):
        timed_regions(timers)
        if done in checkpoints:
            result[checkpoints[done]] = tracemalloc.get_traced_memory()[0] - base
    result["peak"] = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return result


def one_rank_world() -> None:
    """A world of one gloo rank, as an engine's, so that each ``log()`` pays the rank lookup."""
    import deepspeed

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def report_case(label: str, samples: Dict[str, List[float]]) -> float:
    """Print one case's figures; returns the median of the per-turn ratios ours/DeepSpeed's."""
    for name, values in samples.items():
        print(f"{label}  {name:<16}{min(values):>9.0f}{_decile(values):>9.0f}{statistics.median(values):>11.0f}")
        label = " " * len(label)
    paired = statistics.median(o / d for o, d in zip(samples["ds_profutils"], samples["deepspeed"]))
    deciles = _decile(samples["ds_profutils"]) / _decile(samples["deepspeed"])
    print(f"{label}  ours/deepspeed: {paired:.3f} median of per-turn ratios; {deciles:.3f} ratio of the lower deciles")
    return paired


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of the engine case (the verdict: their median)")
    parser.add_argument("--turns", type=int, default=401, help="interleaved turns per run (>= 200)")
    parser.add_argument("--steps", type=int, default=20, help="engine steps per turn, on a fresh timer group")
    parser.add_argument("--long-turns", type=int, default=21, help="turns of the long-run case")
    parser.add_argument("--memory-steps", type=int, default=20_000)
    args = parser.parse_args()
    one_rank_world()
    import torch.distributed

    print(f"a step's timer use as DeepSpeed's engine makes it with wall_clock_breakdown: {TIMERS_PER_STEP} timers "
          f"started and stopped by name, read (elapsed(reset=False)) and logged with reset (two log() lines, "
          f"to os.devnull), gc on; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'case':<26}  {'timer':<16}{'min ns':>9}{'q10 ns':>9}{'median ns':>11}   per step")
    ratios = []
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        cases = [(f"engine, run {run + 1}", engine_step, True, args.turns, args.steps) for run in range(args.runs)]
        cases.append(("long run, start/stop only", timed_regions, False, args.long_turns, FOLD_EVERY))
        measured = [(label, interleaved(step, steps, turns, fresh)) for label, step, fresh, turns, steps in cases]
    for label, samples in measured:
        ratios.append(report_case(f"{label:<26}", samples))
    verdict = statistics.median(ratios[:args.runs])
    print(f"engine: {args.runs} runs of {args.turns} turns x {args.steps} steps: "
          f"{' / '.join(f'{ratio:.3f}' for ratio in ratios[:args.runs])}; median {verdict:.3f}x "
          f"(target <= {TARGET_RATIO}x: {'ok' if verdict <= TARGET_RATIO else 'OVER TARGET'}); "
          f"load average now {os.getloadavg()[0]:.1f}")

    print()
    print(f"memory traced by tracemalloc over {args.memory_steps} steps of starts and stops ({TIMERS_PER_STEP} "
          f"timers), no reads")
    print(f"{'timer':<14}{'after 50%':>14}{'after 100%':>14}{'peak':>14}")
    for name, make in GROUPS.items():
        grown = memory_growth(make, args.memory_steps)
        print(f"{name:<14}{grown['after_half']:>12,} B{grown['after_all']:>12,} B{grown['peak']:>12,} B")
    torch.distributed.destroy_process_group()


def _decile(values: List[float]) -> float:
    """The lower decile: what a turn costs when other processes leave it mostly alone."""
    return statistics.quantiles(values, n=10)[0]


if __name__ == "__main__":
    main()
