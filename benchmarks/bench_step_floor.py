"""The least any step recorder hooked as ours is pays on bench_step_metrics' ZeRO-2 step, against no hooks.

    python benchmarks/bench_step_floor.py [--turns 200] [--runs 3]

What ``step_metrics`` must do on the step path, and nothing more, done by a stand-in (:class:`Floor`), not by
ds_profutils: the engine's module hooked as ``EngineHooks`` hooks it (a forward pre-hook with the keyword
arguments, prepended; a forward hook; an always-call forward hook; a tensor hook on the output, whose
backward queues an autograd-engine callback), ``engine.backward`` and ``engine.step`` wrapped; a
``perf_counter_ns`` at each phase boundary and an RSS read (``pread`` of ``/proc/self/statm`` through a kept
descriptor) at the forward's, backward's and step's ends; every collective of ``deepspeed.comm``'s backend
wrapped with a per-thread depth, a per-group count and a clock read at each end, the ``torch.distributed``
functions with the depth check (timed where outside one); and per optimizer step one line of its marks
written to an unbuffered file.  No record is built, nothing is gathered, nothing is kept past the step.

It is read beside ``bench_step_metrics.py``'s ratio (the same engine, the same interleaved turns, the same
block of steps 11-20 after attach): the part of that ratio any recorder of this shape pays on this machine,
whatever its code.  Per run, the worst rank's median ratio; the figure is the median of the runs'.  A third mode,
the module hooks alone (:class:`HookShape`: the module's three hooks and the output's backward watch, doing nothing
else; not the wrappers of ``forward``, ``backward`` and ``step``), shows how much of that hooking the module takes.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
from pathlib import Path
from time import perf_counter_ns
from typing import Any, Callable, Dict, List

# benchmarks/ is the script's own folder
from bench_engines import attach_turns, mlp_engine, ranks_figures, turns_and_runs_main

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_gather", "reduce")
"""The collectives a ZeRO-2 step issues, and their like."""


class HookShape:
    """Only the hooks ``EngineHooks`` puts on the module, each doing nothing but the forward hook's backward watch
    (a pre-hook on the output's node queueing an autograd-engine callback): what hooking alone costs."""

    def __init__(self, engine: Any) -> None:
        module = engine.module
        self._handles = [module.register_forward_pre_hook(lambda *args: None, prepend=True, with_kwargs=True),
                         module.register_forward_hook(self._forward_ended),
                         module.register_forward_hook(lambda *args: None, always_call=True)]
        self._watch: Any = None

    def _forward_ended(self, module: Any, args: Any, output: Any) -> None:
        import torch

        self._watch = output.grad_fn.register_prehook(
            lambda grad: torch.autograd.Variable._execution_engine.queue_callback(lambda: None))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


class Floor:
    """The step path's least work, on ``engine`` until :meth:`close` (see the module doc)."""

    def __init__(self, engine: Any, records: Path) -> None:
        import torch.distributed as dist
        from deepspeed.comm import comm

        self._engine, self._backend, self._dist = engine, comm.cdb, dist
        self._statm = os.open("/proc/self/statm", os.O_RDONLY)
        self._file = open(records, "wb", buffering=0)
        self._thread = threading.local()
        self._counts: Dict[Any, int] = {}
        self._marks: List[Any] = []
        self._watch: Any = None
        module = engine.module
        self._handles = [module.register_forward_pre_hook(self._forward_started, prepend=True, with_kwargs=True),
                         module.register_forward_hook(self._forward_ended),
                         module.register_forward_hook(lambda *args: None, always_call=True)]
        self._engine_methods = {name: getattr(engine, name) for name in ("backward", "step")}
        for name, method in self._engine_methods.items():
            setattr(engine, name, self._marked(method, name == "step"))
        self._backend_methods = {op: getattr(self._backend, op) for op in COLLECTIVES}
        self._backend_held = {op: op in vars(self._backend) for op in COLLECTIVES}  # else the class's method
        self._torch_functions = {op: getattr(dist, op) for op in COLLECTIVES}
        for op in COLLECTIVES:
            setattr(self._backend, op, self._timed(op, self._backend_methods[op]))
            setattr(dist, op, self._framework_timed(op, self._torch_functions[op]))

    def _mark(self) -> None:
        self._marks.append(perf_counter_ns())
        self._marks.append(int(os.pread(self._statm, 128, 0).split()[1]))

    def _marked(self, method: Callable[..., Any], ends_step: bool) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            self._mark()
            if ends_step:
                marks, self._marks = self._marks, []
                self._file.write(f"{marks}\n".encode())
            return result

        return wrapper

    def _forward_started(self, module: Any, args: Any, kwargs: Any) -> None:
        self._marks.append(perf_counter_ns())

    def _forward_ended(self, module: Any, args: Any, output: Any) -> None:
        import torch

        self._mark()
        if self._watch is not None:
            self._watch.remove()
        self._watch = output.register_hook(
            lambda grad: torch.autograd.Variable._execution_engine.queue_callback(lambda: None))

    def _timed(self, op: str, method: Callable[..., Any]) -> Callable[..., Any]:
        from ds_profutils.engine.collectives import GROUP_POSITION

        thread, counts, position = self._thread, self._counts, GROUP_POSITION[op]

        def timed(*args: Any, **kwargs: Any) -> Any:
            group = kwargs["group"] if "group" in kwargs else args[position] if len(args) > position else None
            counts[group] = counts.get(group, 0) + 1
            thread.depth = getattr(thread, "depth", 0) + 1
            started = perf_counter_ns()
            try:
                return method(*args, **kwargs)
            finally:
                thread.depth -= 1
                self._marks.append((op, started, perf_counter_ns()))

        return timed

    def _framework_timed(self, op: str, function: Callable[..., Any]) -> Callable[..., Any]:
        """A ``torch.distributed`` function: passed through inside a backend collective (its own call), else timed."""
        thread = self._thread

        def checked(*args: Any, **kwargs: Any) -> Any:
            if getattr(thread, "depth", 0):
                return function(*args, **kwargs)
            started = perf_counter_ns()
            try:
                return function(*args, **kwargs)
            finally:
                self._marks.append((op, started, perf_counter_ns()))

        return checked

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        if self._watch is not None:
            self._watch.remove()
        for name in self._engine_methods:
            delattr(self._engine, name)
        for op in COLLECTIVES:
            if self._backend_held[op]:
                setattr(self._backend, op, self._backend_methods[op])
            else:
                delattr(self._backend, op)
            setattr(self._dist, op, self._torch_functions[op])
        self._file.close()
        os.close(self._statm)


def worker(out: Path, turns: int) -> None:
    engine, batch, rank, _ = mlp_engine({"stage": 2})
    steady: Dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as records:
        attach_turns(engine, batch, turns, {"off": lambda: None, "hooks": lambda: HookShape(engine),
                                            "floor": lambda: Floor(engine, Path(records) / f"floor_{rank}.txt")},
                     steady=steady)
    (out / f"rank_{rank}.json").write_text(json.dumps(steady))
    import torch.distributed

    torch.distributed.destroy_process_group()  # the documented shutdown, last


def bench(turns: int, runs: int) -> None:
    print(f"ZeRO-2 training step, 2 ranks (gloo, CPU), {turns} interleaved turns of off / the module hooks alone / "
          "the least recorder, steps 11-20 after attach")
    worst: Dict[str, List[float]] = {"hooks": [], "floor": []}
    for run in range(runs):
        load = os.getloadavg()[0]
        results = ranks_figures(Path(__file__), ["--turns", str(turns)], timeout=120 + 12 * turns)
        ratios: Dict[str, List[float]] = {mode: [] for mode in worst}
        for rank, steady in results.items():
            wall, cpu = steady["wall"], steady["cpu"]
            parts = []
            for mode, label in (("hooks", "the module hooks alone"), ("floor", "the least recorder")):
                ratios[mode].append(statistics.median(b / a for a, b in zip(wall["off"], wall[mode])))
                added_us = (statistics.median(cpu[mode]) - statistics.median(cpu["off"])) * 1e6
                parts.append(f"{label} {ratios[mode][-1]:.3f}x ({added_us:+.0f} us of the training thread's CPU)")
            print(f"  run {run + 1} (load {load:.1f}), rank {rank}: off {statistics.median(wall['off']) * 1e3:.2f} ms "
                  f"a step; {'; '.join(parts)}")
        for mode in worst:
            worst[mode].append(max(ratios[mode]))
    for mode, label in (("hooks", "the module hooks alone"), ("floor", "the least recorder")):
        print(f"{label} against off, worst rank of each run: {' / '.join(f'{r:.3f}' for r in worst[mode])}; "
              f"median {statistics.median(worst[mode]):.3f}x")


def main() -> None:
    turns_and_runs_main(__doc__.splitlines()[0], worker, bench, "the three modes")


if __name__ == "__main__":
    main()
