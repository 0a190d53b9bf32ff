"""Run under the deepspeed launcher (2 ranks, gloo, 60 s process-group timeout): what fails on one rank of
ds_profutils never stalls, slows or ends the job (issue 32 item 1, issue 37 items 1 and 2).

The job runs with ``DS_PROFUTILS_FOO=1`` in its environment (a variable naming no setting).  ZeRO-2
engines with ``step_metrics`` on, each phase a failure on one rank:

- ``path``: rank 1's records path is a directory; rank 0 reports to a sink that raises and one that keeps
  what it gets.
- ``memory``: rank 1's memory read fails from its third step (the recorder stops there; its live rows
  are empty from then on).
- ``stop``: rank 1's live figures fail at its fourth interval (STOP flag: every rank stops the exchange at
  that interval); and the same on the deferred path, by hand, where it takes effect two intervals later.
- ``group``: a live exchange on a group of rank 1 alone (an engine trained on a subset of the world).
- ``under_file``: ``output_dir`` under a path that is a file; ``read_only``: ``output_dir`` on a read-only
  mount (``--read-only``, when the test could mount one).

Every loop iteration's wall time per rank goes to ``{out}/found_rank_{rank}.json`` with the findings; the
script prints a last-line marker before its documented shutdown.
"""
import argparse
import dataclasses
import json
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import deepspeed
import torch
import torch.distributed as dist

import ds_profutils
from ds_profutils.engine.live import LiveMetrics, StepFigures
from ds_profutils.engine.live.gather import exchange_group

ROWS, TOKENS, VOCAB = 8, 16, 100  # token ids in: the records count tokens, so tokens/s needs every rank's row
SLEEP_S = 0.03  # both ranks, between steps: a step of >= 30 ms, so a stall stands out of any load


class Kept:
    def __init__(self):
        self.writes = []

    def write(self, events):
        self.writes.append({name: value for name, value, _ in events} | {"step": events[0][2]})


class Raising:
    def write(self, events):
        raise OSError("the sink's server is gone")


def engine_for(output_dir, **section):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 64), torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 1))
    config = {"train_micro_batch_size_per_gpu": ROWS, "steps_per_print": 10**6,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": 2},
              "step_metrics": {"enabled": True, "output_dir": str(output_dir), "monitor_interval": 2,
                               "console": False, **section}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train(engine, steps, before_step=lambda step: None):
    """``steps`` steps; each loop iteration's wall time in ms."""
    times = []
    for step in range(steps):
        start = time.perf_counter()
        before_step(step)
        time.sleep(SLEEP_S)
        engine.backward(engine(torch.randint(0, VOCAB, (ROWS, TOKENS))).pow(2).mean())
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def figures(step):
    return StepFigures(step, 50.0, 60.0, 10.0, None, 100, 8, 5.0, 5.0, None)


def phase_path(out, rank, found):
    if rank == 1:
        (out / "path" / "zero_fetch_rank_1.jsonl").mkdir(parents=True)
    dist.barrier()
    engine = engine_for(out / "path", memory=True)
    attachment = ds_profutils.attach(engine)
    kept = Kept()
    if rank == 0:
        attachment.report_to(Raising())
        attachment.report_to(kept)
    found["times"]["path"] = train(engine, 24)
    found["path"] = {"writes": kept.writes, "failed": attachment.recorder.records_file.failed,
                     "group_is_default": exchange_group(engine) is None}
    attachment.close()


def phase_memory(out, rank, found):
    engine = engine_for(out / "memory", memory=True)
    attachment = ds_profutils.attach(engine, name="memory")
    kept = Kept()
    attachment.report_to(kept)
    recorder = attachment.recorder

    def fail_memory(step):
        if rank == 1 and step == 2:
            def read(*args):
                raise OSError("cannot read /proc/self/statm")

            recorder.memory.begin = read

    found["times"]["memory"] = train(engine, 12, fail_memory)
    found["memory"] = {"writes": kept.writes, "recorder_closed": recorder.closed}
    attachment.close()


def phase_stop(out, rank, found):
    engine = engine_for(out / "stop", monitor_interval=1)
    attachment = ds_profutils.attach(engine, name="stop")
    kept = Kept()
    attachment.report_to(kept)
    live = attachment.live
    listeners = attachment.recorder.step_listeners

    def fail_live(step):
        if rank == 1 and step == 3:  # from its fourth step on rank 1's figures cannot be packed
            listeners[0] = lambda figures: live.step_finished(dataclasses.replace(figures, exposed_wait_ms=None))

    found["times"]["stop"] = train(engine, 8, fail_live)
    found["stop"] = {"writes": kept.writes, "stopped": live.stopped, "exchanges": live._gather.launched}
    attachment.close()
    deferred = LiveMetrics(SimpleNamespace(monitor_interval=1, console=False), None, [Kept()], defer=True)
    for step in range(8):
        bad = rank == 1 and step == 3
        deferred.step_finished(dataclasses.replace(figures(step), exposed_wait_ms=None) if bad else figures(step))
    deferred.close()
    found["deferred"] = {"stopped": deferred.stopped, "exchanges": deferred._gather.launched}
    # on the deferred path (each rank may read the rows at another call) with nothing reading them on any rank; with
    # rank 0 giving a sink once the first rows said nobody reads; with a sink on rank 1 alone, which gets no events:
    # every rank stops at the same exchange, two intervals on
    for case in ("none", "late_on_rank_0", "rank_1_only"):
        sinks = [Kept()] if case == "rank_1_only" and rank == 1 else []
        unread = LiveMetrics(SimpleNamespace(monitor_interval=1, console=False), None, sinks, defer=True)
        for step in range(6):
            if case == "late_on_rank_0" and rank == 0 and step == 1:
                unread.add_sink(Kept())
            unread.step_finished(figures(step))
        unread.close()
        found[f"deferred_unread_{case}"] = {"stopped": unread.stopped, "exchanges": unread._gather.launched}


def phase_stop_reading(out, rank, found):
    """Rank 1 fails reading the gathered rows from its fourth step on (not packing its own): it still takes part in
    that interval's exchange, saying stop, so no rank waits for it."""
    engine = engine_for(out / "stop_reading", monitor_interval=1)
    attachment = ds_profutils.attach(engine, name="stop-reading")
    attachment.report_to(Kept())
    live = attachment.live

    def failing_read():
        raise RuntimeError("reading the gathered rows (stand-in)")

    def fail_reading(step):
        if rank == 1 and step == 3:
            live._gather.due = failing_read

    found["times"]["stop_reading"] = train(engine, 8, fail_reading)
    found["stop_reading"] = {"stopped": live.stopped, "exchanges": live._gather.launched}
    attachment.close()


def phase_group(rank, found):
    alone = dist.new_group([1])  # every rank creates it; only rank 1 exchanges on it
    if rank == 1:
        kept = Kept()
        live = LiveMetrics(SimpleNamespace(monitor_interval=1, console=False), None, [kept], group=alone)
        for step in range(3):
            live.step_finished(figures(step))
        live.close()
        found["group"] = {"writes": kept.writes, "ranks": live._gather.ranks}


def phase_output_dir(label, output_dir, found, **section):
    engine = engine_for(output_dir, **section)
    attachment = ds_profutils.attach(engine, name=label.replace("_", "-"))
    found["times"][label] = train(engine, 4)
    found[label] = {"failed": attachment.recorder.records_file.failed, "exchanges": attachment.live._gather.launched}
    attachment.close()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--read-only")
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    found = {"times": {}}
    phase_path(out, rank, found)
    phase_memory(out, rank, found)
    phase_stop(out, rank, found)
    phase_stop_reading(out, rank, found)
    phase_group(rank, found)
    (out / "plain").write_text("a file") if rank == 0 else None
    dist.barrier()
    phase_output_dir("under_file", out / "plain" / "records", found)
    if args.read_only:
        phase_output_dir("read_only", args.read_only, found)
    (out / f"found_rank_{rank}.json").write_text(json.dumps(found))
    print(f"isolation job: rank {rank} reached the end", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
