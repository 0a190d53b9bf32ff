"""Four runs of a 2-rank ZeRO-3 job in one launcher start, each into its own output_dir, for ``ds-profutils diff``.

A launcher start costs 10-20 s, so the runs share one: each is its own engine (fetch records on,
its own ``output_dir``), and the four train interleaved, one optimizer step of each in turn, so that a
change of the machine's load (other jobs on its two cores) falls on all of them alike.  Every forward
of every rank sleeps ``DEVICE_MS`` (a step that waits on its device, as a GPU job's host does, so two
ranks on two busy cores stay even).

- ``base``: the job (engine "main", ``stage3_prefetch_bucket_size`` ``BUCKET``);
- ``same``: the unchanged job again (engine "same");
- ``slowed``: rank 1 computes more in every forward (engine "slowed"): ``SLOW_ITERATIONS`` turns of a
  Python loop, about 80 ms of one core here.  Work, not a sleep: on two cores that other jobs keep busy,
  a rank sleeping longer leaves its peer more CPU, and the step came out no slower (at load 7 here:
  -0.5 ms, p = 0.28, while rank 0's wait for rank 1 grew by 22 ms); more work is a slower step at
  any load, as a slower rank's is;
- ``bucket``: ``stage3_prefetch_bucket_size`` ``BIG_BUCKET`` (engine "bucket"), so a step's parameters
  are gathered in fewer, larger all-gathers.

Engines of one process need their own names (``attach``), so each run directory holds one engine of
its own name: ``ds-profutils diff`` compares the only engine of each run.
"""
import os
import argparse
import json
import time
from pathlib import Path

import deepspeed
import torch

import ds_profutils

STEPS = 90
DEVICE_MS = 20.0
SLOW_ITERATIONS = 1_000_000
BUCKET, BIG_BUCKET = 600, 10**6
RUNS = {"base": (None, BUCKET, False), "same": ("same", BUCKET, False), "slowed": ("slowed", BUCKET, True),
        "bucket": ("bucket", BIG_BUCKET, False)}  # run -> (engine name, bucket size, rank 1 slowed)


def ds_config(records: Path, bucket: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_prefetch_bucket_size": bucket},
        "partitioned_param_profiler": {"enabled": True, "output_dir": str(records)},
    }


def compute(iterations: int) -> None:
    """CPU work of a fixed size (``iterations`` turns of a Python loop), stretched by load as a step's compute
    is.  Returns None: a forward hook's return value would replace the module's output."""
    total = 0
    for turn in range(iterations):
        total += turn


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    generator = torch.Generator().manual_seed(rank)
    engines = []
    for run, (name, bucket, slowed) in RUNS.items():
        model = mlp()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(args.out / run, bucket))
        engine.module.register_forward_hook(lambda *_: time.sleep(DEVICE_MS / 1e3))
        if slowed and rank == 1:
            engine.module.register_forward_hook(lambda *_: compute(SLOW_ITERATIONS))
        engines.append((engine, ds_profutils.attach(engine, name=name)))
    for _ in range(STEPS):
        for engine, _ in engines:
            engine.backward(engine(torch.randn(4, 16, generator=generator)).pow(2).mean())
            engine.step()
    for _, recorder in engines:
        recorder.close()
    (args.out / f"done_rank_{rank}.json").write_text(json.dumps({"steps": STEPS, "slow_iterations": SLOW_ITERATIONS}))


if __name__ == "__main__":
    main()
    print(f"job end: rank {os.environ.get('RANK', 0)}", flush=True)  # run_deepspeed's check reads it (tests/launcher.py)
    if torch.distributed.is_initialized():  # the documented shutdown (README, "On CPU")
        torch.distributed.destroy_process_group()
