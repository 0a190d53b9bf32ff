"""Cost of ``timers(name).start()/stop()`` as DeepSpeed's engine calls it, ours against DeepSpeed's,
and memory over a long run without reads.

Run: ``python benchmarks/bench_timer.py`` (CPU is fine: both use host timers there).

What is measured is what a training step pays with ``wall_clock_breakdown`` on: the engine's ten
timers (micro and global, for forward, backward, backward inner, allreduce and step), each looked up
by name through the group for every call (``self.timers(name).start()``, as ``_start_timers`` and
``_stop_timers`` do), micro and global started together and stopped together, with the garbage
collector on (``timeit`` turns it off; a training job does not).  No timer is reset or read: the
engine's ``log()`` does that at most once a step, and between two logs durations only pile up.

Two cases, ours and DeepSpeed's interleaved (the order flips each repeat, so load that drifts over the
run hits both alike):

* engine: a new timer group each repeat of ``--steps`` steps (short, so that on a shared machine most
  repeats run undisturbed).  This is the engine's case: DeepSpeed 0.19's engine has real timers only
  with ``wall_clock_breakdown`` (or the flops profiler, for the global ones) and then its ``log()``
  reads and resets them every step, as ZeRO's optimizers do theirs, so no timer holds more than a few
  durations;
* long run (no target, shown for what it costs): one group per side for the whole run, never read,
  each repeat ``FOLD_EVERY`` steps, so every repeat of ours pays exactly one fold of its pending
  durations per timer (past the first ``SAMPLE_SIZE``, into the reservoir, whose turnover costs most
  just after it fills and falls as 1/n), and DeepSpeed's lists keep growing.

The verdict is the median of the per-repeat ratios ours/DeepSpeed's in the engine's case (DESIGN.md:
at most 0.9x with the garbage collector on, with memory that does not grow with the steps).  Each repeat is timed in the thread's CPU time.  What other processes still add (caches,
interrupts) pulls that median towards 1; the ratio of the two sides' lower deciles, less sensitive to
it, is printed beside it.
"""
from __future__ import annotations

import argparse
import gc
import os
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
# (micro, global) per phase, in the order DeepSpeed's EngineTimers lists them.
PHASES = [
    (deepspeed_timer.FORWARD_MICRO_TIMER, deepspeed_timer.FORWARD_GLOBAL_TIMER),
    (deepspeed_timer.BACKWARD_MICRO_TIMER, deepspeed_timer.BACKWARD_GLOBAL_TIMER),
    (deepspeed_timer.BACKWARD_INNER_MICRO_TIMER, deepspeed_timer.BACKWARD_INNER_GLOBAL_TIMER),
    (deepspeed_timer.BACKWARD_REDUCE_MICRO_TIMER, deepspeed_timer.BACKWARD_REDUCE_GLOBAL_TIMER),
    (deepspeed_timer.STEP_MICRO_TIMER, deepspeed_timer.STEP_GLOBAL_TIMER),
]
PAIRS_PER_STEP = 2 * len(PHASES)
TARGET_RATIO = 0.9


def engine_steps(timers: Any, steps: int) -> int:
    """CPU nanoseconds of this thread for ``steps`` steps of the engine's timer calls on ``timers``.

    CPU time rather than wall time: on a shared machine a repeat may wait for a CPU for longer than it
    runs, and that wait says nothing about either timer."""
    began = time.thread_time_ns()
    for _ in range(steps):
        for micro, whole in PHASES:
            timers(micro).start()
            timers(whole).start()
            timers(micro).stop()
            timers(whole).stop()
    return time.thread_time_ns() - began


def per_pair_ns(steps: int, repeats: int, fresh: bool) -> Dict[str, List[float]]:
    """ns per start+stop pair for each group, per repeat, interleaved."""
    gc.enable()
    kept = {name: make() for name, make in GROUPS.items()}
    samples: Dict[str, List[float]] = {name: [] for name in GROUPS}
    names = list(GROUPS)
    for repeat in range(repeats):
        for name in (names if repeat % 2 == 0 else names[::-1]):
            timers = GROUPS[name]() if fresh else kept[name]
            samples[name].append(engine_steps(timers, steps) / (steps * PAIRS_PER_STEP))
    return samples


def memory_growth(make: Callable[[], Any], steps: int) -> Dict[str, int]:
    """Bytes traced after half of ``steps`` engine steps and after all, no timer read in between (ours holds
    a full sample of ``SAMPLE_SIZE`` durations per timer from then on: the default ``steps`` passes it)."""
    timers = make()
    engine_steps(timers, 1)  # the timers exist before the count starts
    checkpoints = {steps // 2: "after_half", steps: "after_all"}
    result = {}
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for done in range(1, steps + 1):
        engine_steps(timers, 1)
        if done in checkpoints:
            result[checkpoints[done]] = tracemalloc.get_traced_memory()[0] - base
    result["peak"] = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="engine steps per repeat, engine case (10 pairs each)")
    parser.add_argument("--repeats", type=int, default=401, help="repeats of the engine case")
    parser.add_argument("--long-repeats", type=int, default=21, help="repeats of the long-run case")
    parser.add_argument("--memory-steps", type=int, default=20_000)
    args = parser.parse_args()

    print(f"timers(name).start()/stop() as the engine calls them: {PAIRS_PER_STEP} timers by name per step, "
          f"gc on, no resets; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'case':<10}{'repeats x steps':>16}  {'timer':<16}{'min ns':>8}{'q10 ns':>8}{'median ns':>11}"
          "   per start+stop pair")
    for case, fresh, repeats, steps in (("engine", True, args.repeats, args.steps),
                                        ("long run", False, args.long_repeats, FOLD_EVERY)):
        samples = per_pair_ns(steps, repeats, fresh)
        label = f"{case:<10}{f'{repeats} x {steps}':>16}"
        for name, values in samples.items():
            print(f"{label}  {name:<16}{min(values):>8.0f}{_decile(values):>8.0f}{statistics.median(values):>11.0f}")
            label = " " * 26
        paired = statistics.median(o / d for o, d in zip(samples["ds_profutils"], samples["deepspeed"]))
        deciles = _decile(samples["ds_profutils"]) / _decile(samples["deepspeed"])
        verdict = "no target"
        if fresh:
            verdict = f"target <= {TARGET_RATIO}: " + ("ok" if paired <= TARGET_RATIO else "OVER TARGET")
        print(f"{label}  ours/deepspeed: {paired:.2f} median of per-repeat ratios ({verdict}); "
              f"{deciles:.2f} ratio of the lower deciles")

    print()
    print(f"memory traced by tracemalloc over {args.memory_steps} engine steps ({PAIRS_PER_STEP} timers), no reads")
    print(f"{'timer':<14}{'after 50%':>14}{'after 100%':>14}{'peak':>14}")
    for name, make in GROUPS.items():
        grown = memory_growth(make, args.memory_steps)
        print(f"{name:<14}{grown['after_half']:>12,} B{grown['after_all']:>12,} B{grown['peak']:>12,} B")


def _decile(values: List[float]) -> float:
    """The lower decile: what a repeat costs when other processes leave it mostly alone."""
    return statistics.quantiles(values, n=10)[0]


if __name__ == "__main__":
    main()
