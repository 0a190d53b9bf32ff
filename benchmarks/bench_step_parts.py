"""Where ``step_metrics``' host time goes inside bench_step_metrics' ZeRO-2 job: each part timed in place.

    python benchmarks/bench_step_parts.py [--turns 300] [--runs 1]

The same engine and section as ``bench_step_metrics.py`` (2 ranks under the deepspeed launcher, gloo,
garbage collector on, ``console`` off), attached once; after 20 steps, ``--turns`` steps are timed with
``perf_counter_ns`` around each call ds_profutils gets from the engine:

* every listener call the engine's hooks make (``forward_started StepRecorder``, ``step_ended EngineWatch``,
  ...), and a listener that does nothing, hooked beside them: what the timing wrapper and a Python call cost
  there, the floor under every other line;
* every collective of ``deepspeed.comm``'s backend, timed below and above our wrapper: the wrapper's cost is
  the difference, and the same difference with no attachment (one plain wrapper layer) is its floor.

The step times it prints beside them are no ratio: "on" carries these timers on every listener call and runs
after "off" on the same engine (bench_step_metrics.py gives the interleaved ratio).

A ratio benchmark (bench_step_metrics.py) moves +-2% from run to run on this machine; these are medians of
hundreds of calls of each part in the job itself, where a part costs what it costs after the rest of the step
ran (a line of Python costs several times what it costs in a loop).  It reads the hooks' ``_told`` and
``_step_end`` tables (the listeners' bound methods per event) to put its timers in: a diagnostic of ours, not a
figure of the target.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from time import perf_counter_ns
from typing import Any, Callable, Dict, List

# benchmarks/ is the script's own folder
from bench_engines import mlp_engine, ranks_figures, turns_and_runs_main

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_gather", "reduce")
"""The collectives a ZeRO-2 step issues, and their like."""
WARM_STEPS = 20
Times = Dict[str, List[int]]


class _Timed:
    """A listener's bound method, timed into ``times[name]``; ``__self__`` kept (the hooks drop a failing
    listener by it)."""

    def __init__(self, name: str, method: Callable[..., None], times: Times) -> None:
        self.name, self.method, self.times, self.__self__ = name, method, times, method.__self__

    def __call__(self, *args: Any) -> None:
        began = perf_counter_ns()
        self.method(*args)
        self.times.setdefault(self.name, []).append(perf_counter_ns() - began)


def _do_nothing(self: Any, *args: Any) -> None:
    """A listener method that does nothing, but overrides the base's: the hooks call it."""


def _time_listeners(hooks: Any, times: Times) -> None:
    from ds_profutils.engine.hooks import Listener

    # hears the events the recorder hears (and optimizer_step_ended) and does nothing: the timer's own cost in place
    events = ("forward_started", "forward_ended", "backward_ended", "step_started", "step_ended",
              "optimizer_step_ended")
    hooks.add(type("Nothing", (Listener, ), dict.fromkeys(events, _do_nothing))())
    hooks._told = {event: [_Timed(f"{event} {type(told.__self__).__name__}", told, times) for told in told_list]
                   for event, told_list in hooks._told.items()}
    # a step's end is told per listener: its step_ended, then its optimizer_step_ended
    hooks._step_end = [(listener, *(None if told is None else _Timed(f"{event} {type(listener).__name__}", told, times)
                                    for event, told in zip(("step_ended", "optimizer_step_ended"), methods)))
                       for listener, *methods in hooks._step_end]


def _time_collectives(backend: Any, times: Times, where: str) -> None:
    """Wrap the backend's collectives (as they are now) with a timer into ``times["<op> <where>"]``."""
    for op in COLLECTIVES:
        method = getattr(backend, op, None)
        if method is None:
            continue

        def timed(*args: Any, _method: Callable[..., Any] = method, _name: str = f"{op} {where}",
                  **kwargs: Any) -> Any:
            began = perf_counter_ns()
            try:
                return _method(*args, **kwargs)
            finally:
                times.setdefault(_name, []).append(perf_counter_ns() - began)

        setattr(backend, op, timed)


def worker(out: Path, steps: int) -> None:
    import torch.distributed
    from deepspeed.comm import comm

    from ds_profutils import attach

    engine, batch, rank, config = mlp_engine({"stage": 2}, step_metrics={
        "enabled": True, "output_dir": str(out / "records"), "console": False})

    def run(count: int) -> List[int]:
        spans = []
        for _ in range(count):
            began = perf_counter_ns()
            engine.backward(engine(batch).pow(2).mean())
            engine.step()
            spans.append(perf_counter_ns() - began)
        return spans

    figures: Dict[str, Any] = {}
    for mode in ("off", "on"):
        times: Times = {}
        backend = comm.cdb
        before = dict(vars(backend))
        _time_collectives(backend, times, "below")
        attachment = attach(engine, config=config) if mode == "on" else None
        _time_collectives(backend, times, "above")
        if attachment is not None:
            _time_listeners(attachment.hooks, times)
            listeners = len(attachment.hooks.listeners)
        run(WARM_STEPS)
        times.clear()
        figures[f"step {mode}"] = run(steps)
        figures[mode] = times
        if attachment is not None:  # a listener dropped after an error would take its timers with it, unseen
            assert len(attachment.hooks.listeners) == listeners, "a listener stopped after an error"
            attachment.close()
        for op in COLLECTIVES:  # the backend as it was (ours went with close)
            vars(backend).pop(op, None)
        vars(backend).update({op: value for op, value in before.items() if op in COLLECTIVES})
    (out / f"rank_{rank}.json").write_text(json.dumps(figures))
    torch.distributed.destroy_process_group()  # the documented shutdown, last


def _wrapper_costs(times: Times) -> Dict[str, List[int]]:
    """Per collective op: each call's time above the wrapper less its time below it."""
    return {name[:-len(" above")]: [above - below for above, below in zip(times[name], times[name[:-5] + "below"])]
            for name in times if name.endswith(" above")}


def _rank_lines(rank: int, figures: Dict[str, Any], steps: int) -> None:
    median_us = lambda values: statistics.median(values) / 1e3  # noqa: E731
    print(f"  rank {rank}: step {median_us(figures['step off']):.0f} us off, "
          f"{median_us(figures['step on']):.0f} us on, timers included (medians of {steps}; no ratio: see the module doc)")
    floor = _wrapper_costs(figures["off"])
    for op, costs in sorted(_wrapper_costs(figures["on"]).items()):
        print(f"    collective {op:28s} {len(costs) / steps:4.1f} a step: ours {median_us(costs):6.2f} us a call "
              f"(one plain wrapper layer, no attach: {median_us(floor.get(op, [0])):.2f} us)")
    listeners = {name: values for name, values in figures["on"].items() if not name.endswith(("above", "below"))}
    total = 0.0
    for name, values in sorted(listeners.items(), key=lambda item: -sum(item[1])):
        per_step = sum(values) / steps / 1e3
        total += per_step if not name.endswith("Nothing") else 0.0
        print(f"    listener {name:37s} {len(values) / steps:4.1f} a step: {median_us(values):6.2f} us a call, "
              f"{per_step:6.2f} us a step")
    print(f"    listeners but Nothing, a step: {total:.0f} us")


def bench(steps: int, runs: int) -> None:
    print(f"ZeRO-2 training step, 2 ranks (gloo, CPU), step_metrics on (console off): each part timed in place over "
          f"{steps} steps after {WARM_STEPS}")
    for run in range(runs):
        results = ranks_figures(Path(__file__), ["--turns", str(steps)], timeout=300 + steps)
        print(f"run {run + 1}")
        for rank, figures in results.items():
            _rank_lines(rank, figures, steps)


def main() -> None:
    turns_and_runs_main(__doc__.splitlines()[0], worker, bench, "steps (--turns)")


if __name__ == "__main__":
    main()
