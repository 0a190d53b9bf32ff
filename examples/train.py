"""A small real DeepSpeed training job on CPU that uses ds_profutils where a user would.

Run it under the launcher (2 ranks, gloo), as the README shows:

    deepspeed --num_gpus 2 --master_port 29611 examples/train.py --deepspeed_config ds_configs/zero3_all_profiling.json

It trains a toy regression model, reads the fp32 master weights and gradients through the
``safe_get_*`` accessors, prints progress on rank 0 with ``print_dist``, and profiles as the ds_config
says, through one line, ``attach(engine)``: the ``"partitioned_param_profiler"`` section's ZeRO-3 fetch
records, the ``"profiler"`` section's torch traces, driven by the engine's optimizer steps, and the
``"step_metrics"`` section's live line on rank 0 every ``monitor_interval`` steps (no
decorator, no ``step_profiler()`` in the loop; the decorator is the other way, for a loop with no engine
to follow: docs/profiler.md).  At the end rank 0 says where the outputs are, prints the merged fetch
report, and last the command that prints it again.
"""
import argparse
import shutil
import sys
from typing import Optional

import deepspeed
import torch

from ds_profutils import RepeatingLoader, attach, safe_get_full_fp32_param, safe_get_full_grad
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
    # The one profiling line: fetch records and torch traces, as the ds_config's sections ask.
    attachment = attach(engine)
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
    return attachment


def report_outputs(attachment: Optional[Attachment]) -> None:
    """Close the attachment (the profiler's window is written, and on rank 0 it says where its traces went
    and prints the operator summary), then, once every rank has written its records, rank 0 prints the
    merged report (the fetch report of a ZeRO-3 job) and, as the last line, the command that prints it again."""
    if attachment is None:
        return
    recorder = attachment.recorder
    attachment.close()
    if recorder is None:
        return
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        command = shutil.which("ds-profutils") or f"{sys.executable} -m ds_profutils"
        report = build_report(recorder.path.parent)
        what = "fetch report" if any(engine["events"] for engine in report["engines"].values()) else "report"  # ZeRO-3
        print(f"\nThe {what}:\n", flush=True)
        print(render_text(report), flush=True)
        print(f"\nThe {what} again, later: {command} report {recorder.path.parent}", flush=True)


if __name__ == "__main__":
    report_outputs(train(parse_args()))
    if torch.distributed.is_initialized():  # the documented shutdown (README, "On CPU")
        torch.distributed.destroy_process_group()
