"""Run under the deepspeed launcher (2 ranks): one process of a preempted Trainer job and its restart.

``--phase first`` trains the demo's Trainer (examples/train_hf.py: tiny GPT-2, gradient accumulation 2,
ZeRO-3 with "auto" values) to global step 8, saving a checkpoint at step 4 (after steps 0-3) -- the
preempted job, which recorded steps 0-7.  ``--phase restart`` is the new process a scheduler starts:
the same script, ``train(resume_from_checkpoint=...)`` from that checkpoint to step 8, so steps 4-7
are trained and recorded a second time.  Each phase writes the global steps its engine ended on to
``{out}/{phase}_rank_{r}.json``.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_hf import RandomTokens, tiny_gpt2, training_arguments  # noqa: E402

from ds_profutils import attach  # noqa: E402

CHECKPOINT_AT, LAST = 4, 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phase", choices=("first", "restart"), required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    checkpoints = args.out / "trainer"
    trainer = Trainer(model=tiny_gpt2(),
                      args=training_arguments(str(checkpoints), args.deepspeed, max_steps=LAST, eval_strategy="no",
                                              save_strategy="steps", save_steps=CHECKPOINT_AT),
                      train_dataset=RandomTokens(256))
    attach(trainer)
    if args.phase == "first":
        trainer.train()
    else:
        trainer.train(resume_from_checkpoint=str(checkpoints / f"checkpoint-{CHECKPOINT_AT}"))
    (args.out / f"{args.phase}_rank_{torch.distributed.get_rank()}.json").write_text(
        json.dumps({"global_steps": trainer.model_wrapped.global_steps}))
    print(f"job end: rank {torch.distributed.get_rank()}", flush=True)  # read by run_deepspeed (tests/launcher.py)
    # The documented shutdown: gloo's threads left to interpreter teardown can abort the exit
    # ("terminate called without an active exception", docs/integrations.md).
    trainer.end()


if __name__ == "__main__":
    main()
