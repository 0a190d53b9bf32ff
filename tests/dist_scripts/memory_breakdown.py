"""Run as one gloo rank (RANK 0 of 1): peaks reset by DeepSpeed's ``memory_breakdown``.

A stand-in accelerator (DeepSpeed's CPU accelerator with an allocator the script moves: each Linear's
forward allocates 1 MiB for the step, freed when the step ends) is installed before ``deepspeed.initialize``.
Engine "breakdown" has ``memory_breakdown: true``, so DeepSpeed's ``see_memory_usage`` resets the peaks
on rank 0 inside its forward, backward and step; engine "plain" does not.  Records go to ``{out}``;
``{out}/resets.json`` counts the resets each engine's training made beside ours.
"""
import os
import argparse
import json
from pathlib import Path

import deepspeed
import torch
from deepspeed.accelerator import set_accelerator
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

import ds_profutils

MIB = 2**20


class ModelledAllocator(CPU_Accelerator):
    """DeepSpeed's CPU accelerator whose peak statistics are an allocator's, not the process's RSS."""

    def __init__(self) -> None:
        super().__init__()
        self.allocated = self.peak = self.resets = 0

    def allocate(self, size: int) -> None:
        self.allocated += size
        self.peak = max(self.peak, self.allocated)

    def memory_allocated(self, device_index=None):
        return self.allocated

    def max_memory_allocated(self, device_index=None):
        return self.peak

    def memory_reserved(self, device_index=None):
        return self.allocated

    def max_memory_reserved(self, device_index=None):
        return self.peak

    def reset_peak_memory_stats(self, device_index=None):
        self.resets += 1
        self.peak = self.allocated


def train(name: str, breakdown: bool, out: Path, accelerator: ModelledAllocator) -> int:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "memory_breakdown": breakdown,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "partitioned_param_profiler": {"enabled": True, "output_dir": str(out)}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for layer in engine.module.modules():
        if isinstance(layer, torch.nn.Linear):
            layer.register_forward_hook(lambda *_: accelerator.allocate(MIB))
    attachment = ds_profutils.attach(engine, name=name)
    before = accelerator.resets
    for _ in range(3):
        held = accelerator.allocated
        engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
        engine.step()
        accelerator.allocated = held  # the step's activations are freed
    attachment.close()
    return accelerator.resets - before


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    accelerator = ModelledAllocator()
    set_accelerator(accelerator)
    deepspeed.init_distributed(dist_backend="gloo")
    resets = {name: train(name, breakdown, out, accelerator) for name, breakdown in (("breakdown", True),
                                                                                   ("plain", False))}
    (out / "resets.json").write_text(json.dumps(resets))


if __name__ == "__main__":
    main()
    print(f"job end: rank {os.environ.get('RANK', 0)}", flush=True)  # run_deepspeed's check reads it (tests/launcher.py)
    if torch.distributed.is_initialized():  # the documented shutdown (README, "On CPU")
        torch.distributed.destroy_process_group()
