"""One gloo rank (plain ``python``): ``attach`` leaves the user's objects as they were (issue 32 item 2).

For ZeRO stages 0, 1 and 2, an engine with ``step_metrics`` on trains two steps attached; then
``copy.deepcopy(engine.module)``, a pickle round trip of the module and
``torch.optim.swa_utils.AveragedModel(engine.module)`` (EMA models, teacher copies) must do what they do
without ``attach`` (DeepSpeed's own module hooks are local functions, so pickling fails without us too, and
must fail the same way), the copies' forwards must add no record, and the engine must go on recording.
``close()`` twice is one close.  Both record sections on a ZeRO-2 engine keep the step records.  An eval
forward (an eval-only branch that sleeps ``EVAL_S``) and ``engine.save_checkpoint()`` between two optimizer
steps are named in the next step's record (``eval_ms``, ``save_ms``), and ``close()`` gives the engine its own
``save_checkpoint`` back.  Findings go to the JSON file named by ``--out``.
"""
import argparse
import copy
import json
import pickle
import time
from pathlib import Path

import deepspeed
import torch
from torch.optim.swa_utils import AveragedModel

import ds_profutils


def engine_for(stage, output_dir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "step_metrics": {"enabled": True, "output_dir": str(output_dir), "console": False}})
    return engine


def train(engine, steps):
    for _ in range(steps):
        engine.backward(engine(torch.randn(4, 16)).pow(2).mean())
        engine.step()


def records(path):
    return len(path.read_text().splitlines()) if path.exists() else 0


COPIES = [("deepcopy", copy.deepcopy), ("pickle", lambda module: pickle.loads(pickle.dumps(module))),
          ("averaged", AveragedModel)]


def copy_outcome(make, module, path):
    """What making the copy and running it does: its error, or the records its forward added."""
    try:
        copied = make(module)
        before = records(path)
        copied(torch.randn(4, 16)).sum().backward()
        return {"ok": True, "records_added_by_the_copy": records(path) - before}
    except Exception as exc:  # noqa: BLE001 - the finding is the error
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def copies_of(stage, out):
    unattached = engine_for(stage, out / f"unattached{stage}")
    train(unattached, 1)
    found = {"without_attach": {kind: copy_outcome(make, unattached.module, out / "none") for kind, make in COPIES}}
    engine = engine_for(stage, out / f"stage{stage}")
    attachment = ds_profutils.attach(engine, name=f"stage{stage}")
    path = attachment.recorder.path
    train(engine, 2)
    for kind, make in COPIES:
        found[kind] = copy_outcome(make, engine.module, path)
    before = records(path)
    train(engine, 1)
    found["records_after"] = records(path) - before
    attachment.close()
    attachment.close()
    found["closed_twice"] = attachment.closed
    return found


def both_sections(out):
    """Both record sections on a ZeRO-2 engine: the step records stay, without fetch events."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}, "zero_optimization": {"stage": 2},
        "step_metrics": {"enabled": True, "output_dir": str(out / "both"), "console": False},
        "partitioned_param_profiler": {"enabled": True, "output_dir": str(out / "both")}})
    with ds_profutils.attach(engine, name="both") as attachment:
        train(engine, 2)
        fetches = attachment.recorder.fetches
    first = json.loads(attachment.recorder.path.read_text().splitlines()[0])
    return {"records": records(attachment.recorder.path), "fetches": fetches is not None,
            "config_hash": first["job_config_hash"]}


EVAL_S = 0.08


class EvalSleeps(torch.nn.Module):
    """A model whose eval forwards take EVAL_S longer (an eval loop's extra work)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 1)

    def forward(self, x):
        if not self.training:
            time.sleep(EVAL_S)
        return self.linear(x)


def eval_and_save(out):
    """Train, evaluate, save, train twice on a ZeRO-2 engine: the train records' eval_ms and save_ms."""
    torch.manual_seed(0)
    model = EvalSleeps()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}, "zero_optimization": {"stage": 2},
        "step_metrics": {"enabled": True, "output_dir": str(out / "eval_save"), "console": False}})
    with ds_profutils.attach(engine, name="eval-save") as attachment:
        train(engine, 1)
        engine.eval()
        with torch.no_grad():
            engine(torch.randn(4, 16))
        engine.train()
        saved = engine.save_checkpoint(str(out / "checkpoint"), tag="one")
        wrapped = "save_checkpoint" in vars(engine)
        train(engine, 2)
    lines = [json.loads(line) for line in attachment.recorder.path.read_text().splitlines()]
    return {"train": [{key: line[key] for key in ("global_step", "gap_ms", "eval_ms", "save_ms")}
                      for line in lines if line["mode"] == "train"],
            "saved": saved, "checkpoint": (out / "checkpoint" / "one").is_dir(), "wrapped": wrapped,
            "given_back": "save_checkpoint" not in vars(engine)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    deepspeed.init_distributed(dist_backend="gloo")
    found = {f"stage{stage}": copies_of(stage, out.parent) for stage in (0, 1, 2)}
    found["both_sections"] = both_sections(out.parent)
    found["eval_and_save"] = eval_and_save(out.parent)
    out.write_text(json.dumps(found))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
