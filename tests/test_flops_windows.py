"""Counting windows through the engine hub (hooks, recorder, FlopCounter) on a stand-in engine around real torch
modules: no counting mode outlives our code, two forwards and one backward are one window, recompute is hardware
FLOPs only, and operators without a formula are named with an analytic attention term."""
import gc
import time
import weakref

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.flop_counter import FlopCounterMode

from ds_profutils.config import PartitionedParamProfilerConfig
from ds_profutils.engine import Attachment
from ds_profutils.engine.hooks import running
from ds_profutils.engine.recorder import StepRecorder
from ds_profutils.engine.throughput.flops import FlopCounter

from test_zero_attach import IDENTITY, read_records


class Blocks(torch.nn.Module):
    """Four linear blocks; ``checkpointing`` recomputes each block's forward in the backward."""

    def __init__(self, checkpointing=None):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU())
                                          for _ in range(4))
        self.checkpointing = checkpointing

    def forward(self, x):
        for block in self.blocks:
            if self.checkpointing == "torch":
                x = torch_checkpoint.checkpoint(block, x, use_reentrant=False)
            elif self.checkpointing == "torch-reentrant":
                x = torch_checkpoint.checkpoint(block, x, use_reentrant=True)
            elif self.checkpointing == "deepspeed":
                import deepspeed

                x = deepspeed.checkpointing.checkpoint(block, x)
            else:
                x = block(x)
        return x


class FailingBackward(torch.autograd.Function):
    """Passes its input on; its backward runs out of memory (a stand-in OOM)."""

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("out of memory in the backward (stand-in)")


class TorchEngine:
    """What the hub needs of a DeepSpeed engine, around a real module: backward() and step() as DeepSpeed's."""

    def __init__(self, module):
        self.module = module
        self.global_steps = self.micro_steps = 0

    def gradient_accumulation_steps(self):
        return 1

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.micro_steps += 1
        self.global_steps += 1


def attached(engine, tmp_path):
    settings = PartitionedParamProfilerConfig(enabled=True, output_dir=str(tmp_path))
    attachment = Attachment(engine, "main", None)
    recorder = StepRecorder(engine, None, settings, name="main", identity=IDENTITY, dtype=torch.float32,
                            device_events=None, memory=None, flops=FlopCounter())
    attachment.recorder = recorder
    attachment.add(recorder, recorder.close)
    return attachment


def reference(run) -> int:
    with FlopCounterMode(display=False) as mode:
        run()
    return mode.get_total_flops()


def modes_on_thread():
    return list(_get_current_dispatch_mode_stack())


def train_step(engine, x):
    engine.backward(engine(x).pow(2).mean())
    engine.step()


# --- no counting mode left behind ----------------------------------------------------------------------


def test_an_error_between_forward_and_backward_leaves_no_mode_and_the_next_engine_is_not_counted_through_it(
        tmp_path):
    """An OOM in the program's loss code after the counted first micro step's forward; the retry drops the engine
    without close() and builds another: nothing of ours stays on the thread, the new engine counts right."""
    first = TorchEngine(Blocks())
    attached(first, tmp_path / "first")
    activations = []  # the first block's output, saved for the backward by the second block
    first.module.blocks[0].register_forward_hook(lambda module, args, out: activations.append(weakref.ref(out)))
    output = first(torch.randn(8, 32))
    assert modes_on_thread() == []  # none over the program's code, even before anything fails
    with pytest.raises(torch.OutOfMemoryError):
        raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
    del output
    assert activations[0]() is None  # the dropped graph is freed as without us: the watch holds no node
    del first
    gc.collect()
    assert modes_on_thread() == []
    second = TorchEngine(Blocks())
    seen = []
    second.module.blocks[0].register_forward_hook(lambda *_: seen.append(len(modes_on_thread())))
    with attached(second, tmp_path / "second"):
        for _ in range(3):
            train_step(second, torch.randn(8, 32))
    assert seen == [1, 0, 0]  # counted once (its own mode), then no mode at all
    x = torch.randn(8, 32)
    expected = reference(lambda: second.module(x).pow(2).mean().backward())
    assert [record["flops"] for record in read_records(tmp_path / "second")] == [expected] * 3


def test_an_error_inside_a_counted_forward_or_backward_leaves_no_mode(tmp_path):
    engine = TorchEngine(Blocks())
    with attached(engine, tmp_path):
        with pytest.raises(RuntimeError):
            engine(torch.randn(8, 31))  # a new shape whose forward fails inside the counting mode
        assert modes_on_thread() == []
        with pytest.raises(RuntimeError, match="stand-in"):
            engine.backward(FailingBackward.apply(engine(torch.randn(8, 32))).sum())
        assert modes_on_thread() == []
        train_step(engine, torch.randn(4, 32))
        assert modes_on_thread() == []
    assert read_records(tmp_path)[-1]["flops"] == reference(
        lambda: engine.module(torch.randn(4, 32)).pow(2).mean().backward())


def test_a_keyboard_interrupt_caught_inside_a_counted_forward_leaves_no_mode(tmp_path):
    """Ctrl-C in a notebook, or a program's own "on Ctrl-C, evaluate and save": torch calls always-call forward
    hooks on an Exception only, so the forward is left where the interrupt leaves the engine."""

    def interrupt(*_):
        raise KeyboardInterrupt

    engine = TorchEngine(Blocks())
    x = torch.randn(8, 32)
    with attached(engine, tmp_path):
        handle = engine.module.blocks[2].register_forward_hook(interrupt)
        with pytest.raises(KeyboardInterrupt):
            engine(x)  # a new shape: its forward runs inside the counting mode
        handle.remove()
        assert modes_on_thread() == []
        with torch.no_grad():
            engine(x)  # the program's evaluation, before it goes on training
        train_step(engine, x)
    assert [record["flops"] for record in read_records(tmp_path)] == [
        reference(lambda: engine.module(x)), reference(lambda: engine.module(x).pow(2).mean().backward())]


def test_a_no_grad_forward_between_a_forward_and_its_backward_is_part_of_that_micro_step(tmp_path):
    """DPO's order: TRL computes the reference logits (the same engine under no_grad) after the policy's forward.
    One record per step, holding the whole micro step's time (the reference forward's 50 ms too) and the FLOPs of
    the forward and backward the step trains (no backward reaches the reference forward, as a teacher's)."""
    engine = TorchEngine(Blocks())
    x = torch.randn(8, 32)
    engine.module.blocks[0].register_forward_hook(lambda *_: None if torch.is_grad_enabled() else time.sleep(0.05))
    with attached(engine, tmp_path):
        for _ in range(2):
            loss = engine(x).pow(2).mean()
            with torch.no_grad():
                engine(x)
            assert modes_on_thread() == []
            engine.backward(loss)
            engine.step()
    records = read_records(tmp_path)
    assert [(record["mode"], record["global_step"]) for record in records] == [("train", 0), ("train", 1)]
    assert [record["flops"] for record in records] == [
        reference(lambda: engine.module(x).pow(2).mean().backward())] * 2
    assert all(record["step_time_ms"] >= 50 for record in records)
    assert records[1]["eval_ms"] == 0.0 and records[1]["iteration_ms"] >= records[1]["step_time_ms"]


def test_an_eval_forward_with_gradients_on_is_its_own_forward_and_leaves_the_next_train_step_alone(tmp_path):
    """``engine.eval()`` without ``torch.no_grad()`` between steps: no backward follows, so the eval record has its
    forward's FLOPs, and the next train micro step keeps its own batch's samples and count."""
    engine = TorchEngine(Blocks())
    x, evaluated = torch.randn(4, 32), torch.randn(8, 32)
    with attached(engine, tmp_path):
        for _ in range(2):
            train_step(engine, x)
            engine.module.eval()
            engine(evaluated)
            engine.module.train()
        train_step(engine, x)
    records = read_records(tmp_path)
    assert [(record["mode"], record["samples"]) for record in records] == [("train", 4), ("eval", 8)] * 2 + [
        ("train", 4)]
    train_flops = reference(lambda: engine.module(x).pow(2).mean().backward())
    engine.module.eval()
    eval_flops = reference(lambda: engine.module(evaluated))
    assert [record["flops"] for record in records] == [train_flops, eval_flops] * 2 + [train_flops]
    assert modes_on_thread() == []


class StepModule(Blocks):
    """Lightning's way: the engine calls the module with the whole batch, and its training step calls the module
    again with the tensor."""

    def forward(self, batch):
        if isinstance(batch, dict):
            return self(batch["x"]).pow(2).mean()
        return super().forward(batch)


def test_a_forward_inside_a_forward_of_the_module_is_counted_once_and_leaves_no_mode(tmp_path):
    engine = TorchEngine(StepModule())
    x = torch.randn(8, 32)
    expected = reference(lambda: engine.module({"x": x}).backward())
    with attached(engine, tmp_path):
        for _ in range(2):
            loss = engine({"x": x})
            assert modes_on_thread() == []
            assert running.engine_id is None  # after the outer forward no engine runs (a collective now is the gap's)
            engine.backward(loss)
            engine.step()
    assert [record["flops"] for record in read_records(tmp_path)] == [expected, expected]
    assert read_records(tmp_path)[0]["samples"] == 8


# --- the window -----------------------------------------------------------------------------------------


def test_two_forwards_and_one_backward_are_counted_as_flop_counter_mode_counts_them(tmp_path):
    """Siamese / R-Drop: one micro step, two forwards of the engine's module, one backward of both."""
    engine = TorchEngine(Blocks())

    def siamese(x):
        engine.backward((engine(x) - engine(x.flip(0))).pow(2).mean())

    x = torch.randn(8, 32)
    expected = reference(lambda: siamese(x))
    with attached(engine, tmp_path):
        for _ in range(3):
            siamese(x)
            engine.step()
    records = read_records(tmp_path)  # the recorder writes the first forward as a record of its own
    assert [record["global_step"] for record in records] == [0, 0, 1, 1, 2, 2]
    assert [record["flops"] for record in records] == [0, expected] * 3  # the window's total on its last record
    assert [record["flops_source"] for record in records] == ["window", "counted"] * 3


def test_a_teachers_forward_between_forward_and_backward_is_not_the_students(tmp_path):
    engine = TorchEngine(Blocks())
    teacher = Blocks()
    x = torch.randn(8, 32)
    with attached(engine, tmp_path):
        output = engine(x)
        with torch.no_grad():
            target = teacher(x)
        engine.backward((output - target).pow(2).mean())
        engine.step()
    assert read_records(tmp_path)[0]["flops"] == reference(lambda: engine.module(x).pow(2).mean().backward())


@pytest.mark.parametrize("checkpointing", ["torch", "torch-reentrant", "deepspeed"])
def test_checkpointed_and_plain_models_give_the_same_model_flops(tmp_path, checkpointing):
    x = torch.randn(8, 32, requires_grad=checkpointing != "torch")  # reentrant checkpoints need an input grad
    found = {}
    for kind in (None, checkpointing):
        engine = TorchEngine(Blocks(kind))
        with attached(engine, tmp_path / str(kind)):
            for _ in range(2):
                train_step(engine, x)
        found[kind] = read_records(tmp_path / str(kind))[-1]
    plain, checkpointed = found[None], found[checkpointing]
    assert checkpointed["flops"] == plain["flops"] == plain["hardware_flops"]
    recomputed = reference(lambda: Blocks()(x))  # one forward of the four blocks
    assert checkpointed["hardware_flops"] == checkpointed["flops"] + recomputed > checkpointed["flops"]


# --- operators without a formula --------------------------------------------------------------------------


class Attention(torch.nn.Module):
    """A transformers-style config and SDPA, which on CPU runs an operator FlopCounterMode has no formula for."""

    class config:  # noqa: N801 - the attribute name transformers models carry
        num_attention_heads = 4
        hidden_size = 32

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 32)
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, input_ids):
        batch, sequence = input_ids.shape
        q, k, v = self.qkv(self.embed(input_ids)).view(batch, sequence, 3, 4, 8).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def test_operators_without_a_formula_are_named_once_with_an_analytic_attention_term(tmp_path, ds_caplog):
    engine = TorchEngine(Attention())
    ids = torch.randint(0, 50, (2, 16))
    with attached(engine, tmp_path):
        for _ in range(2):
            engine.backward(engine(ids).pow(2).mean())
            engine.step()
    first, second = read_records(tmp_path)
    counted = reference(lambda: engine.module(ids).pow(2).mean().backward())  # SDPA counts 0 on CPU
    unit = 2 * 16 * 16 * 32  # batch x sequence^2 x heads x head dim
    assert first["flops_uncounted_ops"] == ["aten::_scaled_dot_product_flash_attention_for_cpu",
                                            "aten::_scaled_dot_product_flash_attention_for_cpu_backward"]
    assert first["flops_analytic"] == 4 * unit + 8 * unit and first["flops"] == counted + 12 * unit
    assert second["flops"] == first["flops"] and "flops_uncounted_ops" not in second  # once per signature
    said = [record.getMessage() for record in ds_caplog.records if "without a formula" in record.getMessage()]
    assert len(said) == 1 and "analytic attention term" in said[0]


def test_a_formula_that_raises_is_an_uncounted_operator_never_the_users_error(tmp_path, monkeypatch):
    """A FLOP formula runs inside the user's forward and backward: its error must not reach the step."""
    from torch.utils.flop_counter import flop_registry

    def broken(*_args, **_kwargs):
        raise RuntimeError("a shape the formula does not know")

    engine = TorchEngine(Blocks())
    x = torch.randn(8, 32)
    with FlopCounterMode(display=False) as whole:
        engine.module(x).pow(2).mean().backward()
    without_addmm = whole.get_total_flops() - whole.get_flop_counts()["Global"][torch.ops.aten.addmm]
    monkeypatch.setitem(flop_registry, torch.ops.aten.addmm, broken)  # every Linear's forward
    with attached(engine, tmp_path):
        train_step(engine, x)
    assert modes_on_thread() == []
    record = read_records(tmp_path)[0]
    # the forward's addmm is named, everything else counted (the backward's mm among it)
    assert "aten::addmm" in record["flops_uncounted_ops"] and record["flops"] == without_addmm > 0


def test_a_copy_of_the_module_run_inside_a_counted_forward_leaves_the_count_alone(tmp_path):
    """A teacher or EMA copy of the module run inside the engine's forward: the copy's hooks are inert copies,
    so its forward's end does not end the engine's counting forward (which counts everything inside it)."""
    import copy

    engine = TorchEngine(Blocks())
    x = torch.randn(8, 32)
    with attached(engine, tmp_path):
        train_step(engine, x)  # the counter's hooks are on the module now
        twin = copy.deepcopy(engine.module)
        original = engine.module.forward

        def forward_with_twin(inputs):
            with torch.no_grad():
                twin(inputs)
            return original(inputs)

        engine.module.forward = forward_with_twin
        y = torch.randn(4, 32)  # a new shape: counted
        train_step(engine, y)
        assert modes_on_thread() == []
    flops = [record["flops"] for record in read_records(tmp_path)]
    assert flops[-1] == reference(lambda: engine.module(y).pow(2).mean().backward())
