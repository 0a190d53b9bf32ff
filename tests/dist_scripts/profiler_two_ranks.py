"""Run under the deepspeed launcher (2 ranks): ``@profiler`` configured from ``--deepspeed_config``.

A real DeepSpeed engine trains with gradient accumulation over 2 micro-steps, and ``step_profiler``
follows the engine's optimizer steps.  torch.distributed is initialized inside the profiled function,
as in a user's script, so the trace's ``distributedInfo`` comes from torch.  The test reads the
profiler's outputs; this script only trains.
"""
import argparse

import deepspeed
import torch

from ds_profutils import profiler, step_profiler

OPTIMIZER_STEPS = 10


def train(args: argparse.Namespace) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    features = torch.randn(4, 16)
    targets = features.sum(dim=1, keepdim=True)
    for _ in range(OPTIMIZER_STEPS * engine.gradient_accumulation_steps()):
        loss = torch.nn.functional.mse_loss(engine(features), targets)
        engine.backward(loss)
        engine.step()
        step_profiler(engine)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    args = deepspeed.add_config_arguments(parser).parse_args()
    profiler(config=args)(train)(args)


if __name__ == "__main__":
    main()
