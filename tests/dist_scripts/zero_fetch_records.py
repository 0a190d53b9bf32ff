"""Run under the deepspeed launcher (2 ranks): ``ds_profutils.attach`` on a real ZeRO-3 engine.

Trains a small model with ``stage3_param_persistence_threshold: 0`` and fetch records switched on in
the ds_config, while counting independently what the coordinator really does: calls of its
``fetch_sub_module`` and, beneath it, every ``all_gather_coalesced`` with the numel it gathers.
Between train steps it runs an eval forward, and ends with one more (written at exit).  A ZeRO-1
engine must be refused.  A second ZeRO-3 engine records on rank 0 only (``ranks: [0]``, into
``{out}/rank0_only`` where both ranks have a file of an earlier run; the second engine attached without
a name in this process, so "engine1") with ``wall_clock_breakdown``,
so ds_profutils' timers replace DeepSpeed's (and the fetch timers are driven in them).  An engine named
"limited" trains with a small ``stage3_max_live_parameters``; one named "phases" is attached, closed
and attached again, then a new engine takes its name (a resumed ``train()``): its file holds every
phase.  Findings go to ``{out}/expected_rank_{rank}.json``; records to ``{out}/records``.
"""
import os
import argparse
import json
from collections import Counter
from pathlib import Path

import deepspeed
import torch

import ds_profutils
from ds_profutils.timer import SynchronizedWallClockTimer
from ds_profutils.engine import AttachError

TRAIN_STEPS = 4
EVAL_AFTER_STEP = 2  # an eval forward between train steps 2 and 3 (0-based), written at the next forward


class Net(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(16, 32)
        self.hidden = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 1)

    def forward(self, x):
        return self.head(torch.relu(self.hidden(torch.relu(self.encoder(x)))))


def ds_config(stage: int, records: Path, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 600,  # some fetches become prefetches
            # release each module's parameters after use (the default keeps those reused in backward
            # gathered, so the whole model would be live at once whatever stage3_max_live_parameters says)
            "stage3_max_reuse_distance": 0,
        },
        "partitioned_param_profiler": {"enabled": True, "output_dir": str(records), "log_interval": 1},
        **extra,
    }


class FetchCounter:
    """Counts per record what the coordinator does, without going through any profiler."""

    def __init__(self, engine):
        self.current = None
        self.by_record = {}
        coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
        fetch = coordinator.fetch_sub_module

        def counted_fetch(module, forward):
            self.current["forward_fetches" if forward else "backward_fetches"] += 1
            return fetch(module, forward)

        coordinator.fetch_sub_module = counted_fetch
        for param in engine.module.parameters():
            param.all_gather_coalesced = self._counted_gather(param.all_gather_coalesced)

    def _counted_gather(self, gather):

        def counted(params, **kwargs):
            phase = "backward" if self.current["in_backward"] else "forward"
            self.current[f"{phase}_all_gather_count"] += 1
            self.current[f"{phase}_all_gather_numel"] += sum(p.ds_numel for p in params)
            return gather(params, **kwargs)

        return counted

    def open(self, engine, mode):
        key = f"{engine.micro_steps}/{mode}"
        self.current = self.by_record.setdefault(key, Counter())
        self.current["in_backward"] = 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    records = args.out / "records"
    findings = {}

    zero1 = Net()
    engine1, *_ = deepspeed.initialize(model=zero1, model_parameters=zero1.parameters(), config=ds_config(1, records))
    try:
        ds_profutils.attach(engine1)
        findings["zero1_refusal"] = None
    except AttachError as exc:
        findings["zero1_refusal"] = str(exc)
    findings["zero1_untouched"] = "step" not in vars(engine1)

    records.mkdir(parents=True, exist_ok=True)
    (records / f"zero_fetch_rank_{rank}.jsonl").write_text("stale line of an earlier run\n")
    torch.manual_seed(0)
    model = Net()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(3, records))
    attachment = ds_profutils.attach(engine)
    findings["second_attach_same"] = ds_profutils.attach(engine) is attachment
    findings["total_numel"] = sum(p.ds_numel for p in engine.module.parameters())
    counter = FetchCounter(engine)

    generator = torch.Generator().manual_seed(rank)
    for step in range(TRAIN_STEPS):
        x = torch.randn(4, 16, generator=generator)
        counter.open(engine, "train")
        loss = engine(x).pow(2).mean()
        counter.current["in_backward"] = 1
        engine.backward(loss)
        counter.current["in_backward"] = 0
        engine.step()
        if step == EVAL_AFTER_STEP:
            engine.eval()
            counter.open(engine, "eval")
            with torch.no_grad():
                engine(x)
            engine.train()
    engine.eval()
    counter.open(engine, "eval")
    with torch.no_grad():
        engine(torch.randn(4, 16, generator=generator))  # written by the recorder at exit

    findings["counted"] = {key: dict(counts) for key, counts in counter.by_record.items()}
    # without wall_clock_breakdown DeepSpeed gives its coordinator a NoopTimer: no fetch timed into the group
    findings["timer_names_without_breakdown"] = sorted(engine.timers.get_timers())
    findings["rank0_only"] = rank0_only_with_our_timers(args.out / "rank0_only", rank)
    findings["limited_max_live"] = train_limited(records)
    findings["phases"] = attached_in_phases(records)
    findings["memory"] = rank1_keeps_more_memory(records, rank)
    (args.out / f"expected_rank_{rank}.json").write_text(json.dumps(findings))


def rank0_only_with_our_timers(records: Path, rank: int) -> dict:
    """A ZeRO-3 engine recording on rank 0 only, with wall_clock_breakdown: what attach did on this rank."""
    records.mkdir(parents=True, exist_ok=True)
    stale = records / f"zero_fetch_engine1_rank_{rank}.jsonl"
    stale.write_text("{}\n")  # an earlier run's, on every rank
    model = Net()
    config = ds_config(3, records, wall_clock_breakdown=True)
    config["partitioned_param_profiler"]["ranks"] = [0]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    deepspeeds_timers = engine.timers
    attachment = ds_profutils.attach(engine)
    timers = engine.timers
    offload = engine.optimizer.parameter_offload
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 16)).pow(2).mean())
        engine.step()
    findings = {
        "recorder": attachment.recorder is not None,
        "stale_file_left": stale.exists() and stale.read_text().startswith("{}"),
        "timers_ours": isinstance(timers, SynchronizedWallClockTimer),
        "optimizer_and_offload_share_them": engine.optimizer.timers is timers and offload.timers is timers,
        # DeepSpeed's Timer.stop() appends to event_timers: empty means nobody timed into its group.
        "deepspeeds_timers_untouched_since": not any(t.started_ or t.event_timers
                                                     for t in deepspeeds_timers.get_timers().values()),
        "timer_names": sorted(timers.get_timers()),
    }
    attachment.close()  # every rank changed the engine's timers: every rank has an attachment to close
    findings["timers_given_back"] = engine.timers is deepspeeds_timers and offload.timers is deepspeeds_timers
    return findings


def train(engine, steps: int) -> None:
    for _ in range(steps):
        engine.backward(engine(torch.randn(4, 16)).pow(2).mean())
        engine.step()


def train_limited(records: Path) -> int:
    """An engine whose stage3_max_live_parameters is below the model's size; returns that limit."""
    limit = 400
    model = Net()
    config = ds_config(3, records)
    config["zero_optimization"]["stage3_max_live_parameters"] = limit
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    with ds_profutils.attach(engine, name="limited"):
        train(engine, 4)
    return limit


def rank1_keeps_more_memory(records: Path, rank: int) -> dict:
    """Engine "memory": rank 1 keeps an extra 256 MB tensor alive from global step 3 on (the last engine of
    this process: the RSS it adds stays)."""
    model = Net()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(3, records))
    kept = []
    with ds_profutils.attach(engine, name="memory"):
        for _ in range(6):
            if rank == 1 and engine.global_steps == 3:
                kept.append(torch.ones(64 * 2**20))  # 256 MB, touched
            train(engine, 1)
    return {"from_step": 3, "bytes": 256 * 2**20 if rank == 1 else 0}


def attached_in_phases(records: Path) -> dict:
    """Attach, close, attach the same engine again, then a new engine under the closed one's name."""
    model = Net()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(3, records))
    first = ds_profutils.attach(engine, name="phases")
    train(engine, 2)
    first.close()
    given_back = "step" not in vars(engine) and "forward" not in vars(engine)
    with ds_profutils.attach(engine) as again:  # the same engine keeps its name
        name_kept = again.name == "phases"
        train(engine, 2)
    resumed_model = Net()
    resumed, *_ = deepspeed.initialize(model=resumed_model, model_parameters=resumed_model.parameters(),
                                       config=ds_config(3, records))
    with ds_profutils.attach(resumed, name="phases"):
        train(resumed, 1)
    return {"given_back": given_back, "name_kept": name_kept}


if __name__ == "__main__":
    main()
    print(f"job end: rank {os.environ.get('RANK', 0)}", flush=True)  # run_deepspeed's check reads it (tests/launcher.py)
    if torch.distributed.is_initialized():  # the documented shutdown (README, "On CPU")
        torch.distributed.destroy_process_group()
