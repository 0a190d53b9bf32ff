"""Run under the deepspeed launcher (2 ranks, gloo): LiveMetrics fed with step figures measured in a
real loop, into DeepSpeed's own ``csv_monitor``.

Each step computes a matmul and all-reduces its result, timed as the recorder times a step and its
collectives; rank 1 sleeps 80 ms between steps, so rank 0 waits for it inside the all-reduce (the
figures are measured, not made up).  One LiveMetrics (``monitor_interval`` 4, console on) writes to a
``MonitorMaster`` built from a ds_config dict with ``csv_monitor`` enabled; a second, fed the same
figures, takes the deferred path (read an interval late, the rest at close) into a list.  Rank 0
writes what it saw to ``{out}/findings.json``.
"""
import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import deepspeed
import deepspeed.comm as dist
import torch
from deepspeed.monitor.config import get_monitor_config
from deepspeed.monitor.monitor import MonitorMaster

from ds_profutils.engine.live import LiveMetrics, StepFigures, monitor_sink

STEPS = 12
INTERVAL = 4
SLEEP_S = 0.08
SIZE = 96
PEAK_TFLOPS = 1e-4  # the toy's matmuls reach a share of it that shows
TOKENS = 64  # per rank and step


class Kept:

    def __init__(self):
        self.writes = []

    def write(self, events):
        self.writes.append(events)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    out = Path(parser.parse_args().out)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    monitor = MonitorMaster(get_monitor_config({
        "csv_monitor": {"enabled": True, "output_path": str(out / "csv"), "job_name": "live"},
    }))
    settings = SimpleNamespace(monitor_interval=INTERVAL, console=True)
    live = LiveMetrics(settings, PEAK_TFLOPS, [monitor_sink(SimpleNamespace(monitor=monitor))])
    kept = Kept()
    deferred = LiveMetrics(SimpleNamespace(monitor_interval=INTERVAL, console=False), PEAK_TFLOPS, [kept],
                           defer=True)
    weights = torch.randn(SIZE, SIZE)
    flops = 2 * SIZE**3 * 3  # three matmuls a step
    last_end = None
    for step in range(STEPS):
        if rank == 1:
            time.sleep(SLEEP_S)  # a slow input pipeline: between steps, outside the step
        start = time.perf_counter()
        x = torch.randn(SIZE, SIZE)
        for _ in range(3):
            x = torch.tanh(x @ weights)
        inside = time.perf_counter()
        dist.all_reduce(x)
        end = time.perf_counter()
        collective_ms = (end - inside) * 1e3
        step_ms = (end - start) * 1e3
        iteration_ms = None if last_end is None else (end - last_end) * 1e3
        last_end = end
        figures = StepFigures(global_step=step, step_ms=step_ms, iteration_ms=iteration_ms,
                              gap_ms=None if iteration_ms is None else iteration_ms - step_ms, flops=flops,
                              tokens=TOKENS, samples=1, exposed_wait_ms=collective_ms, collective_ms=collective_ms,
                              peak_allocated_bytes=None)
        live.step_finished(figures)
        deferred.step_finished(figures)
    deferred_before_close = len(kept.writes)
    live.close()
    deferred.close()
    if rank == 0:
        (out / "findings.json").write_text(
            json.dumps({"deferred": kept.writes, "deferred_before_close": deferred_before_close, "flops": flops,
                        "peak_tflops": PEAK_TFLOPS, "tokens": TOKENS}))


if __name__ == "__main__":
    main()
