"""Run under the deepspeed launcher (2 ranks): fetch records in the conditions real jobs meet.

``--mode device``: every rank installs, before ``deepspeed.initialize``, the stand-in accelerator of
tests/stream_clock.py (DeepSpeed's CPU accelerator timing on device events whose streams keep their own
clocks) and makes ``deepspeed.comm``'s collectives take known device times on the streams they run on.
Each Linear layer's forward computes 1 ms on the compute stream, and every forward also reduces a
tensor on a side stream (as ZeRO-3's overlap_comm reduce-scatter does).  Two ZeRO-3 engines of
different sizes train in one process, interleaved: the first attached without a name (gradient
accumulation 2) and one named "critic".  The script's own model of the device (what each collective
took inside, how long each wait stalled the compute stream, the compute clock at each record's start
and end) goes to ``{out}/expected_rank_{r}.json``, per record, for the test to hold the records to.

``--mode straggler``: the real CPU accelerator; every forward of every rank sleeps 20 ms (a step that
waits on its device, as a GPU job's host does, so two ranks sharing two busy cores stay even); engine
"slowed" trains with rank 1 sleeping 60 ms more in forward, engine "slowed-backward" with rank 1
sleeping 60 ms more in backward only, then engine "calm" trains with no rank slowed.

``--mode interleaved``: the real CPU accelerator; an actor and a critic (ZeRO-3 engines of different
sizes) train one after the other (engines "actor-alone", "critic-alone"), then two new ones ("actor",
"critic") train with their steps interleaved as an RLHF loop runs them: both forwards, both backwards,
both optimizer steps.

Records go to ``{out}/records``.
"""
import os
import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import deepspeed
import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator, set_accelerator
from deepspeed.comm import comm

import ds_profutils
from ds_profutils.engine.collectives import ALWAYS_BLOCKING, ASYNC_OP_POSITION

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/
from stream_clock import StandInStream, StreamClockAccelerator, simulate_collectives  # noqa: E402

STEPS = 3
LAYER_MS = 1.0
DURATIONS_MS = {"all_gather_into_tensor": 3.0, "reduce_scatter_tensor": 4.0, "all_reduce": 5.0}
"""Device time of each collective; any other takes 2 ms."""
# Enough steps that scheduling noise, which makes either rank the step straggler now and then, cannot reach
# the report's bar by chance.
STRAGGLER_STEPS = 60
DEVICE_SECONDS, SLOW_SECONDS = 0.02, 0.06  # a slowdown the waits show even on two cores shared by six busy processes


def mlp(width: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 1))


def ds_config(records: Path, accumulation: int = 1) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": accumulation,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 600,
        },
        "partitioned_param_profiler": {"enabled": True, "output_dir": str(records)},
    }


def engine_for(width: int, records: Path, accumulation: int = 1):
    model = mlp(width)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(records, accumulation))
    return engine


class DeviceModel:
    """What the stand-in device did, per record (engine, micro step): the test's independent expectation."""

    def __init__(self, accelerator: StreamClockAccelerator) -> None:
        self.accelerator = accelerator
        self.records = defaultdict(lambda: {"stall_ms": 0.0, "stall_in_reset_ms": 0.0, "side_reduces": 0})
        self.current = None
        self.in_reset = False

    def async_waited(self, op: str, inside_ms: float, stall_ms: float) -> None:
        if self.current is None:
            return
        self.records[self.current]["stall_in_reset_ms" if self.in_reset else "stall_ms"] += stall_ms

    def follow(self, name: str, engine) -> None:
        """This engine's records: opened at its forward start (before attach's hook), compute per layer,
        DeepSpeed's reset_step marked, a side-stream reduce in each forward."""
        accelerator = self.accelerator

        def opened(module, args):
            self.current = f"{name}/{engine.micro_steps}"
            self.records[self.current]["start_ms"] = accelerator.compute.clock_ms

        engine.module.register_forward_pre_hook(opened, prepend=True)
        for layer in engine.module.modules():
            if isinstance(layer, torch.nn.Linear):
                layer.register_forward_hook(lambda *_: accelerator.advance(LAYER_MS))
        side = StandInStream("reduce_and_partition_stream")

        def side_reduce(module, args, output):
            with accelerator.stream(side):
                dist.all_reduce(torch.ones(8))  # through deepspeed.comm's backend object
            self.records[self.current]["side_reduces"] += 1

        engine.module.register_forward_hook(side_reduce)
        coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
        reset_step = coordinator.reset_step

        def marked_reset():
            self.in_reset = True
            try:
                reset_step()
            finally:
                self.in_reset = False

        coordinator.reset_step = marked_reset

    def closed(self) -> None:
        self.records[self.current]["end_ms"] = self.accelerator.compute.clock_ms
        self.current = None


def micro_step(engine, generator: torch.Generator, model: DeviceModel = None) -> None:
    engine.backward(engine(torch.randn(4, 16, generator=generator)).pow(2).mean())
    engine.step()
    if model is not None:
        model.closed()


def device_mode(records: Path, rank: int) -> dict:
    accelerator = get_accelerator()
    model = DeviceModel(accelerator)
    durations = {op: DURATIONS_MS.get(op, 2.0) for op in [*ASYNC_OP_POSITION, *ALWAYS_BLOCKING]
                 if hasattr(comm.cdb, op)}
    simulate_collectives(accelerator, comm.cdb, durations, ASYNC_OP_POSITION, model.async_waited)
    main = engine_for(32, records, accumulation=2)
    critic = engine_for(96, records)
    main_attachment, critic_attachment = ds_profutils.attach(main), ds_profutils.attach(critic, name="critic")
    model.follow("main", main)
    model.follow("critic", critic)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        for _ in range(2):
            micro_step(main, generator, model)
        micro_step(critic, generator, model)
    main_attachment.close()
    critic_attachment.close()
    return {
        "numel": {"main": sum(p.ds_numel for p in main.module.parameters()),
                  "critic": sum(p.ds_numel for p in critic.module.parameters())},
        "paths": {"main": str(main_attachment.recorder.path), "critic": str(critic_attachment.recorder.path)},
        "durations_ms": durations,
        "records": model.records,
    }


def _sleep_in_backward(module, args, output) -> None:
    output.register_hook(lambda grad: time.sleep(SLOW_SECONDS))


def straggler_mode(records: Path, rank: int) -> dict:
    generator = torch.Generator().manual_seed(rank)
    for name, slowed in (("slowed", "forward"), ("slowed-backward", "backward"), ("calm", None)):
        engine = engine_for(32, records)
        engine.module.register_forward_hook(lambda *_: time.sleep(DEVICE_SECONDS))
        if rank == 1 and slowed == "forward":
            engine.module.register_forward_hook(lambda *_: time.sleep(SLOW_SECONDS))
        elif rank == 1 and slowed == "backward":  # the gradient of the first layer's output: late in backward
            first = next(m for m in engine.module.modules() if isinstance(m, torch.nn.Linear))
            first.register_forward_hook(_sleep_in_backward)
        with ds_profutils.attach(engine, name=name):
            for _ in range(STRAGGLER_STEPS):
                micro_step(engine, generator)
    return {"slowed_rank": 1, "slow_ms": SLOW_SECONDS * 1e3}


def interleaved_mode(records: Path, rank: int) -> dict:
    generator = torch.Generator().manual_seed(rank)
    for name, width in (("actor-alone", 32), ("critic-alone", 96)):
        engine = engine_for(width, records)
        with ds_profutils.attach(engine, name=name):
            for _ in range(STEPS):
                micro_step(engine, generator)
    engines = (engine_for(32, records), engine_for(96, records))
    with ds_profutils.attach(engines[0], name="actor"), ds_profutils.attach(engines[1], name="critic"):
        for _ in range(STEPS):
            losses = [engine(torch.randn(4, 16, generator=generator)).pow(2).mean() for engine in engines]
            for engine, loss in zip(engines, losses):
                engine.backward(loss)
            for engine in engines:
                engine.step()
    return {"steps": STEPS}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", choices=("device", "straggler", "interleaved"), required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    if args.mode == "device":
        set_accelerator(StreamClockAccelerator())
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    records = args.out / "records"
    mode = {"device": device_mode, "straggler": straggler_mode, "interleaved": interleaved_mode}[args.mode]
    expected = mode(records, rank)
    (args.out / f"expected_rank_{rank}.json").write_text(json.dumps(expected))


if __name__ == "__main__":
    main()
    print(f"job end: rank {os.environ.get('RANK', 0)}", flush=True)  # run_deepspeed's check reads it (tests/launcher.py)
    if torch.distributed.is_initialized():  # the documented shutdown (README, "On CPU")
        torch.distributed.destroy_process_group()
