"""Run under the deepspeed launcher (2 ranks): a transformers Trainer profiled by its one ``attach(trainer)`` line.

The model, data and Trainer arguments are the demo's (examples/train_hf.py: a tiny GPT-2, gradient
accumulation 2, an evaluation every 2 optimizer steps, ZeRO-3 from a ds_config with "auto" values).
One launcher start, three ``train()`` calls:

1. ``train()`` to global step 4, saving a checkpoint there;
2. ``train(resume_from_checkpoint=...)`` to step 8: a new engine, which must append to the first one's
   records.  Findings (the callback's state, the engines it attached to) -> ``{out}/findings_rank_{r}.json``;
3. with ``--until-killed``: resumed again from step 8, training on and printing
   ``rank R finished global step N`` after each optimizer step, until the test SIGTERMs the job.

transformers 5.24 cannot call ``train()`` twice on one DeepSpeed Trainer, profiled or not: Accelerate
frees the first engine at the start of the second call, while the Trainer keeps it as
``model_wrapped`` and so never builds another ("'NoneType' object has no attribute 'backward'").
Pointing ``model_wrapped`` back at the model before each resume makes the Trainer build a new engine,
as its first ``train()`` did.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_hf import RandomTokens, tiny_gpt2, training_arguments  # noqa: E402

from ds_profutils import attach  # noqa: E402

FIRST_STOP, SECOND_STOP = 4, 8


class Watch(TrainerCallback):
    """Notes, after each optimizer step, what the profiling callback holds; with ``say_steps`` also prints the step."""

    def __init__(self, trainer, profiling):
        self.trainer, self.profiling = trainer, profiling
        self.say_steps = False
        self.attached_to_current = []

    def on_step_end(self, args, state, control, **kwargs):
        attachment = self.profiling.attachment
        self.attached_to_current.append(attachment is not None and attachment.engine is self.trainer.model_wrapped)
        if self.say_steps:
            print(f"rank {torch.distributed.get_rank()} finished global step {state.global_step}", flush=True)
            time.sleep(0.3)  # slower than the test's reaction: its SIGTERM lands mid-run


def resume(trainer, checkpoint: Path, max_steps: int):
    trainer.model_wrapped = trainer.model  # transformers 5.24: see the module doc
    trainer.args.max_steps = max_steps
    trainer.train(resume_from_checkpoint=str(checkpoint))
    return trainer.model_wrapped


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--until-killed", action="store_true")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    checkpoints = args.out / "trainer"
    trainer = Trainer(model=tiny_gpt2(),
                      args=training_arguments(str(checkpoints), args.deepspeed, max_steps=FIRST_STOP,
                                              save_strategy="steps", save_steps=FIRST_STOP),
                      train_dataset=RandomTokens(256),
                      eval_dataset=RandomTokens(8, seed=1))
    profiling = attach(trainer)
    watch = Watch(trainer, profiling)
    trainer.add_callback(watch)
    findings = {"attach_again_same": attach(trainer) is profiling}

    trainer.train()
    first = trainer.model_wrapped
    findings["after_first"] = {"name": profiling.name, "attachment": profiling.attachment is not None,
                               "engine_steps": first.global_steps}
    second = resume(trainer, checkpoints / f"checkpoint-{FIRST_STOP}", SECOND_STOP)
    findings["after_second"] = {"name": profiling.name, "attachment": profiling.attachment is not None,
                                "new_engine": second is not first, "engine_steps": second.global_steps,
                                "engine_given_back": "step" not in vars(second)}
    findings["attached_to_current_engine_at_every_step"] = all(watch.attached_to_current)
    findings["steps_watched"] = len(watch.attached_to_current)
    (args.out / f"findings_rank_{torch.distributed.get_rank()}.json").write_text(json.dumps(findings))
    if args.until_killed:
        watch.say_steps = True
        trainer.args.save_strategy = "no"
        resume(trainer, checkpoints / f"checkpoint-{SECOND_STOP}", 10**6)
    # The documented shutdown: gloo's threads left to interpreter teardown can abort the exit
    # ("terminate called without an active exception", docs/integrations.md).
    trainer.end()


if __name__ == "__main__":
    main()
