"""One gloo rank (plain ``python``): what ``apply_engine_settings`` changes in real ZeRO engines, and its undo.

For ZeRO stages 1, 2 and 3 with ``wall_clock_breakdown``, a ``comms_logger`` and an ``nvtx`` section:
which of the engine's objects hold the timer group before, while applied and after the undo, whether
the engine trains and logs its timers on ours, and that applying again after the undo works.
Findings go to the JSON file named by ``--out`` for the test.
"""
import argparse
import contextlib
import io
import json
import os

import deepspeed
import deepspeed.comm.comm as ds_comm
import deepspeed.utils.nvtx as ds_nvtx
import torch

from ds_profutils.config import load_config
from ds_profutils.timer import SynchronizedWallClockTimer
from ds_profutils.engine.engine_setup import TIMER_HOLDERS, apply_engine_settings


def make_engine(stage: int):
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1,
        "wall_clock_breakdown": True,
        "comms_logger": {"enabled": False},
        "nvtx": {"enabled": False, "domain": "Job"},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def holders(engine):
    """Attribute path -> id of the timer group it holds, for the paths that exist."""
    found = {}
    for path in TIMER_HOLDERS:
        obj = engine
        for attribute in path:
            obj = getattr(obj, attribute, None)
        if obj is not None and hasattr(obj, "timers"):
            found[".".join(("engine", ) + path)] = id(obj.timers)
    return found


def process_state():
    return [id(ds_comm.comms_logger), id(deepspeed.comm.comms_logger), ds_nvtx.enable_nvtx,
            ds_nvtx.DEEPSPEED_NVTX_DOMAIN]


def train(engine, steps: int) -> str:
    """Train ``steps`` steps; what the engine printed (its timer lines go to stdout)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for _ in range(steps):
            loss = engine(torch.randn(2, 8)).pow(2).mean()
            engine.backward(loss)
            engine.step()
    return printed.getvalue()


def check(stage: int) -> dict:
    engine = make_engine(stage)
    before_holders, before_process = holders(engine), process_state()
    theirs = engine.timers
    undo = apply_engine_settings(engine, load_config(engine))
    ours = engine.timers
    applied_holders = holders(engine)
    applied_process = process_state()
    printed = train(engine, 2)
    undo()
    after_holders, after_process = holders(engine), process_state()
    undo()  # twice: nothing more
    again = apply_engine_settings(engine, load_config(engine))
    printed_again = train(engine, 1)
    again()
    return {
        "before": before_holders,
        "applied": applied_holders,
        "after": after_holders,
        "theirs": id(theirs),
        "ours": id(ours),
        "ours_type": type(ours).__name__,
        "applied_is_ours": isinstance(ours, SynchronizedWallClockTimer),
        "process_before": before_process,
        "process_applied": applied_process,
        "process_after": after_process,
        "process_after_again": process_state(),
        "timer_lines": sum("time (ms)" in line for line in printed.splitlines()),
        "timer_lines_again": sum("time (ms)" in line for line in printed_again.splitlines()),
        "ours_timer_names": sorted(ours.get_timers()),
        "after_is_theirs": engine.timers is theirs,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    findings = {stage: check(stage) for stage in (1, 2, 3)}
    with open(args.out, "w") as out:
        json.dump(findings, out)


if __name__ == "__main__":
    os.environ.setdefault("LOCAL_RANK", "0")
    main()
    print(f"job end: rank {os.environ.get('RANK', 0)}", flush=True)  # run_deepspeed's check reads it (tests/launcher.py)
    if torch.distributed.is_initialized():  # the documented shutdown (README, "On CPU")
        torch.distributed.destroy_process_group()
