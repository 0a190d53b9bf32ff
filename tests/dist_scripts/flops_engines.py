"""One gloo rank (plain ``python``): FlopCounter driven by hooks on real DeepSpeed engines, held to FlopCounterMode.

For ZeRO stages 2 and 3 (where DeepSpeed gathers the parameters in its own hooks) and two models, a
small MLP and a tiny GPT-2 with random weights: the counter is wired as the hub wires it (a forward
pre-hook with kwargs put ahead of DeepSpeed's, a forward hook, ``engine.backward`` wrapped, and the window
ended when ``engine.step()`` starts).  A new
shape's micro step is counted; the next micro step of that shape runs inside a separate
``FlopCounterMode`` over the same forward and backward, which the kept count must match.  Then a
torch-style backward (``engine.scale(loss).backward()``) of another new shape, and an eval forward
under ``torch.no_grad()``.  The GPT-2 again with transformers' gradient checkpointing on ZeRO-2: the same model
FLOPs, more hardware FLOPs.  Findings go to the JSON file named by ``--out``.
"""
import os
import argparse
import json

import deepspeed
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.flop_counter import FlopCounterMode
from transformers import GPT2Config, GPT2LMHeadModel

from ds_profutils.engine.throughput.flops import FlopCounter


def make_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                   torch.nn.Linear(64, 1))
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=128, n_positions=64)
    model = GPT2LMHeadModel(config)
    if kind == "gpt2ckpt":
        model.gradient_checkpointing_enable()  # transformers' activation checkpointing: each block recomputed
    return model


def make_batch(kind: str, rows: int, length: int):
    """(args, kwargs) of one forward, and how its output becomes a loss."""
    if kind == "mlp":
        return (torch.randn(rows, 32), ), {}, lambda out: out.pow(2).mean()
    ids = torch.randint(0, 128, (rows, length))
    return (), {"input_ids": ids, "labels": ids}, lambda out: out.loss


def wire(engine, counter: FlopCounter) -> None:
    """The hooks the engine hub puts on an engine, reduced to what the counter needs."""
    module = engine.module
    module.register_forward_pre_hook(lambda mod, args, kwargs: counter.forward_started(mod, args, kwargs),
                                     with_kwargs=True, prepend=True)
    module.register_forward_hook(lambda mod, args, output: counter.forward_ended(output))
    module.register_forward_hook(lambda *_: counter.forward_left(), always_call=True)
    backward = engine.backward

    def wrapped(*args, **kwargs):
        result = backward(*args, **kwargs)
        counter.backward_ended()
        return result

    engine.backward = wrapped
    step = engine.step

    def step_wrapped(*args, **kwargs):
        counter.backward_ended()  # as the hub at step_started: a torch-style backward's window ends here
        return step(*args, **kwargs)

    engine.step = step_wrapped


def train_micro_step(engine, kind, rows, length, torch_style=False):
    args, kwargs, to_loss = make_batch(kind, rows, length)
    loss = to_loss(engine(*args, **kwargs))
    if torch_style:
        engine.scale(loss).backward()
    else:
        engine.backward(loss)
    engine.step()


def check(stage: int, kind: str) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    model = make_model(kind)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    counter = FlopCounter()
    wire(engine, counter)
    found = {}

    train_micro_step(engine, kind, 2, 16)  # a new shape: counted
    found["counted"] = counter.figures()._asdict()
    found["mode_off_after_backward"] = not counter.counting and not _get_current_dispatch_mode_stack()
    attempts = counter.counting_attempts

    with FlopCounterMode(display=False) as reference:  # the same shape again: looked up, not counted
        args, kwargs, to_loss = make_batch(kind, 2, 16)
        engine.backward(to_loss(engine(*args, **kwargs)))
    engine.step()
    found["reference"] = reference.get_total_flops()
    found["known"] = counter.figures()._asdict()
    found["counted_again"] = counter.counting_attempts - attempts

    train_micro_step(engine, kind, 3, 24, torch_style=True)  # torch-style: the autograd callback ends it
    found["torch_style"] = counter.figures()._asdict()
    with FlopCounterMode(display=False) as reference:
        train_micro_step(engine, kind, 3, 24, torch_style=True)
    found["torch_style_reference"] = reference.get_total_flops()
    found["torch_style_counted_again"] = counter.counting_attempts - attempts - 1

    engine.eval()
    with torch.no_grad():
        args, kwargs, _ = make_batch(kind, 2, 16)
        engine(*args, **kwargs)
        found["eval"] = counter.figures()._asdict()
        with FlopCounterMode(display=False) as reference:
            engine(*args, **kwargs)
    found["eval_reference"] = reference.get_total_flops()
    found["mode_off_at_end"] = not counter.counting and not _get_current_dispatch_mode_stack()
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = parser.parse_args().out
    findings = {f"{kind}-{stage}": check(stage, kind) for stage in (2, 3) for kind in ("mlp", "gpt2")}
    findings["gpt2ckpt-2"] = check(2, "gpt2ckpt")
    with open(out, "w") as file:
        json.dump(findings, file)


if __name__ == "__main__":
    main()
    print(f"job end: rank {os.environ.get('RANK', 0)}", flush=True)  # run_deepspeed's check reads it (tests/launcher.py)
    if torch.distributed.is_initialized():  # the documented shutdown (README, "On CPU")
        torch.distributed.destroy_process_group()
