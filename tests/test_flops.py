"""FlopCounter: one FlopCounterMode count per input shape, reused; tokens and samples; scaling; real engines."""
import json

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.flop_counter import FlopCounterMode

from ds_profutils.engine.throughput.flops import FlopCounter, MicroStepFlops, inspect_batch
from launcher import DIST_SCRIPTS, run_one_rank


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


class TokenModel(torch.nn.Module):
    """Token ids in, a linear layer per token: FLOPs linear in the token count."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, input_ids, attention_mask=None):
        return self.proj(self.embed(input_ids))


def wired(module: torch.nn.Module, **kwargs) -> FlopCounter:
    """A counter on ``module``'s hooks, as the engine hub puts them."""
    counter = FlopCounter(**kwargs)
    module.register_forward_pre_hook(lambda mod, args, kw: counter.forward_started(mod, args, kw), with_kwargs=True,
                                     prepend=True)
    module.register_forward_hook(lambda mod, args, output: counter.forward_ended(output))
    module.register_forward_hook(lambda *_: counter.forward_left(), always_call=True)
    return counter


def reference(run) -> int:
    with FlopCounterMode(display=False) as mode:
        run()
    return mode.get_total_flops()


def train_step(model, counter, x, engine_backward=True):
    model(x).pow(2).mean().backward()
    if engine_backward:
        counter.backward_ended()


# --- tokens, samples and the shape key ---------------------------------------------------------------


def test_tokens_and_samples_follow_the_documented_rule():
    ids = torch.zeros(4, 7, dtype=torch.long)
    mask = torch.ones(4, 7, dtype=torch.bool)
    floats = torch.randn(3, 5)
    assert inspect_batch((), {"input_ids": ids, "attention_mask": mask})[1:] == (28, 4)
    assert inspect_batch((floats, ids), {})[1:] == (28, 4)  # the first integer tensor argument
    assert inspect_batch((torch.zeros(2, 3, dtype=torch.int32), ), {"input_ids": ids})[1:] == (28, 4)  # named wins
    assert inspect_batch((mask, floats), {})[1:] == (None, 4)  # a bool mask holds no tokens; samples: the first
    assert inspect_batch((floats, ), {})[1:] == (None, 3)  # a float batch gives samples only
    assert inspect_batch((), {"pixel_values": floats})[1:] == (None, 3)
    assert inspect_batch((1.5, "text"), {"flag": True})[1:] == (None, None)
    assert inspect_batch((torch.tensor(3), ), {})[1:] == (1, 1)  # a 0-d integer tensor: one token
    assert inspect_batch(({"input_ids": ids, "labels": ids}, 7), {})[1:] == (28, 4)  # a Lightning batch, whole
    assert inspect_batch(((floats, ids), ), {})[1:] == (28, 4)  # a (features, ids) tuple


def test_shape_key_sees_shapes_positions_and_names_not_values():
    x, y = torch.randn(2, 3), torch.randn(2, 4)
    assert inspect_batch((x, ), {})[0] == inspect_batch((torch.ones(2, 3), ), {})[0]
    assert inspect_batch((x, None), {})[0] != inspect_batch((None, x), {})[0]
    assert inspect_batch((), {"a": x})[0] != inspect_batch((), {"b": x})[0]
    assert inspect_batch((x, ), {})[0] != inspect_batch((y, ), {})[0]
    assert inspect_batch(({"a": x}, ), {})[0] != inspect_batch(({"a": y}, ), {})[0]  # one level into a dict
    assert inspect_batch(((x, y), ), {})[0] != inspect_batch((x, y), {})[0]


# --- counting once per shape ------------------------------------------------------------------------


def test_a_shape_is_counted_once_and_matches_flop_counter_mode():
    model = mlp()
    x = torch.randn(8, 16)
    expected = reference(lambda: model(x).pow(2).mean().backward())  # the same forward and backward
    assert expected > 0
    counter = wired(model)
    train_step(model, counter, x)
    assert not counter.counting and counter.counting_attempts == 1
    assert counter.figures() == MicroStepFlops(expected, "counted", True, None, 8, expected)
    for _ in range(3):
        train_step(model, counter, x)
        assert counter.figures().flops == expected and not counter.counting
    assert counter.counting_attempts == 1  # known shapes never enter the mode
    train_step(model, counter, torch.randn(4, 16))
    assert counter.counting_attempts == 2 and counter.figures().flops == pytest.approx(expected / 2, rel=1e-9)


def test_the_programs_code_between_forward_and_backward_runs_under_no_mode_and_is_not_counted():
    model = mlp()
    counter = wired(model)
    x = torch.randn(8, 16)
    loss = model(x).pow(2).mean()
    assert counter.counting and counter.figures().flops == 0  # the window awaits its backward
    assert not _get_current_dispatch_mode_stack()
    with torch.no_grad():
        torch.randn(64, 64) @ torch.randn(64, 64)  # between forward and backward: a user's loss code
    loss.backward()
    counter.backward_ended()
    assert not counter.counting
    assert counter.figures().flops == reference(lambda: model(x).pow(2).mean().backward())


def test_the_window_ends_when_a_backward_ended_whichever_call_started_it():
    """A torch-style ``loss.backward()``: its nodes are counted as it runs; the hub's word that it ended (its
    autograd callback) ends the window."""
    model = mlp()
    counter = wired(model)
    x = torch.randn(6, 16)
    train_step(model, counter, x, engine_backward=False)
    assert counter.figures().flops_source == "window" and counter.counting
    torch.randn(64, 64) @ torch.randn(64, 64)  # after the backward: not in the count
    counter.backward_ended()
    figures = counter.figures()
    assert figures.flops == reference(lambda: model(x).pow(2).mean().backward()) and figures.backward
    train_step(model, counter, x)
    assert counter.figures() == figures and counter.counting_attempts == 1


def test_a_forward_without_backward_counts_the_forward_only():
    model = mlp()
    counter = wired(model)
    x = torch.randn(8, 16)
    with torch.no_grad():
        model(x)
        assert not counter.counting  # complete at the forward's end
        forward = reference(lambda: model(x))
        assert counter.figures() == MicroStepFlops(forward, "counted", False, None, 8, forward)
    train_step(model, counter, x)  # the same shape with gradients: an entry of its own
    assert counter.figures().backward and counter.counting_attempts == 2
    assert counter.figures().flops > 2 * reference(lambda: model(x))


def test_a_train_forward_whose_backward_never_came_is_left_out_of_the_window():
    model = mlp()
    counter = wired(model)
    x = torch.randn(8, 16)
    model(x)  # no backward: its output is dropped
    train_step(model, counter, x)  # joins the window, whose backward reaches this forward only
    assert counter.counting_attempts == 1 and counter.counted_shapes == 1
    assert counter.figures().backward and counter.figures().flops == reference(
        lambda: model(x).pow(2).mean().backward())


def test_an_error_in_a_counted_forward_leaves_no_mode_and_keeps_earlier_counts():
    model = mlp()
    counter = wired(model)
    train_step(model, counter, torch.randn(8, 16))
    with pytest.raises(RuntimeError):
        model(torch.randn(8, 15))  # a new shape whose forward fails inside the counting mode
    assert not _get_current_dispatch_mode_stack()
    counter.discard()
    assert not counter.counting and counter.figures() is None
    train_step(model, counter, torch.randn(8, 16))
    assert counter.figures().flops > 0 and counter.counting_attempts == 2


def test_a_programs_own_flop_counter_mode_counts_as_without_us():
    model = mlp()
    counter = wired(model)
    x = torch.randn(8, 16)
    with FlopCounterMode(display=False) as theirs:
        train_step(model, counter, x)  # ours pushed and popped inside theirs
        assert _get_current_dispatch_mode_stack() == [theirs.mode]
    assert theirs.get_total_flops() == counter.figures().flops == reference(
        lambda: model(x).pow(2).mean().backward())


# --- shapes beyond the bound -------------------------------------------------------------------------


def test_shapes_beyond_the_bound_are_scaled_from_the_nearest_token_count(ds_caplog):
    model = TokenModel()
    counter = wired(model, max_counted_shapes=2)

    def step(length):
        ids = torch.randint(0, 50, (2, length))
        model(input_ids=ids).pow(2).mean().backward()
        counter.backward_ended()
        return counter.figures()

    short, long = step(4), step(32)
    assert (short.flops_source, long.flops_source, short.tokens, long.tokens) == ("counted", "counted", 8, 64)
    near_long = step(30)
    assert near_long == MicroStepFlops(round(long.flops * 60 / 64), "scaled", True, 60, 2, round(long.flops * 60 / 64))
    near_short = step(5)
    assert near_short.flops == round(short.flops * 10 / 8) and near_short.flops_source == "scaled"
    exact = reference(lambda: model(input_ids=torch.randint(0, 50, (2, 30))).pow(2).mean().backward())
    assert near_long.flops == pytest.approx(exact, rel=0.01)  # linear in tokens: scaling is exact here
    assert counter.counting_attempts == 2 and not counter.counting
    said = [r.getMessage() for r in ds_caplog.records if "scaled" in r.getMessage()]
    assert len(said) == 1 and "2 input shapes counted exactly" in said[0]


def test_nothing_to_scale_from_gives_unknown_flops_and_the_batch():
    model = TokenModel()
    counter = wired(model, max_counted_shapes=1)
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 3, dtype=torch.long))  # the one count: forward only, eval kind
    model(input_ids=torch.zeros(2, 5, dtype=torch.long)).sum().backward()
    counter.backward_ended()
    assert counter.figures() == MicroStepFlops(None, None, False, 10, 2)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_max_counted_shapes_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="max_counted_shapes must be an integer >= 1"):
        FlopCounter(max_counted_shapes=bad)


# --- real DeepSpeed engines --------------------------------------------------------------------------


def test_counts_on_zero_2_and_3_engines_match_flop_counter_mode(tmp_path):
    """One gloo rank (tests/dist_scripts/flops_engines.py): an MLP and a tiny GPT-2 on ZeRO-2 and ZeRO-3, and the
    GPT-2 with transformers' gradient checkpointing on ZeRO-2."""
    out = tmp_path / "findings.json"
    run_one_rank([str(DIST_SCRIPTS / "flops_engines.py"), "--out", str(out)])
    findings = json.loads(out.read_text())
    assert sorted(findings) == ["gpt2-2", "gpt2-3", "gpt2ckpt-2", "mlp-2", "mlp-3"]
    for name, found in findings.items():
        counted, known = found["counted"], found["known"]
        assert counted["flops_source"] == "counted" and counted["backward"], name
        assert counted["hardware_flops"] == found["reference"], name  # FlopCounterMode counts the recompute too
        assert known["flops"] == counted["flops"] and found["counted_again"] == 0, name  # the same shape: looked up
        assert found["mode_off_after_backward"] and found["mode_off_at_end"], name
        assert found["torch_style"]["hardware_flops"] == found["torch_style_reference"], name
        assert found["torch_style_counted_again"] == 0, name
        assert not found["eval"]["backward"], name
        # on CPU, SDPA in an eval forward runs an operator without a formula: named, with the analytic term
        assert found["eval"]["flops"] == found["eval_reference"] + found["eval"]["analytic_flops"], name
    for name in ("mlp-2", "mlp-3", "gpt2-2", "gpt2-3"):
        assert findings[name]["counted"]["flops"] == findings[name]["reference"], name
    plain, checkpointed = findings["gpt2-2"]["counted"], findings["gpt2ckpt-2"]["counted"]
    assert checkpointed["flops"] == plain["flops"] < checkpointed["hardware_flops"]
    eval_gpt2 = findings["gpt2-2"]["eval"]
    assert eval_gpt2["uncounted_ops"] == ["aten::_scaled_dot_product_flash_attention_for_cpu"]
    assert eval_gpt2["analytic_flops"] == 2 * 4 * (2 * 16 * 16 * 64)  # two layers, 4 x batch x seq^2 x hidden
    assert findings["gpt2-3"]["counted"]["tokens"] == 32 and findings["gpt2-3"]["counted"]["samples"] == 2
    assert findings["mlp-2"]["counted"]["tokens"] is None and findings["mlp-2"]["counted"]["samples"] == 2


def test_a_step_without_a_backward_keeps_no_backward_count():
    """backward_ended at step_started after a forward whose outputs no backward reached: nothing kept."""
    model = mlp()
    counter = wired(model)
    x = torch.randn(8, 16)
    model(x)
    counter.backward_ended()  # the hub at step_started; no backward ran
    assert not counter.counting and counter.counted_shapes == 0 and counter.figures().flops is None
    train_step(model, counter, x)
    assert counter.figures().flops == reference(lambda: model(x).pow(2).mean().backward())
