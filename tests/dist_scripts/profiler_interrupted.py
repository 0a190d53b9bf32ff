"""Run under the deepspeed launcher (2 ranks), to be interrupted by the test while it records.

A real ZeRO-3 engine on gloo, fed by a DataLoader with a worker process, trains until stopped under
``@profiler(config=args)``, with fetch records from ``attach``; the config's schedule records cycles of
one warmup and ten active steps, endlessly.  Once a cycle is on disk and the next one records, each rank prints
``recording rank R pid P`` and the test interrupts the job.  ``--mode``:

* ``train``: train until stopped;
* ``raise``: rank 1 raises ValueError at the start of step ``--raise-at``;
* ``keyboard``: the profiled call is wrapped in the user's ``except KeyboardInterrupt:``, which prints
  ``user handler ran on rank R`` and returns (the process then exits 0).

``--slow-export`` makes each trace export after the marker take 3 s longer (a large window's export),
so signals reliably arrive while a rank writes.  SIGINT gets Python's own handler, as in a program run
from a terminal, whatever the test suite was started with (``nohup ... &`` ignores it).
"""
import argparse
import os
import signal
import time

import deepspeed
import torch

from ds_profutils import attach, profiler, step_profiler

recording = False


def slow_export_after_the_marker() -> None:
    export = torch.profiler.profile.export_chrome_trace

    def slow_export(self, path, use_python_export=False):
        if recording:
            time.sleep(3)
        return export(self, path, use_python_export)

    torch.profiler.profile.export_chrome_trace = slow_export


def train(args: argparse.Namespace) -> None:
    global recording
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    attach(engine)  # closed at exit, however the process ends
    data = torch.utils.data.TensorDataset(torch.randn(100_000, 16))
    loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=1, persistent_workers=True)
    for step, (features, ) in enumerate(loader):
        if args.mode == "raise" and rank == 1 and step == args.raise_at:
            raise ValueError(f"rank 1 fails at step {step}")
        loss = torch.nn.functional.mse_loss(engine(features), features.sum(dim=1, keepdim=True))
        engine.backward(loss)
        engine.step()
        if step == args.marker_step:
            recording = True
            print(f"recording rank {rank} pid {os.getpid()}", flush=True)
        time.sleep(0.5 if recording else 0.1)  # slower once marked: the test's signal lands in the window
        step_profiler(engine)


def main() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--mode", choices=("train", "raise", "keyboard"), default="train")
    parser.add_argument("--marker-step", type=int, default=13)
    parser.add_argument("--raise-at", type=int, default=16)
    parser.add_argument("--slow-export", action="store_true")
    args = deepspeed.add_config_arguments(parser).parse_args()
    if args.slow_export:
        slow_export_after_the_marker()
    profiled = profiler(config=args)(train)
    if args.mode != "keyboard":
        profiled(args)
        return
    try:
        profiled(args)
    except KeyboardInterrupt:
        print(f"user handler ran on rank {torch.distributed.get_rank()}", flush=True)


if __name__ == "__main__":
    main()
    print(f"job end: rank {os.environ.get('RANK', 0)}", flush=True)  # run_deepspeed's check reads it (tests/launcher.py)
    if torch.distributed.is_initialized():  # the documented shutdown (README, "On CPU")
        torch.distributed.destroy_process_group()
