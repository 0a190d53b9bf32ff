"""A small real DeepSpeed training job on CPU that uses ds_profutils where a user would.

Run it under the launcher (2 ranks, gloo), as the README shows:

    deepspeed --num_gpus 2 --master_port 29611 examples/train.py --deepspeed_config ds_configs/zero3_all_profiling.json

It trains a toy regression model, reads the fp32 master weights and gradients through the
``safe_get_*`` accessors, prints progress on rank 0 with ``print_dist``, and profiles as the ds_config
says: the ``"profiler"`` section drives ``@profiler``/``step_profiler()``, the
``"partitioned_param_profiler"`` section drives ``attach(engine)``.  At the end rank 0 says where the
outputs are and prints the merged fetch report.
"""
import argparse
import shutil
import sys
from typing import Optional

import deepspeed
import torch

from ds_profutils import (RepeatingLoader, attach, profiler, safe_get_full_fp32_param, safe_get_full_grad,
                          step_profiler)
from ds_profutils.logging import print_dist
from ds_profutils.report import build_report, render_text
from ds_profutils.engine import Attachment


class ToyModel(torch.nn.Module):
    """Two linear layers: enough parameters for ZeRO-3 to partition and fetch."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(16, width)
        self.head = torch.nn.Linear(width, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.encoder(features)))


def toy_dataset(samples: int = 256, seed: int = 0) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(samples, 16, generator=generator)
    targets = features.sum(dim=1, keepdim=True)
    return torch.utils.data.TensorDataset(features, targets)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps to train")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def train(args: argparse.Namespace) -> Optional[Attachment]:
    deepspeed.init_distributed(dist_backend="gloo")
    model = ToyModel()
    engine, _, loader, _ = deepspeed.initialize(args=args,
                                                model=model,
                                                model_parameters=model.parameters(),
                                                training_data=toy_dataset())
    attachment = attach(engine)  # ZeRO-3 fetch records, when the ds_config's "partitioned_param_profiler" asks
    batches = iter(RepeatingLoader(loader))
    for _ in range(args.steps):
        step = engine.global_steps  # the step number of the records, the traces and the report
        features, targets = next(batches)
        loss = torch.nn.functional.mse_loss(engine(features), targets)
        engine.backward(loss)
        grad_norm = safe_get_full_grad(engine.module.head.weight).norm().item()
        engine.step()
        weight_norm = safe_get_full_fp32_param(engine.module.head.weight).norm().item()
        # Progress is output, not a warning: print_dist prints on the given ranks whatever the log level.
        print_dist(f"step {step}: loss {loss.item():.4f}, head grad norm {grad_norm:.4f}, "
                   f"head weight norm {weight_norm:.4f}",
                   ranks=[0])
        step_profiler(engine)  # one profiler step per optimizer step
    return attachment


def report_outputs(attachment: Optional[Attachment]) -> None:
    """Once every rank has written its records, rank 0 prints the merged fetch report.

    (The profiler has already printed, on rank 0, where its traces went and the operator summary.)
    """
    recorder = attachment.recorder if attachment is not None else None
    if recorder is None:
        return
    attachment.close()
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        command = shutil.which("ds-profutils") or f"{sys.executable} -m ds_profutils"
        print(f"\nThe fetch report (again later: {command} report {recorder.path.parent}):\n", flush=True)
        print(render_text(build_report(recorder.path.parent)), flush=True)


if __name__ == "__main__":
    arguments = parse_args()
    report_outputs(profiler(config=arguments)(train)(arguments))
