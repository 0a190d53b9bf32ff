"""What instrumentation costs on a GPU, measured against DeepSpeed in one run (needs CUDA; one GPU).

    python benchmarks/bench_gpu.py [--pairs 100000] [--repeats 15] [--turns 100] [--shapes 16x2048,2048x4096]

(a) ``timers(name).start()`` + ``.stop()`` as the engine calls it, garbage collector on: ds_profutils'
    timer group against DeepSpeed's ``SynchronizedWallClockTimer``, both on CUDA events (target <= 0.9x),
    and the memory each holds after all the pairs (ours bounded).
(b) A ZeRO-3 training step on one GPU (world size 1, NCCL), fetch records on (``attach``) against off, as
    the CPU step benchmarks time it: per turn and mode, attach, ten steps untimed (the attach's warm-up),
    then steps 11-20 timed as one block between two ``torch.cuda.synchronize()`` (the device's work
    included), close; the modes alternate, the order flipping each turn; the figure is the median over
    the turns of on/off (target <= 1.01x).  One line per ``--shapes`` entry (micro batch x layer width): the
    first, 16 x 2048, is host-bound (the device waits for Python between kernels, so every microsecond of ours
    shows: the target's case); a wider one keeps the device busy while the host runs ahead, as a large
    model's step does, and shows what the records cost there.
"""
from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import tempfile
import time
import tracemalloc
from typing import Any, Dict, List

TIMER_TARGET, STEP_TARGET = 0.9, 1.01
WARM_STEPS, BLOCK_STEPS = 10, 10


def timer_pairs(timers: Any, pairs: int) -> float:
    began = time.perf_counter()
    for _ in range(pairs):
        timers("fwd").start()
        timers("fwd").stop()
    return time.perf_counter() - began


def bench_timer(pairs: int, repeats: int) -> float:
    import torch
    from deepspeed.utils.timer import SynchronizedWallClockTimer as DeepSpeeds

    from ds_profutils.timer import SynchronizedWallClockTimer as Ours

    samples: Dict[str, List[float]] = {"deepspeed": [], "ds_profutils": []}
    for _ in range(repeats):
        for name, group in (("deepspeed", DeepSpeeds()), ("ds_profutils", Ours())):
            seconds = timer_pairs(group, pairs)
            torch.cuda.synchronize()
            group("fwd").elapsed()  # what a log reads; not timed
            samples[name].append(seconds / pairs * 1e9)
    ns = {name: statistics.median(values) for name, values in samples.items()}
    ratio = ns["ds_profutils"] / ns["deepspeed"]
    print(f"(a) timers(name).start()+stop() on CUDA events, gc on, ns per pair (median of {repeats} repeats of "
          f"{pairs:,})")
    for name, value in ns.items():
        print(f"    {name:14s} {value:8.1f} ns")
    print(f"    ours vs DeepSpeed's {ratio:5.2f}x  (target <= {TIMER_TARGET}x)")
    for name, group in (("deepspeed", DeepSpeeds()), ("ds_profutils", Ours())):
        tracemalloc.start()
        timer_pairs(group, pairs)
        print(f"    {name:14s} memory after {pairs:,} pairs: {tracemalloc.get_traced_memory()[0]:>12,} bytes")
        tracemalloc.stop()
    return ratio


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bench_step(turns: int, batch_size: int, width: int) -> float:
    import deepspeed
    import torch

    from ds_profutils import attach

    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(_free_port())})
    deepspeed.init_distributed(dist_backend="nccl")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(16)])
    with tempfile.TemporaryDirectory() as out:
        config = {
            "train_micro_batch_size_per_gpu": batch_size,
            "steps_per_print": 10**9,
            # torch's Adam: DeepSpeed's fused Adam is a JIT build of minutes (and 0.19.8's fails on "9.0a" in
            # TORCH_CUDA_ARCH_LIST); the optimizer is the same on both sides of the ratio.
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "partitioned_param_profiler": {"enabled": True, "output_dir": out},
        }
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        batch = torch.randn(batch_size, width, device="cuda")

        def block(steps: int) -> float:
            """Seconds a step over ``steps`` steps timed as one, the device's work included."""
            torch.cuda.synchronize()
            began = time.perf_counter()
            for _ in range(steps):
                engine.backward(engine(batch).pow(2).mean())
                engine.step()
            torch.cuda.synchronize()
            return (time.perf_counter() - began) / steps

        block(WARM_STEPS)
        seconds: Dict[str, List[float]] = {"off": [], "on": []}
        for turn in range(turns):
            for mode in (("off", "on") if turn % 2 == 0 else ("on", "off")):
                attachment = attach(engine) if mode == "on" else None
                gc.collect(1)  # attach's and close's garbage: a job's once, not its steps'
                block(WARM_STEPS)  # the attach's warm-up: the shape's FLOP count, the file's opening
                seconds[mode].append(block(BLOCK_STEPS))
                if attachment is not None:
                    attachment.close()
    ratio = statistics.median(on / off for off, on in zip(seconds["off"], seconds["on"]))
    print(f"(b) ZeRO-3 step on one GPU, 16 Linear({width}), micro batch {batch_size}, steps {WARM_STEPS + 1}-"
          f"{WARM_STEPS + BLOCK_STEPS} after attach, {turns} interleaved turns: off "
          f"{statistics.median(seconds['off']) * 1e3:.2f} ms, on {statistics.median(seconds['on']) * 1e3:.2f} ms a "
          f"step, ratio {ratio:.3f}x  (target <= {STEP_TARGET}x)")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--shapes", default="16x2048", help="micro batch x layer width, comma-separated")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    bench_timer(args.pairs, args.repeats)
    for shape in args.shapes.split(","):
        batch_size, width = (int(number) for number in shape.split("x"))
        bench_step(args.turns, batch_size, width)


if __name__ == "__main__":
    main()
