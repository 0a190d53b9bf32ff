"""Run under the deepspeed launcher (2 ranks): fetch records in the conditions real jobs meet.

``--mode device``: every rank installs, before ``deepspeed.initialize``, a stand-in accelerator:
DeepSpeed's CPU accelerator with ``use_host_timers()`` False and an ``Event`` whose clock this script
moves (3 ms per recorded event), nothing else changed.  Two ZeRO-3 engines of different sizes train
in one process, interleaved: the first attached without a name (gradient accumulation 2) and one
named "critic".

``--mode straggler``: the real CPU accelerator; every forward of every rank sleeps 20 ms (a step that
waits on its device, as a GPU job's host does, so two ranks sharing two busy cores stay even); engine
"slowed" trains with rank 1 sleeping 30 ms more, then engine "calm" trains with no rank slowed.

Records go to ``{out}/records``; what the script knows independently goes to
``{out}/expected_rank_{r}.json``.
"""
import argparse
import json
import time
from pathlib import Path

import deepspeed
import torch
from deepspeed.accelerator import set_accelerator
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

import ds_profutils

TICK_MS = 3.0
STEPS = 3
# Enough steps that scheduling noise, which makes either rank the step straggler now and then, cannot reach
# the report's bar (straggler in at least half the steps) by chance.
STRAGGLER_STEPS = 60
DEVICE_SECONDS, SLOW_SECONDS = 0.02, 0.03


class ScriptedEvent:
    """A device event on a clock this script controls: every ``record()`` moves it ``TICK_MS``."""

    clock_ms = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        self.time_ms = None

    def record(self, stream=None) -> None:
        ScriptedEvent.clock_ms += TICK_MS
        self.time_ms = ScriptedEvent.clock_ms

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "ScriptedEvent") -> float:
        return end.time_ms - self.time_ms


class DeviceTimedCPU(CPU_Accelerator):
    """DeepSpeed's CPU accelerator, timing on "device" events as CUDA's does; nothing else differs."""

    def use_host_timers(self) -> bool:
        return False

    @property
    def Event(self):
        return ScriptedEvent


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


def micro_step(engine, generator: torch.Generator) -> None:
    engine.backward(engine(torch.randn(4, 16, generator=generator)).pow(2).mean())
    engine.step()


def device_mode(records: Path, rank: int) -> dict:
    main = engine_for(32, records, accumulation=2)
    critic = engine_for(96, records)
    main_recorder, critic_recorder = ds_profutils.attach(main), ds_profutils.attach(critic, name="critic")
    generator = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        for _ in range(2):
            micro_step(main, generator)
        micro_step(critic, generator)
    main_recorder.close()
    critic_recorder.close()
    return {
        "numel": {"main": sum(p.ds_numel for p in main.module.parameters()),
                  "critic": sum(p.ds_numel for p in critic.module.parameters())},
        "paths": {"main": str(main_recorder.path), "critic": str(critic_recorder.path)},
    }


def straggler_mode(records: Path, rank: int) -> dict:
    generator = torch.Generator().manual_seed(rank)
    for name, slowed in (("slowed", True), ("calm", False)):
        engine = engine_for(32, records)
        pause = DEVICE_SECONDS + (SLOW_SECONDS if slowed and rank == 1 else 0)
        engine.module.register_forward_hook(lambda *_: time.sleep(pause))
        recorder = ds_profutils.attach(engine, name=name)
        for _ in range(STRAGGLER_STEPS):
            micro_step(engine, generator)
        recorder.close()
    return {"slowed_rank": 1, "slow_ms": SLOW_SECONDS * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", choices=("device", "straggler"), required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    if args.mode == "device":
        set_accelerator(DeviceTimedCPU())
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    records = args.out / "records"
    expected = (device_mode if args.mode == "device" else straggler_mode)(records, rank)
    (args.out / f"expected_rank_{rank}.json").write_text(json.dumps(expected))


if __name__ == "__main__":
    main()
