"""The engine the step benchmarks train, built the one way, and the interleaved turns they time it in
(imported by the workers they start under the launcher).

A 12-layer MLP of 128-wide linears on 2 gloo ranks, micro batch 8, Adam; each benchmark adds the
ZeRO section and the ds_config sections it measures.  One definition, so the step ratios of
bench_zero_fetch.py, bench_step_metrics.py and bench_live.py are taken on the same model.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

MICRO_BATCH, WIDTH, LAYERS = 8, 128, 12
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the launcher the tests start their jobs with


def ranks_figures(script: Path, args: List[str], timeout: float) -> Dict[int, Any]:
    """Run ``script`` on 2 ranks under the deepspeed launcher with ``--worker DIR`` and ``args``; each rank's worker
    writes its figures to ``DIR/rank_{r}.json``, returned by rank.  The exit code is not checked: gloo's teardown
    abort (-6) after both ranks wrote their figures is no failure of the run; a rank that wrote none is."""
    from launcher import run_deepspeed  # tests/, on the path below

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        done = run_deepspeed(script, ["--worker", str(out), *args], timeout=timeout, check=False)
        files = {rank: out / f"rank_{rank}.json" for rank in (0, 1)}
        if not all(path.exists() for path in files.values()):
            raise AssertionError(f"a rank wrote no figures (exit {done.returncode}):\n{done.stdout[-4000:]}")
        return {rank: json.loads(path.read_text()) for rank, path in files.items()}


def turns_and_runs_main(description: str, worker: Callable[[Path, int], None], bench: Callable[[int, int], Any],
                        modes: str) -> None:
    """The command line of a benchmark of ``--turns`` interleaved turns of ``modes`` in each of ``--runs`` launcher
    jobs: ``bench(turns, runs)`` starts them; under the launcher (``--worker DIR``) each rank runs
    ``worker(DIR, turns)``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--turns", type=int, default=200, help=f"interleaved turns of {modes} per run")
    parser.add_argument("--runs", type=int, default=3, help="launcher jobs (the figure: the median of theirs)")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.turns)
    else:
        bench(args.turns, args.runs)


def mlp_engine(zero_optimization: Dict[str, Any], **sections: Any) -> Tuple[Any, Any, int, Dict[str, Any]]:
    """(engine, a batch, this rank, its ds_config) after ``deepspeed.init_distributed`` on gloo."""
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "steps_per_print": 10**9,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": zero_optimization,
        **sections,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, torch.randn(MICRO_BATCH, WIDTH), torch.distributed.get_rank(), config


Seconds = Dict[str, List[float]]


def attach_turns(engine: Any, batch: Any, turns: int, attach_for: Dict[str, Callable[[], Any]],
                 before_close: Callable[[Any], None] = lambda attachment: None,
                 cpu_seconds: Optional[Seconds] = None, steady: Optional[Dict[str, Seconds]] = None,
                 warm_steps: int = 8, block_steps: int = 10) -> Tuple[Seconds, Seconds]:
    """Time ``engine``'s training step in each mode of ``attach_for`` (mode -> the call that attaches for it,
    returning the attachment or None), ``turns`` times, the modes interleaved so a neighbour's load hits
    them alike (each mode first, second, ... in turn).  Per mode and turn: attach, collect the garbage
    (attach and close are a job's once, not its steps', so neither is timed), time two steps, call
    ``before_close`` with the attachment, close it.  That untimed collection takes the young generations only
    (attach's and close's garbage is young), so a turn does not pay a full collection of the torch and DeepSpeed
    heap; the job's heap is left as a job's is (no ``gc.freeze``), full collections coming when the collector's
    own thresholds say.  Returns (the second steps' seconds,
    the first steps' seconds) per mode: the first step pays what a job pays once per attach (a recorder's first
    record, a new shape's FLOP count), the second is the per-step cost.  ``cpu_seconds``, when given, gets the
    second steps' CPU seconds of this thread per mode: what a loaded machine's waits for a CPU do not stretch
    (on 2 cores shared with other jobs a step's wall time is mostly waiting, where added CPU work is not).
    ``steady``, when given, gets under "wall" and "cpu" per mode the mean seconds of a step in a block of
    ``block_steps`` steps timed as one after ``warm_steps`` more untimed ones (and under "process" the CPU seconds
    of every thread of the process in that block: gloo's and any of ours too): a job's steps long after its one
    attach (the second step after attach still pays part of the attach's warm-up), with whatever the records
    do once per interval of ``block_steps`` (the live gather) spread over the steps."""
    cpu: Seconds = cpu_seconds if cpu_seconds is not None else {}
    last_cpu = [0.0]

    def step() -> float:
        began, began_cpu = time.perf_counter(), time.thread_time()
        engine.backward(engine(batch).pow(2).mean())
        engine.step()
        last_cpu[0] = time.thread_time() - began_cpu
        return time.perf_counter() - began

    for _ in range(5):
        step()
    modes = list(attach_for)
    seconds: Seconds = {mode: [] for mode in modes}
    first_steps: Seconds = {mode: [] for mode in modes}
    for turn in range(turns):
        shift = turn % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            attachment = attach_for[mode]()
            gc.collect(1)
            first_steps[mode].append(step())
            seconds[mode].append(step())
            cpu.setdefault(mode, []).append(last_cpu[0])
            if steady is not None:
                for _ in range(warm_steps):
                    step()
                began, began_cpu, began_process = time.perf_counter(), time.thread_time(), time.process_time()
                for _ in range(block_steps):
                    step()
                steady.setdefault("wall", {}).setdefault(mode, []).append((time.perf_counter() - began) / block_steps)
                steady.setdefault("cpu", {}).setdefault(mode, []).append((time.thread_time() - began_cpu) / block_steps)
                steady.setdefault("process", {}).setdefault(mode, []).append(
                    (time.process_time() - began_process) / block_steps)
            if attachment is not None:
                before_close(attachment)
                attachment.close()
    return seconds, first_steps
