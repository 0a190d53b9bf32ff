"""ZeRO-3 fetch profiling, measured against DeepSpeed in one run.

    python benchmarks/bench_zero_fetch.py [--repeats 61] [--steps 10] [--modules 40] [--step-pairs 300]
                                          [--skip-train]

(a) ``start_event`` + ``stop_event`` as DeepSpeed 0.19's engine calls them, added cost per pair over the
    same calls on empty methods, garbage collector on.  Per fetched module the coordinator's
    ``_fetch_sub_module_impl`` (its trace complete) opens and closes the fetch wait, then the prefetch
    submit with ``__all_gather_params_``'s all-gather inside; each forward's ``reset_step`` calls
    ``reset_events()`` (and ``log_events()``, left out on both sides: ``attach`` lets it through on
    print steps only).  Each repeat makes a new profiler and timer group, as an engine does, and runs
    ``--steps`` steps (``attach`` reads the timers every ``steps_per_print``); nothing is reset that
    the engine would not reset.  Ours enabled driving ds_profutils' timers (as ``attach`` drives the
    engine's) against DeepSpeed's with DeepSpeed's ``SynchronizedWallClockTimer`` (target <= 0.5x);
    ours given DeepSpeed's timers against DeepSpeed's (<= 1.0x); disabled, whole call against
    DeepSpeed's disabled one (<= 1.0x; both add ~0 over empty calls, so the ratio of the whole calls
    is the meaningful one).  Thread CPU time, medians of interleaved repeats (each candidate in every
    position in turn), so a noisy neighbour hits all sides alike.
(b) Memory over 200k events (tracemalloc), ours and DeepSpeed's: ours must not grow.
(c) A ZeRO-3 training step (2 ranks under the deepspeed launcher, gloo on CPU) with fetch records
    on (``attach`` before two steps, ``close`` after them) against off, interleaved, in three modes:
    off, records with memory figures (the default), records without (``memory: false``): the median
    over adjacent steps of the ratio of the second steps' times, per rank (target <= 1.03x for
    records with memory figures against off; memory on against off is printed too).  The garbage
    ``attach`` and ``close`` leave is collected untimed, before every mode's steps.  The first step
    after ``attach`` carries one-off costs a job pays once (the recorder's first record); its ratio is
    printed too, without a target.

The report on these records and the trace summary are measured in ``bench_report.py``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable, Dict, List

from bench_engines import attach_turns, mlp_engine, ranks_figures  # benchmarks/ is the script's own folder

from deepspeed.runtime.zero.partitioned_param_profiler import PartitionedParameterProfiler as DeepSpeedProfiler
from deepspeed.utils.timer import SynchronizedWallClockTimer

from ds_profutils.outputs import fetch_records_file
from ds_profutils.timer import SynchronizedWallClockTimer as OurTimers
from ds_profutils.zero3 import PartitionedParameterProfiler

ENABLED_TARGET, GIVEN_TARGET, DISABLED_TARGET, STEP_TARGET = 0.5, 1.0, 1.0, 1.03
EVENT = "forward_fetch_wait"


class EmptyCalls:
    """The floor: the same method calls, doing nothing."""

    def start_event(self, name: str) -> None:
        pass

    def stop_event(self, name: str, num_elem: int) -> None:
        pass

    def reset_events(self) -> None:
        pass


# Per fetched module, what DeepSpeed 0.19's coordinator calls on its profiler once its trace is complete
# (``_fetch_sub_module_impl``): the wait for the module's parameters, then the prefetch submit of the next
# ones, inside which ``__all_gather_params_`` brackets the all-gather launch.
FORWARD = ("forward_fetch_wait", "forward_prefetch_submit", "forward_all_gather")
BACKWARD = ("backward_fetch_wait", "backward_prefetch_submit", "backward_all_gather")
PAIRS_PER_MODULE = 3


def one_step(profiler: Any, modules: int) -> None:
    """One forward and backward of ``modules`` fetched submodules each, as the engine drives its profiler.

    ``reset_step`` (the next forward's start) calls ``log_events()`` then ``reset_events()``; the log is
    left out on both sides (``attach`` lets it through on print steps only), the reset is in."""
    profiler.reset_events()
    for wait, submit, gather in (FORWARD, BACKWARD):
        for _ in range(modules):
            profiler.start_event(wait)
            profiler.stop_event(wait, 4096)
            profiler.start_event(submit)
            profiler.start_event(gather)
            profiler.stop_event(gather, 4096)
            profiler.stop_event(submit, 4096)


CANDIDATES: Dict[str, Callable[[], Any]] = {
    "empty calls": EmptyCalls,
    "deepspeed, enabled": lambda: DeepSpeedProfiler(SynchronizedWallClockTimer()),
    "ds_profutils, enabled": lambda: PartitionedParameterProfiler(OurTimers(), element_size=2, device_events=None),
    "ds_profutils, deepspeed timers": lambda: PartitionedParameterProfiler(SynchronizedWallClockTimer(),
                                                                           element_size=2, device_events=None),
    "deepspeed, disabled": lambda: DeepSpeedProfiler(None),
    "ds_profutils, disabled": lambda: PartitionedParameterProfiler(None, device_events=None),
}


def repeat_ns(make: Callable[[], Any], steps: int, modules: int) -> float:
    """Thread CPU ns per start+stop pair over ``steps`` steps of a new profiler (and timer group), as an
    engine makes them.  CPU time: on a shared machine a repeat may wait for a CPU longer than it runs."""
    profiler = make()
    began = time.thread_time_ns()
    for _ in range(steps):
        one_step(profiler, modules)
    return (time.thread_time_ns() - began) / (steps * 2 * modules * PAIRS_PER_MODULE)


def bench_hot_path(repeats: int, steps: int, modules: int) -> Dict[str, float]:
    gc.enable()  # a training job runs with the garbage collector on
    samples: Dict[str, List[float]] = {name: [] for name in CANDIDATES}
    names = list(CANDIDATES)
    for turn in range(repeats):
        shift = turn % len(names)
        for name in names[shift:] + names[:shift]:  # each candidate in every position in turn
            samples[name].append(repeat_ns(CANDIDATES[name], steps, modules))
    ns = {name: statistics.median(values) for name, values in samples.items()}
    floor = ns["empty calls"]
    added = {name: value - floor for name, value in ns.items()}
    print(f"(a) start_event + stop_event as the engine calls them, thread CPU ns per pair, gc on, median of {repeats} "
          f"interleaved repeats, each a new profiler and timer group for {steps} steps of {modules} fetched modules "
          f"forward and backward ({PAIRS_PER_MODULE} events each: wait, prefetch submit, all-gather), "
          f"reset_events() every forward; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for name, value in ns.items():
        print(f"    {name:32s} {value:8.1f} ns   added over empty calls {added[name]:8.1f} ns")
    enabled = added["ds_profutils, enabled"] / added["deepspeed, enabled"]
    given = added["ds_profutils, deepspeed timers"] / added["deepspeed, enabled"]
    disabled = ns["ds_profutils, disabled"] / ns["deepspeed, disabled"]
    verdicts = (("enabled with our timers, added cost", enabled, ENABLED_TARGET, ""),
                ("enabled with DeepSpeed's timers, added cost", given, GIVEN_TARGET, ""),
                ("disabled, whole call", disabled, DISABLED_TARGET, "; the same test as DeepSpeed's "
                 "`if self.timers is None: return`, so equal within noise"))
    for what, ratio, target, note in verdicts:
        print(f"    {what + ' vs DeepSpeed:':58s} {ratio:5.2f}x  (target <= {target}x{note})")
    return {"enabled_ratio": enabled, "given_ratio": given, "disabled_ratio": disabled}


def memory_growth(profiler: Any, events: int) -> Dict[str, int]:
    """Bytes traced after 10% of ``events`` start+stop pairs and after all, never logging in between."""
    profiler.start_event(EVENT)
    profiler.stop_event(EVENT, 1)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    result = {}
    for done in range(1, events + 1):
        profiler.start_event(EVENT)
        profiler.stop_event(EVENT, 4096)
        if done == events // 10:
            result["after 10%"] = tracemalloc.get_traced_memory()[0] - base
    result["after all"] = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return result


def bench_memory(events: int) -> None:
    print(f"(b) memory traced over {events:,} events (bytes)")
    for name, profiler in (("deepspeed", DeepSpeedProfiler(SynchronizedWallClockTimer())),
                           ("ds_profutils", PartitionedParameterProfiler(OurTimers(), device_events=None))):
        growth = memory_growth(profiler, events)
        print(f"    {name:14s} after 10%: {growth['after 10%']:>10,}   after all: {growth['after all']:>10,}")


# ---------------------------------------------------------------------------------------------------
# (c) a ZeRO-3 training step, on vs off; the part below --worker runs on each rank under the launcher
# ---------------------------------------------------------------------------------------------------


def worker(out: Path, pairs: int) -> None:
    from ds_profutils import attach

    engine, batch, rank, _ = mlp_engine({"stage": 3, "stage3_param_persistence_threshold": 0},
                                     partitioned_param_profiler={"enabled": True, "output_dir": str(out / "records")})
    seconds, first_steps = attach_turns(engine, batch, pairs, {
        "off": lambda: None, "on": lambda: attach(engine, memory=True),
        "on, no memory": lambda: attach(engine, memory=False)})
    last_record = fetch_records_file(out / "records", rank).read_text().splitlines()[-1]
    events = sum(event["count"] for event in json.loads(last_record)["events"].values())
    (out / f"rank_{rank}.json").write_text(
        json.dumps({"seconds": seconds, "first_steps": first_steps, "events_per_step": events}))


def bench_training_step(pairs: int) -> float:
    load_before = os.getloadavg()[0]
    results = ranks_figures(Path(__file__), ["--step-pairs", str(pairs)], timeout=900)
    print(f"(c) ZeRO-3 training step, 2 ranks, {pairs} interleaved turns of off / records / records without memory; "
          f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs")
    worst = 0.0
    for rank, result in results.items():
        seconds, first_steps = result["seconds"], result["first_steps"]
        off, on, bare = seconds["off"], seconds["on"], seconds["on, no memory"]
        # compared within each turn of adjacent steps, so load from a neighbour that comes and goes hits
        # every mode of a turn alike.
        ratio = statistics.median(b / a for a, b in zip(off, on))
        memory = statistics.median(b / a for a, b in zip(bare, on))
        first = statistics.median(b / a for a, b in zip(first_steps["off"], first_steps["on"]))
        worst = max(worst, ratio)
        print(f"    rank {rank}: off {statistics.median(off) * 1e3:7.2f} ms   records {statistics.median(on) * 1e3:7.2f}"
              f" ms   on/off {ratio:5.3f}x   memory figures on/off {memory:5.3f}x   "
              f"({result['events_per_step']} fetch events per step; first step after attach {first:5.3f}x)")
    print(f"    worst rank, records with memory figures against off: {worst:5.3f}x  (target <= {STEP_TARGET}x)")
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=61, help="(a) interleaved repeats")
    parser.add_argument("--steps", type=int, default=10,
                        help="(a) steps per repeat (attach reads the timers every steps_per_print, 10 by default)")
    parser.add_argument("--modules", type=int, default=40, help="(a) fetched submodules per forward and backward")
    parser.add_argument("--memory-events", type=int, default=200_000)
    parser.add_argument("--step-pairs", type=int, default=300, help="(c) interleaved turns of the three modes")
    parser.add_argument("--skip-train", action="store_true", help="skip (c), the launcher run")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.step_pairs)
        return
    bench_hot_path(args.repeats, args.steps, args.modules)
    bench_memory(args.memory_events)
    if not args.skip_train:
        bench_training_step(args.step_pairs)


if __name__ == "__main__":
    main()
