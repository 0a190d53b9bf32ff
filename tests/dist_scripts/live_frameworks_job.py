"""The live events in a framework's own reporting, from its one ``attach`` line (or callback), under the
framework's real launcher: 2 ranks on gloo, ZeRO-2, ``"step_metrics"`` on (``monitor_interval`` 2,
``peak_tflops`` set), 8 optimizer steps of 2 micro steps each.

``live_frameworks_job.py trainer --out OUT`` (under the ``deepspeed`` launcher): the demo's transformers
Trainer (examples/train_hf.py: tiny GPT-2) with ``report_to=["tensorboard"]`` and ``attach(trainer)``;
its TensorBoard files go under ``OUT/trainer``.

``live_frameworks_job.py accelerate --out OUT`` (under ``accelerate launch --use_deepspeed
--deepspeed_config_file OUT/ds_config.json``, written by :func:`accelerate_config`): the Accelerate
loop of accelerate_job.py with a TensorBoard tracker (``project_dir`` ``OUT/accelerate``), whose
``init_trackers`` runs after ``attach(accelerator)``: the sink finds the tracker when it writes.
The ds_config also enables DeepSpeed's ``csv_monitor`` (``OUT/csv``).

``live_frameworks_job.py lightning --out OUT`` (one process per rank, the rank in the environment, as
lightning_job.py): a Lightning Trainer with ``DeepSpeedStrategy`` (its CUDA check bypassed as there),
``ProfUtilsCallback()`` and a ``TensorBoardLogger`` (``OUT/lightning``), on a model of token ids.

Each rank writes ``OUT/findings_rank_{r}.json``: whether the attachment was given back at the end, and
what the framework kept of its own logging.
"""
import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "examples"))
from train_hf import VOCAB, RandomTokens, tiny_gpt2, training_arguments  # noqa: E402

from ds_profutils import attach  # noqa: E402

STEPS = 8  # optimizer steps
ACCUMULATE = 2  # micro steps per optimizer step
INTERVAL = 2  # step_metrics.monitor_interval
PEAK_TFLOPS = 0.01  # the tiny models on a CPU reach a share of it that shows


def step_metrics(out: Path) -> dict:
    return {"enabled": True, "output_dir": str(out / "records"), "monitor_interval": INTERVAL,
            "peak_tflops": PEAK_TFLOPS}


def trainer_config(out: Path) -> dict:
    """The demo's Trainer config ("auto" values) on ZeRO-2, without its scheduler and our other sections."""
    config = json.loads((HERE.parents[1] / "ds_configs" / "hf_trainer_zero3.json").read_text())
    for key in ("scheduler", "partitioned_param_profiler", "profiler"):
        del config[key]
    config["zero_optimization"] = {"stage": 2, "reduce_bucket_size": "auto"}
    return {**config, "step_metrics": step_metrics(out)}


def accelerate_config(out: Path) -> dict:
    """For ``accelerate launch --deepspeed_config_file``: the optimizer is made in code."""
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ACCUMULATE, "steps_per_print": 10**6,
            "zero_optimization": {"stage": 2},
            "csv_monitor": {"enabled": True, "output_path": str(out / "csv"), "job_name": "live"},
            "step_metrics": step_metrics(out)}


def lightning_config(out: Path) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": 2}, "step_metrics": step_metrics(out)}


def run_trainer(out: Path) -> dict:
    from transformers import Trainer

    trainer = Trainer(model=tiny_gpt2(),
                      args=training_arguments(str(out / "trainer"), trainer_config(out), max_steps=STEPS,
                                              eval_strategy="no", report_to=["tensorboard"]),
                      train_dataset=RandomTokens(256))
    profiling = attach(trainer)  # the one line
    trainer.train()
    logged = sorted({key for entry in trainer.state.log_history for key in entry})
    rank = torch.distributed.get_rank()
    # The documented shutdown: gloo's threads left to interpreter teardown can abort the exit
    # ("terminate called without an active exception", docs/integrations.md).
    trainer.end()
    return rank, {"given_back": profiling.attachment is None, "log_history_keys": logged}


def run_accelerate(out: Path) -> dict:
    from accelerate import Accelerator, InitProcessGroupKwargs
    from accelerate_job import train

    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATE, log_with="tensorboard",
                              project_dir=str(out / "accelerate"),
                              kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(RandomTokens(256), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = itertools.chain.from_iterable(itertools.repeat(loader))
    eval_batch = {"input_ids": RandomTokens(2, seed=1)[0]["input_ids"].unsqueeze(0)}
    attachment = attach(accelerator)
    same = attach(accelerator) is attachment  # attached again: the same attachment, no second sink
    accelerator.init_trackers("live")  # after attach: the sink looks for trackers when it writes
    train(accelerator, model, optimizer, batches, eval_batch, STEPS)
    attachment.close()
    accelerator.end_training()  # closes the trackers and the process group
    return accelerator.process_index, {"given_back": "step" not in vars(model), "attach_again_same": same}


def run_lightning(out: Path) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.loggers import TensorBoardLogger
    from lightning.pytorch.strategies import deepspeed as strategies

    from ds_profutils.integrations.lightning import ProfUtilsCallback

    strategies.CUDAAccelerator = (strategies.CUDAAccelerator, CPUAccelerator)  # the CUDA check, bypassed

    class NextToken(pl.LightningModule):

        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, 32)
            self.head = torch.nn.Linear(32, VOCAB)

        def forward(self, input_ids):
            return self.head(torch.relu(self.embed(input_ids)))

        def training_step(self, batch, index):
            tokens = batch["input_ids"]
            return torch.nn.functional.cross_entropy(self(tokens).flatten(0, 1), batch["labels"].flatten())

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    callback = ProfUtilsCallback()
    strategy = strategies.DeepSpeedStrategy(config=lightning_config(out), parallel_devices=[torch.device("cpu", 0)])
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=strategy, callbacks=[callback],
                         max_steps=STEPS, accumulate_grad_batches=ACCUMULATE,
                         logger=TensorBoardLogger(out / "lightning"), enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    torch.manual_seed(0)
    trainer.fit(NextToken(), torch.utils.data.DataLoader(RandomTokens(256), batch_size=4))
    return trainer.global_rank, {"given_back": callback.attachment is None}


JOBS = {"trainer": run_trainer, "accelerate": run_accelerate, "lightning": run_lightning}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=list(JOBS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    rank, findings = JOBS[args.framework](args.out)
    (args.out / f"findings_rank_{rank}.json").write_text(json.dumps(findings))


if __name__ == "__main__":
    main()
    print(f"job end: rank {os.environ.get('RANK', 0)}", flush=True)  # read by tests/launcher.py
    if torch.distributed.is_initialized():  # the documented shutdown (README, "On CPU"); Lightning's is ours to do
        torch.distributed.destroy_process_group()
