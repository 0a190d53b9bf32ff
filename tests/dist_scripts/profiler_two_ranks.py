"""Run under the deepspeed launcher (2 ranks): ``@profiler`` configured from ``--deepspeed_config``.

A real DeepSpeed engine trains with gradient accumulation over 2 micro-steps, and ``step_profiler``
follows the engine's optimizer steps.  torch.distributed is initialized inside the first profiled
call, as in a user's script, so the trace's ``distributedInfo`` comes from torch.  A second profiled
call then trains the same engine on, writing to ``--second_output_dir`` with only rank 0 profiled:
its step numbers continue from the engine's, and rank 1 runs it unprofiled.  The test reads the
profiler's outputs and this job's output; this script only trains.
"""
import os
import argparse

import deepspeed
import torch

from ds_profutils import profiler, step_profiler

OPTIMIZER_STEPS = 10
SECOND_CALL_STEPS = 6


def train(engine, optimizer_steps: int) -> None:
    features = torch.randn(4, 16)
    targets = features.sum(dim=1, keepdim=True)
    for _ in range(optimizer_steps * engine.gradient_accumulation_steps()):
        loss = torch.nn.functional.mse_loss(engine(features), targets)
        engine.backward(loss)
        engine.step()
        step_profiler(engine)


def first_call(args: argparse.Namespace):
    deepspeed.init_distributed(dist_backend="gloo")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    train(engine, OPTIMIZER_STEPS)
    return engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--second_output_dir", required=True)
    args = deepspeed.add_config_arguments(parser).parse_args()
    engine = profiler(config=args)(first_call)(args)
    profiler(config=args, output_dir=args.second_output_dir, ranks=[0])(train)(engine, SECOND_CALL_STEPS)


if __name__ == "__main__":
    main()
    print(f"job end: rank {os.environ.get('RANK', 0)}", flush=True)  # run_deepspeed's check reads it (tests/launcher.py)
    if torch.distributed.is_initialized():  # the documented shutdown (README, "On CPU")
        torch.distributed.destroy_process_group()
