"""Run under the deepspeed launcher (2 ranks, gloo): a 2-stage PipelineModule recorded by ``step_metrics``.

Eight ``Linear(256, 256)`` layers split over as many stages as ranks (2 under the launcher, 1 alone); with
``--slow`` the last stage also holds a layer that sleeps SLOW_S per micro batch (its forward), making it the slow
stage.  MICRO_BATCHES micro batches of ROWS rows, ``--steps`` ``train_batch()`` calls, then one ``eval_batch()``.
Records go to ``{out}``; each rank writes ``{out}/found_rank_{rank}.json`` with what it saw (the most step
records the recorder held at once, the engine's and the class's instruction maps after close) and prints the
last-line marker; and FlopCounterMode's count of its stage's layers, forward and backward, on one micro
batch.
"""
import argparse
import json
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime.pipe.engine import TRAIN_BATCH_TIMER
from torch.utils.flop_counter import FlopCounterMode

import ds_profutils

STEPS = 30
MICRO_BATCHES = 8
ROWS = 4
WIDTH = 256
SLOW_S = 0.010
MARKER = "PIPELINE JOB DONE"


class Sleep(torch.nn.Module):
    """Does nothing to its input; sleeps ``seconds`` in each forward (a slow layer on its stage)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        if self.seconds:
            time.sleep(self.seconds)
        return x


class MonitorFailed(RuntimeError):
    pass


def monitor_fails_once(engine) -> None:
    """The engine's monitor raises at its next write, which train_batch() makes after its optimizer step."""

    def write_events(events):
        engine.monitor.enabled = False
        raise MonitorFailed("a tracker's error after the optimizer step (stand-in)")

    engine.monitor.enabled, engine.monitor.write_events = True, write_events


def batches():
    while True:
        yield torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--slow", action="store_true")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--break-after", type=int, default=None, help="the recorder fails after this many batches")
    parser.add_argument("--monitor-fails-at", type=int, default=None,
                        help="this batch raises after its optimizer step (DeepSpeed's monitor writes after it)")
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    layers = [LayerSpec(torch.nn.Linear, WIDTH, WIDTH) for _ in range(8)]
    layers.append(LayerSpec(Sleep, SLOW_S if args.slow else 0.0))
    # "uniform" splits by layer count: 5 + 4, the sleeping layer on stage 1
    module = PipelineModule(layers=layers, num_stages=torch.distributed.get_world_size(), loss_fn=torch.nn.MSELoss(),
                            partition_method="uniform")
    config = {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": MICRO_BATCHES,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
        "step_metrics": {"enabled": True, "output_dir": args.out, "monitor_interval": 10},
    }
    engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=config)
    attachment = ds_profutils.attach(engine)
    data = batches()
    held = 0
    recorder = attachment.recorder
    for batch in range(args.steps):
        if batch == args.break_after:
            # a bug of ours: training must go on, the engine be DeepSpeed's again
            recorder._write_ready = lambda settled=False: 1 / 0
        if batch == args.monitor_fails_at:
            monitor_fails_once(engine)
        try:
            engine.train_batch(data_iter=data)
        except MonitorFailed:  # the program goes on: DeepSpeed's batch timer is left running
            engine.timers(TRAIN_BATCH_TIMER).stop()
        held = max(held, len(recorder._step_records) + len(recorder._unwritten))
    engine.eval_batch(data_iter=data)
    attachment.close()
    rank = torch.distributed.get_rank()
    # the stage's layers, forward and backward, on one micro batch (the first stage's input needs no gradient)
    inputs = torch.randn(ROWS, WIDTH, requires_grad=engine.stage_id > 0)
    with FlopCounterMode(display=False) as counted:
        outputs = engine.module(inputs)
        outputs.backward(torch.ones_like(outputs))
    found = {"reference_flops_per_micro_batch": counted.get_total_flops(), "rank": rank, "stage": engine.stage_id,
             "global_steps": engine.global_steps, "held_step_records": held,
             "instance_attributes_left": sorted({"_INSTRUCTION_MAP", "train_batch", "eval_batch"} & set(vars(engine))),
             "class_map": sorted(f.__qualname__ for f in type(engine)._INSTRUCTION_MAP.values())}
    Path(args.out, f"found_rank_{rank}.json").write_text(json.dumps(found))
    print(f"{MARKER} rank {rank}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
