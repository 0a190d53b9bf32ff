"""Run under the deepspeed launcher (2 ranks, gloo): LiveMetrics fed with step figures measured in a
real ZeRO-2 loop, into the engine's own monitor (DeepSpeed's ``csv_monitor`` from the ds_config).

Each step all-reduces a small tensor, then trains a step of a ZeRO-2 engine; the step and the time
inside that all-reduce are timed as the recorder times a step and its collectives.  Rank 1 sleeps 80 ms
between steps, so rank 0 waits for it inside the all-reduce (the figures are measured, not made up).
One LiveMetrics (``monitor_interval`` 4, console on) writes to the engine's monitor; a second, fed the
same figures, takes the deferred path (read an interval late, the rest at close) into a list; rank 1
enters the last interval's deferred gather only once rank 0 has launched its side and counted what it
had written, so the last interval can only come at close, whatever the load.  Rank 1 alone runs an eval
forward before step ``EVAL_STEP``, timed into that step's ``eval_ms`` (the second interval's only one).  Rank 0
writes what it saw to ``{out}/findings.json``; each rank its wall time per interval and
its step and collective times per step to ``{out}/rank_{rank}.json``.
"""
import os
import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import deepspeed
import deepspeed.comm as dist
import torch

from ds_profutils.engine.live import LiveMetrics, StepFigures, monitor_sink

STEPS = 12
INTERVAL = 4
SLEEP_S = 0.08
SIZE = 64
BATCH = 4
PEAK_TFLOPS = 1e-5  # the toy model reaches a share of it that shows
TOKENS = 64  # per rank and step
EVAL_STEP = 5


class Kept:

    def __init__(self):
        self.writes = []

    def write(self, events):
        self.writes.append(events)


def wait_for(path: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout_s:.0f} s")
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    out = Path(parser.parse_args().out)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(SIZE, SIZE), torch.nn.Tanh(), torch.nn.Linear(SIZE, 1))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": BATCH,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "csv_monitor": {"enabled": True, "output_path": str(out / "csv"), "job_name": "live"},
    })
    settings = SimpleNamespace(monitor_interval=INTERVAL, console=True)
    live = LiveMetrics(settings, PEAK_TFLOPS, [monitor_sink(engine)])
    kept = Kept()
    deferred = LiveMetrics(SimpleNamespace(monitor_interval=INTERVAL, console=False), PEAK_TFLOPS, [kept],
                           defer=True)
    batch = torch.randn(BATCH, SIZE)
    flops = 3 * 2 * BATCH * (SIZE * SIZE + SIZE)  # forward and backward of the two layers
    launched_last = out / "rank_0_launched_the_last_deferred_gather"
    last_end = None
    walls = []  # this rank's wall time per interval: its iteration times (the first step: its step time)
    collectives, steps = [], []
    eval_ms = 0.0
    for step in range(STEPS):
        if rank == 1:
            time.sleep(SLEEP_S)  # a slow input pipeline: between steps, outside the step
        if rank == 1 and step == EVAL_STEP:  # an eval forward between steps, on this rank only
            start = time.perf_counter()
            engine.eval()
            with torch.no_grad():
                engine(batch)
            engine.train()
            eval_ms = (time.perf_counter() - start) * 1e3
        assert engine.global_steps == step  # the step as the records number it: global_steps when it began
        start = time.perf_counter()
        dist.all_reduce(torch.ones(8))
        collective_ms = (time.perf_counter() - start) * 1e3
        engine.backward(engine(batch).pow(2).mean())
        engine.step()
        end = time.perf_counter()
        step_ms = (end - start) * 1e3
        iteration_ms = None if last_end is None else (end - last_end) * 1e3
        last_end = end
        collectives.append(collective_ms)
        steps.append(step_ms)
        if step % INTERVAL == 0:
            walls.append(0.0)
        walls[-1] += step_ms if iteration_ms is None else iteration_ms
        figures = StepFigures(global_step=step, step_ms=step_ms, iteration_ms=iteration_ms,
                              gap_ms=None if iteration_ms is None else iteration_ms - step_ms, flops=flops,
                              tokens=TOKENS, samples=1, exposed_wait_ms=collective_ms, collective_ms=collective_ms,
                              peak_allocated_bytes=None, eval_ms=eval_ms if step == EVAL_STEP else 0.0)
        live.step_finished(figures)
        last = step == STEPS - 1
        if last and rank == 1:
            wait_for(launched_last)
        deferred.step_finished(figures)
        if last and rank == 0:
            deferred_before_close = len(kept.writes)
            launched_last.touch()
    live.close()
    deferred.close()
    (out / f"rank_{rank}.json").write_text(json.dumps({"walls_ms": walls, "collective_ms": collectives,
                                                                 "step_ms": steps, "eval_ms": eval_ms}))
    if rank == 0:
        (out / "findings.json").write_text(
            json.dumps({"deferred": kept.writes, "deferred_before_close": deferred_before_close, "flops": flops,
                        "peak_tflops": PEAK_TFLOPS, "tokens": TOKENS, "train_batch_size": engine.train_batch_size()}))


if __name__ == "__main__":
    main()
    print(f"job end: rank {os.environ.get('RANK', 0)}", flush=True)  # run_deepspeed's check reads it (tests/launcher.py)
    if torch.distributed.is_initialized():  # the documented shutdown (README, "On CPU")
        torch.distributed.destroy_process_group()
