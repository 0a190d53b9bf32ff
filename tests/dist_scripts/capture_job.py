"""Run under the deepspeed launcher (gloo, ZeRO-2): trace captures asked for while the job trains, or fired by an
anomaly (docs/capture.md).

``step_metrics`` is off (its ``monitor_interval`` still sets the live interval: trace_capture runs the exchange
itself); ``trace_capture`` is on with ``gzip``.  Every forward sleeps FORWARD_S (a device's kernels, so ranks
sharing busy cores stay even); with ``--slow-rank R`` rank R sleeps ``--slow-ms`` more from step ``--slow-from``.
Rank 0 prints ``capture_job: step N`` at each step from ``--announce`` on (so a test knows the job trains) and
writes ``steps.json``, each step's global number and the time it began, before its last line.

Each rank prints ``capture_job: done rank R`` as its last line, before the documented shutdown.
"""
import argparse
import json
import time
from pathlib import Path

import deepspeed
import torch

import ds_profutils

FORWARD_S = 0.02
WIDTH = 64


class SleepyNet(torch.nn.Module):
    """Two linear layers whose forward sleeps ``sleep_s`` first."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 1))
        self.sleep_s = FORWARD_S

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.sleep_s)
        return self.layers(x).pow(2).mean()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--interval", type=int, default=5)
    parser.add_argument("--on-anomaly", action="store_true")
    parser.add_argument("--step-jump", type=float, default=1.5)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-from", type=int, default=40)
    parser.add_argument("--slow-ms", type=float, default=60.0)
    parser.add_argument("--announce", type=int, default=10)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = SleepyNet()
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": 2},
              "step_metrics": {"enabled": False, "monitor_interval": args.interval, "output_dir": str(args.out)},
              "trace_capture": {"enabled": True, "gzip": True, "on_anomaly": args.on_anomaly,
                                "step_jump": args.step_jump}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    began = []
    with ds_profutils.attach(engine):
        for _ in range(args.steps):
            step = engine.global_steps
            began.append((step, time.time()))
            if rank == 0 and step >= args.announce:
                print(f"capture_job: step {step}", flush=True)
            if rank == args.slow_rank and step >= args.slow_from:
                model.sleep_s = FORWARD_S + args.slow_ms / 1e3
            loss = engine(torch.randn(4, WIDTH))
            engine.backward(loss)
            engine.step()
    if rank == 0:
        (args.out / "steps.json").write_text(json.dumps(began))
    print(f"capture_job: done rank {rank}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
