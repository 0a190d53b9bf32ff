"""Run under the deepspeed launcher (2 ranks, gloo): step records from ``"step_metrics"`` on engines below ZeRO-3.

A ZeRO-2 engine trains STEPS steps with step_metrics on (records into ``{out}/zero2``); rank 1 sleeps
SLEEP_S between its steps (a slow input pipeline), outside forward, backward and step.  Every optimizer
step's StepFigures are collected from the recorder's ``step_listeners``.  Each rank then counts one
forward and backward of the same model and batch shape with torch's FlopCounterMode, the figure the
records' ``flops`` must match.  Then a ZeRO-1 engine recording on rank 0 only (rank 1 measures for its
listeners and writes nothing) and a stage-0 engine with gradient accumulation 2 (``iteration_ms`` on the
record that ends each optimizer step only) and one more hidden layer (a model of another size for the
diff).  A ZeRO-2 engine with ``partitioned_param_profiler`` on must still be refused.  Findings go to
``{out}/found_rank_{rank}.json``.
"""
import os
import argparse
import dataclasses
import json
import time
from pathlib import Path

import deepspeed
import torch
from torch.utils.flop_counter import FlopCounterMode

import ds_profutils
from ds_profutils.engine import AttachError

STEPS = 16
SLEEP_S = 0.08
ROWS, FEATURES = 8, 64


class Net(torch.nn.Module):
    """``hidden`` 256-wide layers between the input layer and the output: the stage-0 engine trains one more than
    the others, so the diff of its records and the ZeRO-2 engine's compares models of different sizes."""

    def __init__(self, hidden: int = 1):
        super().__init__()
        blocks = [torch.nn.Linear(FEATURES, 256), torch.nn.ReLU()]
        for _ in range(hidden):
            blocks += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
        self.layers = torch.nn.Sequential(*blocks, torch.nn.Linear(256, 1))

    def forward(self, x):
        return self.layers(x)


def ds_config(stage: int, section: dict, accumulation: int = 1, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": accumulation,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "step_metrics": section,
        **extra,
    }


def engine_for(config: dict, hidden: int = 1):
    torch.manual_seed(0)
    model = Net(hidden)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train(engine, micro_steps: int, rank: int, sleep_s: float = 0.0) -> None:
    for _ in range(micro_steps):
        if rank == 1 and sleep_s:
            time.sleep(sleep_s)
        loss = engine(torch.randn(ROWS, FEATURES)).pow(2).mean()
        engine.backward(loss)
        engine.step()


def reference_flops() -> int:
    """FlopCounterMode over one forward and backward of the model on a batch of the trained shape."""
    model = Net()
    with FlopCounterMode(display=False) as mode:
        model(torch.randn(ROWS, FEATURES)).pow(2).mean().backward()
    return mode.get_total_flops()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    out = Path(parser.parse_args().out)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    found = {}

    engine = engine_for(ds_config(2, {"enabled": True, "output_dir": str(out / "zero2"), "console": False}))
    attachment = ds_profutils.attach(engine)
    figures = []
    attachment.recorder.step_listeners.append(figures.append)
    train(engine, STEPS, rank, SLEEP_S)
    attachment.close()
    found["zero2_figures"] = [dataclasses.asdict(step) for step in figures]
    found["reference_flops"] = reference_flops()

    try:
        refused = None
        ds_profutils.attach(engine_for(ds_config(2, {"enabled": False}, partitioned_param_profiler={
            "enabled": True, "output_dir": str(out / "refused")})), name="refused")
    except AttachError as exc:
        refused = str(exc)
    found["refused"] = refused

    engine = engine_for(ds_config(1, {"enabled": True, "output_dir": str(out / "zero1"), "ranks": [0]}))
    attachment = ds_profutils.attach(engine, name="zero1")
    figures = []
    attachment.recorder.step_listeners.append(figures.append)
    train(engine, 3, rank)
    attachment.close()
    found["zero1_figures"] = [dataclasses.asdict(step) for step in figures]

    engine = engine_for(ds_config(0, {"enabled": True, "output_dir": str(out / "stage0")}, accumulation=2), hidden=2)
    with ds_profutils.attach(engine, name="stage0"):
        train(engine, 6, rank)

    (out / f"found_rank_{rank}.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main()
    print(f"job end: rank {os.environ.get('RANK', 0)}", flush=True)  # run_deepspeed's check reads it (tests/launcher.py)
    if torch.distributed.is_initialized():  # the documented shutdown (README, "On CPU")
        torch.distributed.destroy_process_group()
