"""A Lightning ``Trainer`` with ``DeepSpeedStrategy`` (ZeRO-3) and ds_profutils' ``ProfUtilsCallback``,
in both namespaces: ``lightning.pytorch`` then ``pytorch_lightning``, one ``fit()`` each (plus a
second ``fit()`` of the first Trainer, a resumed run), in the same processes.

Run as one process per rank with the rank in the environment (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
``NODE_RANK``/``MASTER_*``; Lightning takes processes started that way as its own).  The test starts
two "nodes" of one device each: both processes have local rank 0, global ranks 0 and 1.

``--bypass-cuda-check`` (the CPU test): ``DeepSpeedStrategy`` refuses any accelerator but CUDA in
``setup_environment``; the check alone is bypassed, by letting its ``isinstance`` also accept the CPU
accelerator.  Everything else is Lightning's and DeepSpeed's own (the strategy's device-index check
is met by naming the device ``cpu:0``).  Without the flag the run uses CUDA, unpatched (tests/gpu).
Findings -> ``{out}/findings_rank_{r}.json``; records -> ``{out}/records``.
"""
import os
import argparse
import importlib
import json
from pathlib import Path

import torch

NAMESPACES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}
TRAIN_BATCHES = 8  # micro steps; 4 optimizer steps with accumulate_grad_batches=2
ACCUMULATE = 2


def ds_config(records: Path) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**6,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "partitioned_param_profiler": {"enabled": True, "output_dir": str(records), "log_interval": 1, "memory": True},
    }


def fit_in(package: str, out: Path, cuda: bool) -> dict:
    """Two ``fit()`` calls of one Trainer of ``package``'s namespace; what its callback did."""
    pl = importlib.import_module(NAMESPACES[package])
    strategies = importlib.import_module(f"{NAMESPACES[package]}.strategies.deepspeed")
    callback_module = importlib.import_module(f"ds_profutils.integrations.{package}")
    if not cuda:
        cpu = importlib.import_module(f"{NAMESPACES[package]}.accelerators").CPUAccelerator
        strategies.CUDAAccelerator = (strategies.CUDAAccelerator, cpu)  # the strategy's CUDA check, bypassed

    class Regression(pl.LightningModule):

        def __init__(self):
            super().__init__()
            self.encoder = torch.nn.Linear(16, 32)
            self.head = torch.nn.Linear(32, 1)

        def forward(self, features):
            return self.head(torch.relu(self.encoder(features)))

        def training_step(self, batch, index):
            features, = batch
            return torch.nn.functional.mse_loss(self(features), features.sum(dim=1, keepdim=True))

        def validation_step(self, batch, index):
            return self.training_step(batch, index)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    data = torch.utils.data.TensorDataset(torch.randn(256, 16, generator=torch.Generator().manual_seed(0)))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    callback = callback_module.ProfUtilsCallback(name=package.replace("_", "-"))
    devices = dict(accelerator="cuda", devices=1) if cuda else dict(
        accelerator="cpu", devices=1, num_nodes=2)
    strategy = strategies.DeepSpeedStrategy(config=ds_config(out / "records"),
                                            parallel_devices=None if cuda else [torch.device("cpu", 0)])
    trainer = pl.Trainer(**devices, strategy=strategy, callbacks=[callback], max_steps=TRAIN_BATCHES // ACCUMULATE,
                         accumulate_grad_batches=ACCUMULATE, val_check_interval=4, limit_val_batches=1,
                         num_sanity_val_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    model = Regression()
    trainer.fit(model, loader, loader)
    first = trainer.strategy.deepspeed_engine
    found = {"name": callback.name, "closed_after_fit": callback.attachment is None,
             "global_rank": trainer.global_rank, "local_rank": trainer.local_rank,
             "engine_steps": first.global_steps}
    trainer.fit_loop.epoch_loop.max_steps = 2 * TRAIN_BATCHES // ACCUMULATE
    trainer.fit(model, loader, loader)
    found["second_fit"] = {"new_engine": trainer.strategy.deepspeed_engine is not first,
                           "closed_after_fit": callback.attachment is None,
                           "engine_steps": trainer.strategy.deepspeed_engine.global_steps}
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--bypass-cuda-check", action="store_true")
    args = parser.parse_args()
    cuda = not args.bypass_cuda_check
    findings = {package: fit_in(package, args.out, cuda) for package in NAMESPACES}
    rank = torch.distributed.get_rank()
    (args.out / f"findings_rank_{rank}.json").write_text(json.dumps(findings))


if __name__ == "__main__":
    main()
    print(f"job end: rank {os.environ.get('RANK', 0)}", flush=True)  # run_deepspeed's check reads it (tests/launcher.py)
    if torch.distributed.is_initialized():  # the documented shutdown (README, "On CPU")
        torch.distributed.destroy_process_group()
