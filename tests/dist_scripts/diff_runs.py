"""Four runs of a 2-rank ZeRO-3 job in one launcher start, each into its own output_dir, for ``ds-profutils diff``.

A launcher start costs 10-20 s, so the runs share one: each is its own engine (fetch records on,
its own ``output_dir``), and the four train interleaved, one optimizer step of each in turn, so that a
change of the machine's load (other jobs on its two cores) falls on all of them alike.  Every forward
of every rank sleeps ``DEVICE_MS`` (a step that waits on its device, as a GPU job's host does, so two
ranks on two busy cores stay even).

- ``base``: the job (engine "main", ``stage3_prefetch_bucket_size`` ``BUCKET``);
- ``same``: the unchanged job again (engine "same");
- ``slowed``: rank 1 sleeps ``SLOW_MS`` more in every forward (engine "slowed");
- ``bucket``: ``stage3_prefetch_bucket_size`` ``BIG_BUCKET`` (engine "bucket"), so a step's parameters
  are gathered in fewer, larger all-gathers.

Engines of one process need their own names (``attach``), so each run directory holds one engine of
its own name: ``ds-profutils diff`` compares the only engine of each run.
"""
import argparse
import json
import time
from pathlib import Path

import deepspeed
import torch

import ds_profutils

STEPS = 40
DEVICE_MS, SLOW_MS = 20.0, 40.0  # a slowdown that clears the drift-aware test on a loaded 2-core machine
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
        pause = (DEVICE_MS + (SLOW_MS if slowed and rank == 1 else 0.0)) / 1e3
        engine.module.register_forward_hook(lambda *_, pause=pause: time.sleep(pause))
        engines.append((engine, ds_profutils.attach(engine, name=name)))
    for _ in range(STEPS):
        for engine, _ in engines:
            engine.backward(engine(torch.randn(4, 16, generator=generator)).pow(2).mean())
            engine.step()
    for _, recorder in engines:
        recorder.close()
    (args.out / f"done_rank_{rank}.json").write_text(json.dumps({"steps": STEPS, "slow_ms": SLOW_MS}))


if __name__ == "__main__":
    main()
