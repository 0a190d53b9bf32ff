"""What FLOP counting costs a micro step: paid once per input shape, a lookup afterwards (one run, GC on).

    python benchmarks/bench_flops.py [--reps 30]

A tiny GPT-2 (random weights, 2 layers, 4 x 64 tokens) trains plain torch micro steps (forward and
backward) with :class:`~ds_profutils.engine.throughput.flops.FlopCounter` on its hooks as the engine hub puts them.
Interleaved, median of ``--reps``: (a) no counter; (b) the counter, a known shape (the shape key and one
dict lookup); (c) the counter, a new shape (a fresh counter each time: the counting mode inside the
forward and inside each backward node of its graph).  Also (d) the counter's own work per known micro step, its four calls timed alone.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Callable, List

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from ds_profutils.engine.throughput.flops import FlopCounter


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=128, n_positions=64))


class Wired:
    """A counter on the model's hooks (pre-hook with kwargs, ahead of the others; forward hook)."""

    def __init__(self, model: torch.nn.Module, counter: FlopCounter) -> None:
        self.counter = counter
        self.handles = [
            model.register_forward_pre_hook(lambda m, a, k: self.counter.forward_started(m, a, k), with_kwargs=True,
                                            prepend=True),
            model.register_forward_hook(lambda m, a, o: self.counter.forward_ended(o)),
        ]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def micro_step(model: torch.nn.Module, ids: torch.Tensor, counter: FlopCounter = None) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    if counter is not None:
        counter.backward_ended()
        counter.figures()


def timed(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=30)
    reps = parser.parse_args().reps
    torch.set_num_threads(1)
    gc.enable()
    model = tiny_gpt2()
    ids = torch.randint(0, 128, (4, 64))
    counter = FlopCounter()
    wired = Wired(model, counter)
    micro_step(model, ids, counter)  # counted once: the shape is known from here on
    wired.remove()
    plain: List[float] = []
    known: List[float] = []
    counted: List[float] = []
    for _ in range(reps):
        plain.append(timed(lambda: micro_step(model, ids)))
        wired = Wired(model, counter)
        known.append(timed(lambda: micro_step(model, ids, counter)))
        wired.remove()
        fresh = Wired(model, FlopCounter())
        counted.append(timed(lambda: micro_step(model, ids, fresh.counter)))
        assert fresh.counter.counting_attempts == 1 and not fresh.counter.counting
        fresh.remove()
    assert counter.counting_attempts == 1  # every known micro step was a lookup
    base = statistics.median(plain)
    print(f"tiny GPT-2 micro step (4 x 64 tokens, forward and backward, 1 thread), median of {reps}, interleaved:")
    print(f"  (a) no counter          {base * 1e3:8.2f} ms")
    print(f"  (b) known shape         {statistics.median(known) * 1e3:8.2f} ms  "
          f"{statistics.median(known) / base:5.2f}x")
    print(f"  (c) new shape, counted  {statistics.median(counted) * 1e3:8.2f} ms  "
          f"{statistics.median(counted) / base:5.2f}x")
    args, kwargs = (), {"input_ids": ids, "labels": ids}
    calls = 20000
    start = time.perf_counter()
    for _ in range(calls):
        counter.forward_started(model, args, kwargs)
        counter.forward_ended(None)
        counter.backward_ended()
        counter.figures()
    print(f"  (d) the counter's own calls per known micro step: {(time.perf_counter() - start) / calls * 1e6:.1f} us")


if __name__ == "__main__":
    main()
