"""Run under the deepspeed launcher (2 ranks, gloo): the straggler's cause and the config advice, one run per case.

Each case trains its own engine (named "job") into ``{out}/{case}``, so each directory is one run the
report reads and the diff compares.  Every forward waits on its "device" for DEVICE_S_PER_TOKEN per token
(a sleep, as a GPU job's host waits for its kernels: two ranks sharing two busy cores then stay even, and
a rank's busy time per token is the same whatever its batch), besides computing for real.

ZeRO-2 with ``step_metrics`` (token ids through an embedding and six linear layers):
  ``even``: both ranks alike; ``more_work``: rank 1's sequences are twice as long;
  ``compute``: rank 1 sleeps COMPUTE_S more in forward; ``input_pipeline``: rank 1 sleeps GAP_S between steps.
ZeRO-3 with ``step_metrics`` and fetch records: ``z3_small_bucket`` with ``stage3_prefetch_bucket_size: 100``,
``z3_default`` with DeepSpeed's default bucket.

Each rank prints ``diagnosis_job: done rank R`` as its last line, before the documented shutdown.
"""
import argparse
import time
from pathlib import Path

import deepspeed
import torch

import ds_profutils

CASES = ("even", "more_work", "compute", "input_pipeline", "z3_small_bucket", "z3_default")
STEPS = {"zero2": 24, "zero3": 30}
DEVICE_S_PER_TOKEN = 1e-4
COMPUTE_S, GAP_S = 0.06, 0.08
ROWS, LENGTH, WIDTH, VOCAB = 4, 64, 128, 1000


class TokenNet(torch.nn.Module):
    """An embedding and six linear layers fed token ids; ``slow_s``: an extra sleep in every forward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.layers = torch.nn.Sequential(*[block for _ in range(6)
                                            for block in (torch.nn.Linear(width, width), torch.nn.ReLU())])
        self.head = torch.nn.Linear(width, 1)
        self.slow_s = 0.0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        time.sleep(ids.numel() * DEVICE_S_PER_TOKEN + self.slow_s)
        return self.head(self.layers(self.embed(ids))).pow(2).mean()


def ds_config(case: str, out: Path) -> dict:
    zero = {"stage": 2}
    sections = {"step_metrics": {"enabled": True, "output_dir": str(out / case), "console": False}}
    if case.startswith("z3"):
        zero = {"stage": 3, **({"stage3_prefetch_bucket_size": 100} if case == "z3_small_bucket" else {})}
        sections["partitioned_param_profiler"] = {"enabled": True, "output_dir": str(out / case)}
    return {"train_micro_batch_size_per_gpu": ROWS, "steps_per_print": 10**6,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": zero, **sections}


def run_case(case: str, out: Path, rank: int) -> None:
    torch.manual_seed(0)
    zero3 = case.startswith("z3")
    model = TokenNet(384 if zero3 else WIDTH)  # ZeRO-3: 384 x 384 layers, above the persistence threshold
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(case, out))
    slowed = rank == 1
    length = LENGTH * (2 if case == "more_work" and slowed else 1) // (2 if zero3 else 1)
    model.slow_s = COMPUTE_S if case == "compute" and slowed else 0.0
    generator = torch.Generator().manual_seed(rank)
    with ds_profutils.attach(engine, name="job"):
        for _ in range(STEPS["zero3" if zero3 else "zero2"]):
            if case == "input_pipeline" and slowed:
                time.sleep(GAP_S)
            loss = engine(torch.randint(0, VOCAB, (ROWS, length), generator=generator))
            engine.backward(loss)
            engine.step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    for case in args.cases.split(","):
        run_case(case, args.out, rank)
    print(f"diagnosis_job: done rank {rank}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
