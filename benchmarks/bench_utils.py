"""Per-call cost of ds_profutils' hot-path helpers next to DeepSpeed's, measured in the same run.

    python benchmarks/bench_utils.py [--calls 200000] [--repeats 7]

"Cost" is the added cost per call over a bare call (DESIGN.md): time(wrapped) - time(bare).  Each
figure is the median of interleaved repeats, so a noisy neighbour hits both sides alike.
Prints, for ``instrument_w_nvtx`` (no NVTX tool attached, no profiler recording: the state of a
production job) and for ``log_dist`` filtered out by level and by rank, our cost, DeepSpeed's, and
the ratios the design asks for.
"""
import argparse
import logging
import statistics
import time
from typing import Callable, Dict, List

from deepspeed import comm as ds_comm
from deepspeed.utils import log_dist as ds_log_dist
from deepspeed.utils.nvtx import instrument_w_nvtx as ds_instrument_w_nvtx

from ds_profutils import instrument_w_nvtx, log_dist


def bare(x):
    return x


def pass_through(fn: Callable) -> Callable:
    """The floor for any call-time wrapper: forwards and does nothing else."""

    def w(*a, **k):
        return fn(*a, **k)

    return w


def time_loop(fn: Callable, calls: int) -> float:
    """Seconds per call of ``fn(1)``, loop overhead included (it cancels in differences)."""
    start = time.perf_counter()
    for _ in range(calls):
        fn(1)
    return (time.perf_counter() - start) / calls


def measure(candidates: Dict[str, Callable], calls: int, repeats: int) -> Dict[str, float]:
    """Median ns per call of each candidate, repeats interleaved."""
    samples: Dict[str, List[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            samples[name].append(time_loop(fn, calls) * 1e9)
    return {name: statistics.median(values) for name, values in samples.items()}


def bench_nvtx(calls: int, repeats: int) -> None:
    ns = measure(
        {
            "bare": bare,
            "pass-through wrapper": pass_through(bare),
            "ds_profutils instrument_w_nvtx": instrument_w_nvtx(bare),
            "deepspeed instrument_w_nvtx": ds_instrument_w_nvtx(bare),
        }, calls, repeats)
    added = {name: ns[name] - ns["bare"] for name in ns if name != "bare"}
    print("instrument_w_nvtx, no tool attached (added ns per call over a bare call)")
    for name, value in added.items():
        print(f"  {name:34s} {value:8.1f} ns")
    ours = added["ds_profutils instrument_w_nvtx"]
    print(f"  ratio vs pass-through wrapper      {ours / added['pass-through wrapper']:8.2f}x  (target <= 1.3x)")
    print(f"  ratio vs DeepSpeed                 {ours / added['deepspeed instrument_w_nvtx']:8.2f}x  "
          "(target <= 0.25x)")


def bench_log_dist(calls: int, repeats: int) -> None:
    """Filtered-out calls: by level (DEBUG under WARNING) and by rank (a rank list without ours)."""
    ds_comm_is_initialized, ds_comm_get_rank = ds_comm.is_initialized, ds_comm.get_rank
    ds_comm.is_initialized, ds_comm.get_rank = (lambda: True), (lambda group=None: 1)
    try:
        ns = measure(
            {
                "ours, by level": lambda m: log_dist(m, ranks=[0], level=logging.DEBUG),
                "deepspeed, by level": lambda m: ds_log_dist(m, ranks=[0], level=logging.DEBUG),
                "ours, by rank": lambda m: log_dist(m, ranks=[0], level=logging.WARNING),
                "deepspeed, by rank": lambda m: ds_log_dist(m, ranks=[0], level=logging.WARNING),
            }, calls, repeats)
    finally:
        ds_comm.is_initialized, ds_comm.get_rank = ds_comm_is_initialized, ds_comm_get_rank
    print("log_dist filtered out (ns per call, rank 1 of an initialized job)")
    for name, value in ns.items():
        print(f"  {name:34s} {value:8.1f} ns")
    for how in ("by level", "by rank"):
        print(f"  ratio {how:28s} {ns['ours, ' + how] / ns['deepspeed, ' + how]:8.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    bench_nvtx(args.calls, args.repeats)
    bench_log_dist(args.calls // 4, args.repeats)


if __name__ == "__main__":
    main()
