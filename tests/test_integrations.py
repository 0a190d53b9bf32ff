"""``ds_profutils.attach`` as the one entry point: what it hands to which adapter, and the one error for
everything else (an unknown object, a framework release outside the supported range, a framework
object that has no DeepSpeed engine to profile).  The frameworks' real objects, in this process, no
launcher; the jobs that train are in test_integrations_jobs.py and test_integrations_lightning.py."""
import os
import re
import subprocess
import sys

import pytest
import torch

import ds_profutils
from ds_profutils.integrations import AttachTargetError
from ds_profutils.engine import AttachError
from test_zero_attach import Engine, fetch_config

ACCEPTED = ("a DeepSpeed engine", "a transformers.Trainer, before trainer.train() (transformers >=5.0,<6)",
            "an accelerate.Accelerator, after accelerator.prepare(...) (accelerate >=1.0,<2)",
            "for a lightning.pytorch.Trainer with DeepSpeedStrategy, not attach but "
            "callbacks=[ds_profutils.integrations.lightning.ProfUtilsCallback()] (lightning >=2.0,<3)",
            "for a pytorch_lightning.Trainer with DeepSpeedStrategy, not attach but "
            "callbacks=[ds_profutils.integrations.pytorch_lightning.ProfUtilsCallback()] (pytorch_lightning >=2.0,<3)")


def assert_refused(refused, type_name, reason):
    message = str(refused.value)
    assert message.startswith(f"ds_profutils.attach: cannot profile a {type_name}: {reason}"), message
    assert all(accepted in message for accepted in ACCEPTED), message


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=8, n_embd=8, n_layer=1, n_head=1, bos_token_id=0,
                                      eos_token_id=0))


@pytest.fixture
def trainer_without_deepspeed(tmp_path, tiny_model):
    from transformers import Trainer, TrainingArguments

    return Trainer(model=tiny_model, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]))


@pytest.mark.parametrize("target, type_name", [(object(), "builtins.object"),
                                               (torch.nn.Linear(2, 2), "torch.nn.modules.linear.Linear"),
                                               ("ds_config.json", "builtins.str")])
def test_an_object_it_does_not_know_gets_one_error_listing_what_it_accepts(target, type_name):
    with pytest.raises(AttachTargetError) as refused:
        ds_profutils.attach(target)
    assert_refused(refused, type_name, "it is not a DeepSpeed engine nor a framework object that builds one")
    assert isinstance(refused.value, TypeError)


def test_an_engine_goes_to_the_engine_hook(tmp_path):
    """The stand-in engine has the engine's interface: the engine hook gets it, and says what it makes of it
    (no ZeRO-3 coordinator behind the stand-in), or does nothing when its config asks nothing."""
    with pytest.raises(AttachError, match="no ZeRO-3 parameter coordinator found"):
        ds_profutils.attach(Engine(fetch_config(output_dir=str(tmp_path))))
    assert ds_profutils.attach(Engine({})) is None


def test_a_trainer_from_an_unsupported_transformers_release_is_refused_untouched(monkeypatch,
                                                                                  trainer_without_deepspeed):
    callbacks = list(trainer_without_deepspeed.callback_handler.callbacks)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")  # what a program has imported
    with pytest.raises(AttachTargetError) as refused:
        ds_profutils.attach(trainer_without_deepspeed)
    assert_refused(refused, "transformers.trainer.Trainer",
                   "transformers 4.57.1 is not a supported release (supported: transformers >=5.0,<6)")
    assert trainer_without_deepspeed.callback_handler.callbacks == callbacks


def test_a_trainer_without_deepspeed_gets_a_warning_and_none(trainer_without_deepspeed, ds_caplog):
    """One script run with and without --deepspeed: the attach line must not break the run without it."""
    callbacks = list(trainer_without_deepspeed.callback_handler.callbacks)
    assert ds_profutils.attach(trainer_without_deepspeed) is None
    assert "this transformers.Trainer does not train with DeepSpeed (TrainingArguments(deepspeed=...) is not set" \
        in ds_caplog.text
    assert [r.levelname for r in ds_caplog.records] == ["WARNING"]
    assert trainer_without_deepspeed.callback_handler.callbacks == callbacks


def test_a_typo_in_our_section_fails_at_the_attach_line_of_a_trainer(tmp_path):
    """The engine is built only in train(), but the Trainer's ds_config is known from the start: the typo is a
    ConfigError naming the key when attach(trainer) runs (a fresh interpreter: a DeepSpeed Trainer sets up
    the process's distributed state)."""
    code = f"""
import ds_profutils
from ds_profutils.config import ConfigError
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=8, n_embd=8, n_layer=1, n_head=1, bos_token_id=0,
                                   eos_token_id=0))
config = {{"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "zero_optimization": {{"stage": 3}},
          "profiler": {{"activ": 3}}}}
trainer = Trainer(model=model, args=TrainingArguments(output_dir={str(tmp_path)!r}, use_cpu=True, report_to=[],
                                                      deepspeed=config))
try:
    ds_profutils.attach(trainer)
except ConfigError as exc:
    print("RAISED", type(exc).__name__, str(exc).replace(chr(10), " "))
print("CALLBACKS", sum(type(c).__name__ == "ProfUtilsTrainerCallback" for c in trainer.callback_handler.callbacks))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    raised = [line for line in done.stdout.splitlines() if line.startswith("RAISED")]
    assert len(raised) == 1 and "profiler.activ" in raised[0], done.stdout[-3000:]
    assert "CALLBACKS 0" in done.stdout


def test_an_accelerator_is_refused_outside_the_release_range_and_without_deepspeed_left_alone(monkeypatch,
                                                                                              ds_caplog):
    import accelerate

    accelerator = accelerate.Accelerator(cpu=True)
    assert ds_profutils.attach(accelerator) is None  # no DeepSpeed in use: one warning, nothing attached
    assert "this accelerate.Accelerator does not train with DeepSpeed (start the job with `accelerate launch " \
        "--use_deepspeed" in ds_caplog.text
    monkeypatch.setattr(sys.modules["accelerate"], "__version__", "0.34.2")
    with pytest.raises(AttachTargetError) as refused:
        ds_profutils.attach(accelerator)
    assert_refused(refused, "accelerate.accelerator.Accelerator",
                   "accelerate 0.34.2 is not a supported release (supported: accelerate >=1.0,<2)")


@pytest.mark.parametrize("package, namespace", [("lightning", "lightning.pytorch"),
                                                ("pytorch_lightning", "pytorch_lightning")])
def test_a_lightning_trainer_is_pointed_at_the_callback(monkeypatch, package, namespace):
    import importlib

    pl = importlib.import_module(namespace)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    with pytest.raises(AttachTargetError) as refused:
        ds_profutils.attach(trainer)
    assert_refused(refused, f"{namespace}.trainer.trainer.Trainer",
                   "a Lightning Trainer builds its engine inside DeepSpeedStrategy; give it ProfUtilsCallback() "
                   "in callbacks= instead")
    callback_class = importlib.import_module(f"ds_profutils.integrations.{package}").ProfUtilsCallback
    assert isinstance(callback_class(), pl.Callback)  # each namespace's Trainer takes only its own Callback class
    monkeypatch.setattr(sys.modules[package], "__version__", "1.9.5")
    with pytest.raises(AttachTargetError, match=re.escape(f"{package} 1.9.5 is not a supported release (supported: "
                                                          f"{package} >=2.0,<3)")):
        callback_class()


@pytest.mark.parametrize("package, namespace", [("lightning", "lightning.pytorch"),
                                                ("pytorch_lightning", "pytorch_lightning")])
def test_the_lightning_callback_refuses_a_strategy_other_than_deepspeed(tmp_path, package, namespace):
    import importlib

    pl = importlib.import_module(namespace)
    callback = importlib.import_module(f"ds_profutils.integrations.{package}").ProfUtilsCallback()
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, callbacks=[callback],
                         max_steps=1, default_root_dir=str(tmp_path), enable_progress_bar=False)
    model = importlib.import_module(f"{namespace}.demos.boring_classes").BoringModel()
    with pytest.raises(AttachTargetError, match="profiles the engine of DeepSpeedStrategy; this Trainer's strategy is "
                       "SingleDeviceStrategy"):
        trainer.fit(model)


def test_the_extras_install_the_releases_the_adapters_support():
    from launcher import REPO
    from ds_profutils.integrations.frameworks import ACCELERATOR, LIGHTNING_TRAINERS, TRAINER

    setup = (REPO / "setup.py").read_text()
    for framework, extra in [(TRAINER, "transformers"), (ACCELERATOR, "accelerate"), (LIGHTNING_TRAINERS[0], "lightning")]:
        requirement = f'"{framework.package}{framework.supported}"'
        assert re.search(rf'"{extra}": \[[^\]]*{re.escape(requirement)}', setup), (extra, requirement)
        assert re.search(rf'"test": \[[^\]]*{re.escape(requirement)}', setup), requirement
    assert re.search(r'"test": \[[^\]]*"pytorch-lightning' + re.escape(LIGHTNING_TRAINERS[1].supported), setup)


def test_a_trainer_run_that_raised_leaves_no_engine_alive(tmp_path, ds_caplog):
    """transformers callbacks have no exception event: after train() raised, the callback never hears the run
    ended.  Once the Trainer lets the engine go (auto_find_batch_size builds the next one), the engine is
    collected, not kept resident by the callback's attachment; the next run's engine is attached afresh."""
    import gc
    import types
    import weakref

    from ds_profutils.integrations.transformers import ProfUtilsTrainerCallback
    from test_profiler_engine_driven import AccumulatingEngine, profiler_config

    engine = AccumulatingEngine(profiler_config(tmp_path))
    trainer = types.SimpleNamespace(model_wrapped=engine)
    callback = ProfUtilsTrainerCallback(trainer, None, engine.config, {})
    callback.on_train_begin(None, None, None)
    assert callback.attachment is not None and callback.attachment.engine is engine

    def out_of_memory(*_):
        raise RuntimeError("out of memory")

    handle = engine.module.register_forward_hook(out_of_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.train(1)  # train() raises: no on_train_end
    handle.remove()
    dropped = weakref.ref(engine)
    trainer.model_wrapped = engine = None
    gc.collect()
    assert dropped() is None and callback.attachment is None
    trainer.model_wrapped = AccumulatingEngine(profiler_config(tmp_path))
    callback.on_train_begin(None, None, None)
    assert callback.attachment.engine is trainer.model_wrapped
    trainer.model_wrapped.train(1)  # its profiler takes over from the dropped engine's
    callback._engines.close()
