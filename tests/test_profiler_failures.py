"""The profiler under failure: exceptions, signals, nesting, threads, bad output dirs, export errors."""
import os
import signal
import threading
from types import SimpleNamespace

import pytest
import torch

from ds_profutils import profiler, step_profiler
from ds_profutils.torch_profiler import calls as profiler_calls
from ds_profutils.torch_profiler import writer
from ds_profutils.config import ConfigError
from profiler_testing import profiler_steps, read_trace, train_step

SCHEDULE = dict(skip_first=0, wait=2, warmup=1, active=3)  # active steps 3, 4, 5


def _assert_idle():
    assert profiler_calls._current is None


def test_exception_writes_a_complete_trace_and_reraises(tmp_path):
    handlers = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))

    @profiler(output_dir=str(tmp_path), **SCHEDULE)
    def fails_in_step_4():
        for step in range(10):
            train_step()
            if step == 4:
                raise ValueError("boom")
            step_profiler()

    with pytest.raises(ValueError, match="boom"):
        fails_in_step_4()
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [3, 4]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers
    _assert_idle()


def test_exception_before_any_active_step_records_nothing(tmp_path, ds_caplog):

    @profiler(output_dir=str(tmp_path), **SCHEDULE)
    def fails_in_warmup():
        for step in range(2):  # ends steps 0 and 1: raises in step 2, the warmup step
            step_profiler()
        raise KeyError("early")

    with pytest.raises(KeyError):
        fails_in_warmup()
    assert not (tmp_path / "trace_rank_0.json").exists()
    assert "before any active step" in ds_caplog.text
    _assert_idle()


@pytest.fixture
def sigint_handler(request):
    """SIGINT's handler set for one test, whatever the suite started with (``nohup ... &`` starts Python
    with SIGINT ignored, so Python's own KeyboardInterrupt handler is then not installed)."""
    previous = signal.signal(signal.SIGINT, request.param)
    yield request.param
    signal.signal(signal.SIGINT, previous)


def _interrupted_in_step_4(tmp_path):

    @profiler(output_dir=str(tmp_path), **SCHEDULE)
    def train():
        for step in range(10):
            train_step()
            if step == 4:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C
            step_profiler()

    return train


@pytest.mark.parametrize("sigint_handler", [signal.default_int_handler], indirect=True)
def test_sigint_keeps_pythons_handler_and_still_writes(tmp_path, sigint_handler):
    with pytest.raises(KeyboardInterrupt):
        _interrupted_in_step_4(tmp_path)()
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [3, 4]
    assert signal.getsignal(signal.SIGINT) is sigint_handler


@pytest.mark.parametrize("sigint_handler", [signal.SIG_IGN], indirect=True)
def test_an_ignored_sigint_stays_ignored(tmp_path, sigint_handler):
    _interrupted_in_step_4(tmp_path)()  # runs to its end
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [3, 4, 5]
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_nested_call_runs_unprofiled_and_leaves_the_outer_run_alone(tmp_path, ds_caplog, monkeypatch):
    inner_dir = tmp_path / "inner"
    runs_made = []

    class CountedRun(profiler_calls.ProfilerRun):

        def __init__(self, *args, **kwargs):
            runs_made.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(profiler_calls, "ProfilerRun", CountedRun)

    @profiler(output_dir=str(inner_dir), skip_first=0, wait=0, warmup=0, active=1)
    def evaluate():
        for _ in range(7):
            step_profiler()  # must not advance the outer run

    @profiler(output_dir=str(tmp_path), **SCHEDULE)
    def train():
        for step in range(8):
            train_step()
            if step in (1, 4):
                evaluate()
            step_profiler()

    train()
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [3, 4, 5]
    assert not inner_dir.exists()
    assert ds_caplog.text.count("runs unprofiled") == 1
    assert len(runs_made) == 1  # the nested calls made no run of their own
    _assert_idle()


def test_concurrent_call_in_another_thread_runs_unprofiled(tmp_path, ds_caplog):
    other_dir = tmp_path / "other"
    other_steps = []

    @profiler(output_dir=str(other_dir), skip_first=0, wait=0, warmup=0, active=1)
    def other_job():
        for _ in range(9):
            step_profiler()
            other_steps.append(1)

    @profiler(output_dir=str(tmp_path), **SCHEDULE)
    def train():
        for step in range(8):
            train_step()
            if step == 4:
                thread = threading.Thread(target=other_job)
                thread.start()
                thread.join()
            step_profiler()

    train()
    assert len(other_steps) == 9 and not other_dir.exists()
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [3, 4, 5]
    assert "runs unprofiled" in ds_caplog.text


def test_unwritable_output_dir_fails_before_the_function_runs(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    ran = []
    decorated = profiler(output_dir=str(blocker / "logs"))(lambda: ran.append(1))
    with pytest.raises(ConfigError, match=r"profiler\.output_dir: .*a_file/logs.* cannot be written"):
        decorated()
    assert ran == []
    _assert_idle()


def test_export_errors_are_logged_not_raised(tmp_path, monkeypatch, ds_caplog):

    def disk_full(self, path, use_python_export=False):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", disk_full)
    result = profiler(output_dir=str(tmp_path), **SCHEDULE)(lambda: [step_profiler() for _ in range(8)] and "done")()
    assert result == "done"
    assert "was not written (OSError: [Errno 28] No space left on device); training goes on" in ds_caplog.text
    assert not list((tmp_path / "rank_0").iterdir())
    _assert_idle()


def test_a_trace_the_exporter_could_not_write_is_named_and_leaves_no_file(tmp_path, monkeypatch, ds_caplog):
    """Kineto on a full disk: "Failed to write to log file!" on stderr, no exception, no trace, its own temporary
    file left empty."""

    def full_disk(self, path, use_python_export=False):
        open(f"{path}.tmp", "wb").close()

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", full_disk)
    monkeypatch.setattr(writer.shutil, "disk_usage", lambda path: SimpleNamespace(total=10, used=10, free=0))
    result = profiler(output_dir=str(tmp_path), **SCHEDULE)(lambda: [step_profiler() for _ in range(8)] and "done")()
    assert result == "done"
    assert "was not written (OSError: [Errno 28] the trace exporter wrote no file (No space left on device)); " \
           "training goes on" in ds_caplog.text
    assert not list((tmp_path / "rank_0").iterdir())
    _assert_idle()


@pytest.mark.parametrize("steps", [8, 2])  # the window's end; the run's end in its warmup (torch started, stopped)
def test_a_stop_that_fails_before_switching_recording_off_still_leaves_no_recording_behind(tmp_path, monkeypatch,
                                                                                           ds_caplog, steps):
    """torch's ``stop_trace`` raising before its profiler stops: the error is logged, and recording is off all the same
    (else every operator of the rest of the job is recorded), so a profiler starts again afterwards."""

    def fails_before_stopping(self):
        raise RuntimeError("the execution trace observer failed")

    monkeypatch.setattr(torch.profiler.profile, "stop_trace", fails_before_stopping)
    result = profiler(output_dir=str(tmp_path), **SCHEDULE)(lambda: [step_profiler() for _ in range(steps)] and "done")()
    assert result == "done"
    assert "the execution trace observer failed" in ds_caplog.text
    assert not torch.autograd._profiler_enabled() and not torch.autograd.profiler._is_profiler_enabled
    monkeypatch.undo()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as again:
        train_step()
    assert again.events()
    _assert_idle()


def test_profiler_that_cannot_start_stops_profiling_not_training(tmp_path, monkeypatch, ds_caplog):

    def broken(self):
        raise RuntimeError("profiler already running")

    monkeypatch.setattr(torch.profiler.profile, "start_trace", broken)
    steps = []

    @profiler(output_dir=str(tmp_path), **SCHEDULE)
    def train():
        for step in range(8):
            steps.append(step)
            step_profiler()

    train()
    assert steps == list(range(8))
    assert "profiling stops for this run" in ds_caplog.text
    _assert_idle()


def test_a_failed_rename_keeps_the_exported_trace(tmp_path, monkeypatch, ds_caplog):

    def broken(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(writer, "rename_trace_events", broken)
    profiler(output_dir=str(tmp_path), skip_first=0, wait=0, warmup=1, active=10)(
        lambda: [step_profiler() for _ in range(3)])()
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [1, 2, 3]  # the tail keeps its name
    assert "keeps its step names as recorded (OSError: [Errno 5] Input/output error)" in ds_caplog.text
