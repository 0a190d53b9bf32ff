"""Run under the deepspeed launcher (2 ranks, gloo): a ZeRO-2 job with ``step_metrics.hang_timeout_s`` whose rank
``--sleep-rank`` sleeps ``--sleep-s`` seconds before the forward of global step ``--sleep-step`` (a rank that
never arrives), or, with ``--sleep-s 0``, trains ``--steps`` steps and ends as documented.  Records and hang files
go to ``--out``; each rank prints ``hang_job sleeping`` before its sleep and ``hang_job done rank R`` last."""
import argparse
import time

import deepspeed
import torch

import ds_profutils

ROWS, FEATURES = 8, 64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sleep-rank", type=int, default=1)
    parser.add_argument("--sleep-step", type=int, default=6)
    parser.add_argument("--sleep-s", type=float, default=0.0)
    parser.add_argument("--timeout-s", type=int, default=5)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    config = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": 2},
              "step_metrics": {"enabled": True, "output_dir": args.out, "console": False,
                               "hang_timeout_s": args.timeout_s}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    attachment = ds_profutils.attach(engine)
    for _ in range(args.steps):
        if args.sleep_s and rank == args.sleep_rank and engine.global_steps == args.sleep_step:
            print("hang_job sleeping", flush=True)
            time.sleep(args.sleep_s)
        loss = engine(torch.randn(ROWS, FEATURES)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    attachment.close()
    print(f"hang_job done rank {rank}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
