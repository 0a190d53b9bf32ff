"""What ``@profiler`` costs where it should cost nothing, measured in one run.

    python benchmarks/bench_profiler.py [--step-us 10] [--steps 300] [--calls 20000] [--repeats 301]

(a) Training steps outside the active window: a loop of CPU steps of about ``--step-us`` µs, each
    followed by ``step_profiler()``, inside a profiled call whose window never comes, against the
    same loop with no profiler (``step_profiler()`` idle) and against the loop without the call.
    Target (DESIGN.md): at most 1.02x the unprofiled loop, even for 10 µs steps.  Since that
    difference is near the noise of a shared machine, the added cost of ``step_profiler()`` while
    counting is also measured alone, as ns per call and as a share of one step.
(b) ``step_profiler()`` with no profiler running against a plain Python function call, each net of
    the loop around the calls.  With no run, ``step_profiler()`` is a None test; target: not
    measurable in a training loop, i.e. at most 0.5% of a ``--step-us`` step added.

Candidates run interleaved (order rotated every repeat), and each ratio is the median over repeats
of the ratio within one repeat: on a shared machine the speed drifts by several times within
seconds, and only candidates measured side by side see the same machine.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from typing import Callable, Dict, List, Optional

import ds_profutils
from ds_profutils import profiler, step_profiler

STEP_TARGET = 1.02
IDLE_SHARE_TARGET = 0.5  # % of one step

Samples = Dict[str, List[float]]


def interleaved_samples(candidates: Dict[str, Callable[[], float]], repeats: int) -> Samples:
    """Seconds of every candidate in every repeat, in a rotated order so none always runs first; the garbage
    collector on, as in a training job (a collection lands on whichever candidate runs, and the medians over
    repeats keep the ratios)."""
    samples: Samples = {name: [] for name in candidates}
    names = list(candidates)
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(candidates[name]())
    return samples


def paired_ratio(samples: Samples, ours: str, baseline: str, minus: Optional[str] = None) -> float:
    """Median over repeats of ours/baseline within a repeat, each less ``minus`` (an empty loop) if given."""
    floor = samples[minus] if minus else [0.0] * len(samples[ours])
    return statistics.median(
        (a - f) / (b - f) for a, b, f in zip(samples[ours], samples[baseline], floor))


def verdict(ratio: float, target: float) -> str:
    return f"{ratio:7.4f}   (target <= {target}: {'ok' if ratio <= target else 'OVER TARGET'})"


def calibrated_step(step_us: float) -> Callable[[], int]:
    """A CPU-bound step of about ``step_us`` microseconds (pure Python, nothing allocated to speak of).

    Sized from the median of many timed steps, in three passes, so the step is ``step_us`` at the
    machine's typical speed while the benchmark runs.
    """
    items = 1000
    for _ in range(3):
        times = []
        for _ in range(301):
            began = time.perf_counter()
            sum(range(items))
            times.append(time.perf_counter() - began)
        items = max(1, round(items * step_us / (statistics.median(times) * 1e6)))
    return lambda: sum(range(items))


def steps_loop(step: Callable[[], int], steps: int, call_step_profiler: bool) -> float:
    """Seconds for ``steps`` steps, timed inside the function, so a profiled call's own start and
    end are not counted: they happen once per run, not per step."""
    began = time.perf_counter()
    if call_step_profiler:
        for _ in range(steps):
            step()
            step_profiler()
    else:
        for _ in range(steps):
            step()
    return time.perf_counter() - began


def calls_loop(fn: Callable[[], None], calls: int) -> float:
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - began


def empty_loop(calls: int) -> float:
    began = time.perf_counter()
    for _ in range(calls):
        pass
    return time.perf_counter() - began


def bench_outside_window(step_us: float, steps: int, repeats: int) -> None:
    step = calibrated_step(step_us)
    with tempfile.TemporaryDirectory() as output_dir:
        profiled = profiler(output_dir=output_dir, skip_first=10**9)(steps_loop)  # the window never comes
        samples = interleaved_samples(
            {
                "bare": lambda: steps_loop(step, steps, False),
                "unprofiled": lambda: steps_loop(step, steps, True),
                "profiled": lambda: profiled(step, steps, True),
            }, repeats)
        # The same difference without the steps around it: step_profiler() counting vs idle.
        counting = profiler(output_dir=output_dir, skip_first=10**9)(calls_loop)
        calls = interleaved_samples(
            {
                "idle": lambda: calls_loop(step_profiler, steps * 10),
                "counting": lambda: counting(step_profiler, steps * 10),
            }, repeats)
    us = {name: statistics.median(values) / steps * 1e6 for name, values in samples.items()}
    added_ns = statistics.median(p - u for p, u in zip(samples["profiled"], samples["unprofiled"])) / steps * 1e9
    counting_ns = statistics.median(c - i for c, i in zip(calls["counting"], calls["idle"])) / (steps * 10) * 1e9
    print(f"(a) steps outside the active window: {repeats} interleaved repeats of {steps} steps "
          f"(median step {us['bare']:.2f} us; target length {step_us} us)")
    print(f"    bare loop, no step_profiler() call           {us['bare']:>7.3f} us/step")
    print(f"    unprofiled loop, step_profiler() idle        {us['unprofiled']:>7.3f} us/step")
    print(f"    profiled call, outside the window            {us['profiled']:>7.3f} us/step  "
          f"({added_ns:+.0f} ns/step over unprofiled)")
    ratio = paired_ratio(samples, "profiled", "unprofiled")
    print(f"    ratio vs unprofiled loop                     {verdict(ratio, STEP_TARGET)}")
    print(f"    ratio vs bare loop (for reference)           {paired_ratio(samples, 'profiled', 'bare'):7.4f}")
    print(f"    step_profiler() counting vs idle, alone      +{counting_ns:.0f} ns per call "
          f"= {counting_ns / (step_us * 10):.2f}% of a {step_us:g} us step")


def plain() -> None:
    pass


def plain_with_optional_argument(engine=None) -> None:
    pass


def bench_idle_step_profiler(calls: int, repeats: int, step_us: float) -> None:
    samples = interleaved_samples(
        {
            "empty loop": lambda: empty_loop(calls),
            "f()": lambda: calls_loop(plain, calls),
            "f(engine=None)": lambda: calls_loop(plain_with_optional_argument, calls),
            "step_profiler()": lambda: calls_loop(step_profiler, calls),
        }, repeats)
    ns = {name: statistics.median(values) / calls * 1e9 for name, values in samples.items()}
    print(f"(b) idle step_profiler(): {repeats} interleaved repeats of {calls} calls, "
          f"median ns per call net of the loop ({ns['empty loop']:.1f} ns)")
    print(f"    plain function, def f(): pass                {ns['f()'] - ns['empty loop']:>7.1f} ns")
    print(f"    plain function, def f(engine=None): pass     {ns['f(engine=None)'] - ns['empty loop']:>7.1f} ns")
    print(f"    step_profiler(), nothing running             {ns['step_profiler()'] - ns['empty loop']:>7.1f} ns")
    added_ns = statistics.median(s - f for s, f in zip(samples["step_profiler()"], samples["f(engine=None)"]))
    added_ns = added_ns / calls * 1e9
    share = added_ns / (step_us * 10)
    print(f"    added over f(engine=None)                    {added_ns:>+7.1f} ns = {share:.2f}% of a {step_us:g} us step "
          f"(target <= {IDLE_SHARE_TARGET}%: {'ok' if share <= IDLE_SHARE_TARGET else 'OVER TARGET'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-us", type=float, default=10.0, help="length of one training step")
    parser.add_argument("--steps", type=int, default=300, help="steps per repeat in (a)")
    parser.add_argument("--calls", type=int, default=20_000, help="calls per repeat in (b)")
    parser.add_argument("--repeats", type=int, default=301)
    args = parser.parse_args()
    ds_profutils.logger.setLevel(logging.ERROR)  # each profiled repeat ends "before any active step"
    bench_outside_window(args.step_us, args.steps, args.repeats)
    print()
    bench_idle_step_profiler(args.calls, args.repeats, args.step_us)


if __name__ == "__main__":
    main()
