"""Run as one node of a two-node job (each node in its own UTS and pid namespaces, so its own hostname and
pids that repeat across nodes): ``@profiler`` traces and ``attach`` records, as a user's job writes them,
into one shared output directory, and a trace capture the config's ``trace_capture`` section takes from a
request waiting in its output_dir (after the profiler's window).  Each rank also writes what it knows of
itself to ``{out}/identity_rank_{r}.json``."""
import argparse
import json
import os
import socket
from pathlib import Path

import deepspeed
import torch

from ds_profutils import attach, profiler, step_profiler

STEPS = 8
"""The profiler's window within steps 0-3, a capture at step 4, the exchange after step 7 saying every rank wrote
it (monitor_interval 4: tests/test_two_hosts.py)."""


def train(args: argparse.Namespace) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    recorder = attach(engine)
    for _ in range(STEPS):
        engine.backward(engine(torch.randn(4, 16)).pow(2).mean())
        engine.step()
        step_profiler(engine)
    recorder.close()
    rank = torch.distributed.get_rank()
    (args.out / f"identity_rank_{rank}.json").write_text(
        json.dumps({"rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
                    "local_rank": int(os.environ["LOCAL_RANK"])}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = deepspeed.add_config_arguments(parser).parse_args()
    profiler(config=args)(train)(args)


if __name__ == "__main__":
    main()
    print(f"job end: rank {os.environ.get('RANK', 0)}", flush=True)  # run_deepspeed's check reads it (tests/launcher.py)
    if torch.distributed.is_initialized():  # the documented shutdown (README, "On CPU")
        torch.distributed.destroy_process_group()
