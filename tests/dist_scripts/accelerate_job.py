"""Run under ``accelerate launch --use_deepspeed --deepspeed_config_file ...`` (2 processes): an Accelerate
training loop profiled by its one ``attach(accelerator)`` line.

The demo's tiny GPT-2 (examples/train_hf.py) with an AdamW made in code (the ds_config has no
optimizer), gradient accumulation 2 through ``accelerator.accumulate``, ``optimizer.step()`` called
as Accelerate's examples do (a no-op under DeepSpeed), an evaluation forward after every 2 optimizer
steps.  One launcher start, three phases:

1. 4 optimizer steps, then ``close()``;
2. ``attach(accelerator)`` again (the same engine: its records are appended), 4 more steps, ``close()``.
   Findings -> ``{out}/findings_rank_{r}.json``;
3. with ``--until-killed``: attached again, training on and printing ``rank R finished global step N``
   after each optimizer step, until the test SIGTERMs the job.

``InitProcessGroupKwargs(backend="gloo")``: on CPU, Accelerate has no process-group backend of its own
for DeepSpeed and would count one process per rank (see ``count_ranks_on_cpu`` in the demo).
``cpu=True`` is not passed: it switches DeepSpeed off.
"""
import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator, InitProcessGroupKwargs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_hf import RandomTokens, tiny_gpt2  # noqa: E402

from ds_profutils import attach  # noqa: E402

STEPS_PER_PHASE = 4
EVAL_EVERY = 2


def train(accelerator, model, optimizer, batches, eval_batch, steps: int, say_steps: bool = False) -> None:
    """``steps`` optimizer steps of 2 micro steps each, and an eval forward after every ``EVAL_EVERY``."""
    engine = accelerator.deepspeed_engine_wrapped.engine
    stop = engine.global_steps + steps
    while engine.global_steps < stop:
        with accelerator.accumulate(model):
            loss = model(**next(batches)).loss
            accelerator.backward(loss)  # engine.backward, and engine.step() at the accumulation boundary
            optimizer.step()  # Accelerate's DeepSpeed optimizer wrapper: does nothing
            optimizer.zero_grad()
        if not accelerator.sync_gradients:
            continue
        if engine.global_steps % EVAL_EVERY == 0:
            model.eval()
            with torch.no_grad():
                model(**eval_batch)
            model.train()
        if say_steps:
            print(f"rank {accelerator.process_index} finished global step {engine.global_steps}", flush=True)
            time.sleep(0.3)  # slower than the test's reaction: its SIGTERM lands mid-run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--until-killed", action="store_true")
    args = parser.parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=2, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(RandomTokens(256), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = itertools.chain.from_iterable(itertools.repeat(loader))
    eval_batch = {"input_ids": RandomTokens(2, seed=1)[0]["input_ids"].unsqueeze(0)}

    attachment = attach(accelerator)
    findings = {"attach_again_same": attach(accelerator) is attachment, "name": attachment.name,
                "engine_is_the_prepared_model": attachment.engine is model}
    train(accelerator, model, optimizer, batches, eval_batch, STEPS_PER_PHASE)
    attachment.close()
    again = attach(accelerator)
    findings["second"] = {"new_attachment": again is not attachment, "name": again.name}
    train(accelerator, model, optimizer, batches, eval_batch, STEPS_PER_PHASE)
    again.close()
    findings["engine_steps"] = model.global_steps
    (args.out / f"findings_rank_{accelerator.process_index}.json").write_text(json.dumps(findings))
    if args.until_killed:
        attach(accelerator)
        train(accelerator, model, optimizer, batches, eval_batch, 10**6, say_steps=True)
    # The documented shutdown: gloo's threads left to interpreter teardown can abort the exit
    # ("terminate called without an active exception", docs/integrations.md).
    accelerator.end_training()


if __name__ == "__main__":
    main()
