"""The live events in the frameworks' own reporting (ds_profutils.integrations.live_sinks), read back from
the files those write: a transformers Trainer with ``report_to=["tensorboard"]``, Accelerate's TensorBoard
tracker, Lightning's CSV and TensorBoard loggers."""
import csv
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest
import torch

from ds_profutils.engine.live import EVENT_NAMES, LiveMetrics, StepFigures
from ds_profutils.integrations.live_sinks import AccelerateSink, LightningSink, TrainerSink

if TYPE_CHECKING:  # an extra: imported where a test runs it
    import transformers

pytest.importorskip("tensorboard")
from tensorboard_testing import scalars  # noqa: E402

GAP_PARTS = {"ds_profutils/eval_ms", "ds_profutils/save_ms"}  # sent where an eval or a save ran
EVENTS = [("ds_profutils/step_ms", 12.5, 8), ("ds_profutils/mfu", 0.25, 8), ("ds_profutils/tokens_per_s", 640.0, 8)]


class Regression(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)}


def figures(global_step: int) -> StepFigures:
    return StepFigures(global_step=global_step, step_ms=10.0, iteration_ms=12.0, gap_ms=2.0, flops=10**9,
                       tokens=32, samples=2, exposed_wait_ms=1.0, collective_ms=1.0, peak_allocated_bytes=1 << 20)


def train(tmp_path: Path, report_to) -> "transformers.Trainer":
    """A tiny Trainer run of 6 steps, logging every step, fed to LiveMetrics (interval 2) after each step
    as the recorder would, into a TrainerSink."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class FeedLive(TrainerCallback):

        def __init__(self):
            self.live = None

        def on_step_end(self, args, state, control, **kwargs):
            # numbered apart from the Trainer's steps: the points must carry the events' own step
            self.live.step_finished(figures(1000 + state.global_step))

    torch.manual_seed(0)
    data = [{"x": torch.randn(4), "labels": torch.randn(())} for _ in range(12)]
    args = TrainingArguments(output_dir=str(tmp_path), report_to=report_to, max_steps=6, logging_steps=1,
                             per_device_train_batch_size=2, use_cpu=True, save_strategy="no", disable_tqdm=True)
    feed = FeedLive()
    trainer = Trainer(model=Regression(), args=args, train_dataset=data, callbacks=[feed])
    feed.live = LiveMetrics(SimpleNamespace(monitor_interval=2, console=False), 100.0, [TrainerSink(trainer)])
    trainer.train()
    return trainer


def test_trainer_report_to_tensorboard_gets_a_point_every_interval(tmp_path):
    trainer = train(tmp_path, ["tensorboard"])
    found = scalars(tmp_path)
    for name in set(EVENT_NAMES) - GAP_PARTS:  # no eval and no checkpoint save: left out
        assert [step for step, _ in found[f"train/{name}"]] == [1002, 1004, 1006], name
    assert [value for _, value in found["train/ds_profutils/step_ms"]] == [10.0, 10.0, 10.0]
    assert found["train/ds_profutils/mfu"][0][1] == pytest.approx(2 * 1e9 / 0.024 / 1e12 / 100.0)
    # the Trainer's own logging is undisturbed: its loss every step, nothing of ours in its history
    assert [step for step, _ in found["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert not any(key.startswith("ds_profutils/") for entry in trainer.state.log_history for key in entry)
    assert trainer.state.global_step == 6


def test_trainer_reporting_nowhere_gets_nothing_and_goes_on(tmp_path):
    trainer = train(tmp_path, "none")
    assert trainer.state.global_step == 6 and not list(tmp_path.rglob("events.out.tfevents.*"))


def test_dvclive_gets_the_events_at_its_present_step_which_they_do_not_advance():
    """DVCLive's Trainer callback calls ``next_step()`` in every ``on_log``: ours must not move its step."""
    from transformers import TrainerState
    from transformers.integrations import DVCLiveCallback

    class Live:
        def __init__(self):
            self.metrics, self.steps = [], 0

        def log_metric(self, name, value):
            self.metrics.append((name, value))

        def next_step(self):
            self.steps += 1

    callback = DVCLiveCallback.__new__(DVCLiveCallback)  # dvclive itself is not installed here
    callback.live, callback._initialized = Live(), True
    trainer = SimpleNamespace(callback_handler=SimpleNamespace(callbacks=[callback]), state=TrainerState(), args=None)
    TrainerSink(trainer).write(EVENTS)
    assert callback.live.metrics == [(f"train/{name}", value) for name, value, _ in EVENTS]
    assert callback.live.steps == 0
    callback.live = None  # not started yet (its setup runs at the Trainer's first log): nothing to write to
    TrainerSink(trainer).write(EVENTS)


def test_accelerate_trackers_once_initialized(tmp_path):
    from accelerate import Accelerator

    accelerator = Accelerator(log_with="tensorboard", project_dir=str(tmp_path), cpu=True)
    sink = AccelerateSink(accelerator)
    sink.write([("ds_profutils/step_ms", 99.0, 4)])  # no init_trackers yet: nowhere to report, no error
    accelerator.init_trackers("live")
    sink.write(EVENTS)
    accelerator.end_training()
    found = scalars(tmp_path)
    assert {tag: points for tag, points in found.items()} == {name: [(8, value)] for name, value, _ in EVENTS}


def test_lightning_loggers(tmp_path):
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    trainer = Trainer(logger=[CSVLogger(tmp_path / "csv"), TensorBoardLogger(tmp_path / "tb")], accelerator="cpu",
                      devices=1, enable_progress_bar=False, enable_model_summary=False)
    LightningSink(trainer).write(EVENTS)
    for logger in trainer.loggers:
        logger.save()
        logger.finalize("success")
    rows = list(csv.DictReader(open(next((tmp_path / "csv").rglob("metrics.csv")))))
    assert [(int(row["step"]), float(row["ds_profutils/step_ms"])) for row in rows] == [(8, 12.5)]
    assert scalars(tmp_path / "tb")["ds_profutils/tokens_per_s"] == [(8, 640.0)]
    LightningSink(Trainer(logger=False, accelerator="cpu", devices=1)).write(EVENTS)  # no logger: nothing to do


class Kept:
    """A sink that keeps what it is sent."""

    def __init__(self):
        self.writes = []

    def write(self, events):
        self.writes.append(events)


def test_an_attachment_takes_one_framework_sink_of_a_kind_and_none_without_live_metrics():
    from ds_profutils.engine import Attachment

    live = LiveMetrics(SimpleNamespace(monitor_interval=2, console=False), 100.0, [])
    attachment = Attachment(SimpleNamespace(), None, None)
    attachment.live = live  # as attach sets it with step_metrics on
    first = Kept()
    attachment.report_to(first)
    attachment.report_to(Kept())  # attach(accelerator) again: the same attachment, no second sink
    for step in range(4):
        live.step_finished(figures(step))
    assert [{step for _, _, step in events} for events in first.writes] == [{1}, {3}]
    attachment.close()
    assert live.sinks == [first]
    off = Attachment(SimpleNamespace(), None, None)  # step_metrics off: nothing to send, nothing kept
    off.report_to(Kept())
    assert off.live is None
    off.close()
