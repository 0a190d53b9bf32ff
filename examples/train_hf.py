"""A transformers Trainer job with ZeRO-3, profiled by one line: ``attach(trainer)``.

Run it under the launcher (2 ranks, CPU/gloo), as ``python3 -m tox -e demo-hf`` does:

    HF_HUB_OFFLINE=1 deepspeed --num_gpus 2 examples/train_hf.py --deepspeed ds_configs/hf_trainer_zero3.json
    ds-profutils report ./profiler_logs/hf_trainer

A tiny GPT-2 built from a ``GPT2Config`` (random weights: nothing is downloaded) learns random token
sequences.  The Trainer fills the ds_config's ``"auto"`` values from its arguments (gradient
accumulation 2) and evaluates every 2 optimizer steps.  ``attach(trainer)`` reads the
``"partitioned_param_profiler"`` section of that same config: one record per micro step and rank,
evaluation forwards included (``"mode": "eval"``), keyed by the engine's global step; and its
``"profiler"`` section: torch.profiler over optimizer steps 3 and 4, driven by the engine (no
decorator, no ``step_profiler()``), ``ProfilerStep#3`` and ``#4`` in ``trace_rank_{r}.json``.
"""
import argparse
import os

import torch
from accelerate import PartialState
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from ds_profutils import attach

VOCAB = 256
TOKENS = 32  # per sample


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    """Two layers, 64 wide, random weights: enough parameters for ZeRO-3 to partition and fetch."""
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=TOKENS, n_embd=64, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0)
    return GPT2LMHeadModel(config)


class RandomTokens(torch.utils.data.Dataset):
    """``samples`` token sequences, the same ones on every rank and in every run (seeded by index)."""

    def __init__(self, samples: int, seed: int = 0) -> None:
        self.samples = samples
        self.seed = seed

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> dict:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        tokens = torch.randint(0, VOCAB, (TOKENS, ), generator=generator)
        return {"input_ids": tokens, "labels": tokens}


def count_ranks_on_cpu() -> dict:
    """On CPU, have Accelerate count the launcher's ranks; returns the ``accelerator_config`` that says so.

    Accelerate chooses its process-group backend from the device and has none for DeepSpeed without
    a GPU, so each rank would take itself for the only process: every rank would read the whole
    dataset and the Trainer's evaluation would fail gathering the losses.  Setting Accelerate's state
    up with gloo before the ``TrainingArguments``, and telling the Trainer to use it, gives the right
    count.  On GPUs nothing is needed (an empty config).
    """
    if torch.cuda.is_available():
        return {}
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # what the Trainer sets while it builds this state itself
    try:
        PartialState(backend="gloo")
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]
    return {"use_configured_state": True}


def training_arguments(output_dir: str, deepspeed: str, **overrides) -> TrainingArguments:
    """The Trainer's arguments: micro batch 2, gradient accumulation 2, an evaluation every 2 optimizer steps."""
    settings = dict(output_dir=output_dir,
                    deepspeed=deepspeed,
                    per_device_train_batch_size=2,
                    per_device_eval_batch_size=2,
                    gradient_accumulation_steps=2,
                    learning_rate=1e-3,
                    eval_strategy="steps",
                    eval_steps=2,
                    logging_steps=2,
                    save_strategy="no",
                    report_to=[],
                    disable_tqdm=True,
                    accelerator_config=count_ranks_on_cpu())
    settings.update(overrides)
    return TrainingArguments(**settings)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed", required=True, help="the ds_config (json), with \"auto\" values")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps to train")
    parser.add_argument("--output_dir", default="./profiler_logs/hf_trainer_output",
                        help="the Trainer's own output (it saves nothing here: save_strategy \"no\")")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    trainer = Trainer(model=tiny_gpt2(),
                      args=training_arguments(args.output_dir, args.deepspeed, max_steps=args.steps),
                      train_dataset=RandomTokens(256),
                      eval_dataset=RandomTokens(8, seed=1))
    attach(trainer)  # the one line: fetch records, traces (whatever the ds_config asks) for every train()
    trainer.train()
    # Destroys the process group while the interpreter is whole: left to its teardown, gloo's threads can end the
    # process with "terminate called without an active exception" (docs/integrations.md, "Known: an exit ...").
    trainer.end()


if __name__ == "__main__":
    main()
