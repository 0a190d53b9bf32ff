"""Run under the deepspeed launcher on two GPUs (NCCL): a ZeRO-3 engine with overlap_comm (its gradient
reduce-scatter on a side stream), rank 1 slowed on the device in backward only.  Records go to
``{out}/records``."""
import argparse
from pathlib import Path

import deepspeed
import torch

import ds_profutils

STEPS, SLOW_MS = 40, 30.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="nccl")
    rank = torch.distributed.get_rank()
    torch.cuda.set_device(args.local_rank)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_param_persistence_threshold": 0},
        "partitioned_param_profiler": {"enabled": True, "output_dir": str(args.out / "records")},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if rank == 1:  # device time in backward only: the gradient of the first layer's output
        cycles = 0

        def calibrate() -> int:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(10_000_000)
            end.record()
            end.synchronize()
            return int(10_000_000 / start.elapsed_time(end) * SLOW_MS)

        cycles = calibrate()
        engine.module[0].register_forward_hook(
            lambda module, args, output: output.register_hook(lambda grad: torch.cuda._sleep(cycles)) and None)
    with ds_profutils.attach(engine):
        for _ in range(STEPS):
            batch = torch.randn(8, 1024, device="cuda")
            engine.backward(engine(batch).pow(2).mean())
            engine.step()


if __name__ == "__main__":
    main()
