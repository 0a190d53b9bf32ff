"""Run under the deepspeed launcher (2 ranks, gloo): a transformers Trainer (the demo's tiny GPT-2, ZeRO-2,
gradient accumulation 2, ``step_metrics`` on) whose rank 1 sleeps ``--sleep-s`` in its data collator.

The Trainer loads an optimizer step's batches, then all-gathers their token count (``num_items_in_batch``)
through ``torch.distributed``: rank 0 waits there, between steps, for the late rank 1.  The records go to
``--out``; each rank prints ``trainer_slow_collator done rank R`` last."""
import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import Trainer, default_data_collator

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_hf import RandomTokens, tiny_gpt2, training_arguments  # noqa: E402

from ds_profutils import attach  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--sleep-s", type=float, default=0.08)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    config = {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "steps_per_print": 10**6, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
        "step_metrics": {"enabled": True, "output_dir": args.out, "console": False},
    }
    arguments = training_arguments(str(Path(args.out) / "trainer"), config, max_steps=args.steps,
                                   eval_strategy="no", logging_steps=10**6)
    slow = arguments.process_index == 1

    def collate(samples):
        if slow:
            time.sleep(args.sleep_s)  # a slow input pipeline on rank 1 only
        return default_data_collator(samples)

    trainer = Trainer(model=tiny_gpt2(), args=arguments, train_dataset=RandomTokens(512), data_collator=collate)
    attach(trainer)
    trainer.train()
    print(f"trainer_slow_collator done rank {torch.distributed.get_rank()}", flush=True)
    trainer.end()


if __name__ == "__main__":
    main()
