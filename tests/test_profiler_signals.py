"""The profiler under SIGTERM and SIGINT: handlers only while a window holds unsaved steps, signals held
while the files are written, the signal's meaning kept afterwards, and a write that gives up in time."""
import os
import signal
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest
import torch

from ds_profutils import profiler, step_profiler
from ds_profutils import outputs
from ds_profutils.torch_profiler import calls as profiler_calls
from ds_profutils.torch_profiler import run as profiler_run
from ds_profutils.torch_profiler import signals as profiler_signals
from profiler_testing import profiler_steps, read_trace, train_step

SCHEDULE = dict(skip_first=0, wait=2, warmup=1, active=3)  # active steps 3, 4, 5
_original_export = torch.profiler.profile.export_chrome_trace


@pytest.fixture
def handlers():
    """SIGTERM and SIGINT as a program run from a terminal has them, whatever the suite started with
    (``nohup ... &`` starts Python with SIGINT ignored)."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL), signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGTERM, previous[0])
    signal.signal(signal.SIGINT, previous[1])


def _export_sending(monkeypatch, *signums):
    """Make every trace export send ``signums`` to this process first, as a launcher or a user would
    while the profiler writes."""

    def export(self, path, use_python_export=False):
        for signum in signums:
            os.kill(os.getpid(), signum)
        return _original_export(self, path, use_python_export)

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", export)


def test_handlers_are_installed_only_while_a_window_holds_unsaved_steps(tmp_path, handlers):
    seen = []

    def train():
        for _ in range(8):
            seen.append(signal.getsignal(signal.SIGTERM))
            step_profiler()

    profiler(output_dir=str(tmp_path), **SCHEDULE)(train)()
    assert seen[:3] == [signal.SIG_DFL] * 3  # wait, wait, warmup: nothing unsaved
    assert all(callable(handler) for handler in seen[3:6])  # active steps
    assert seen[6:] == [signal.SIG_DFL] * 2  # the window is on disk
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_programs_own_handler_is_called_instead_and_kept(tmp_path, handlers):
    received = []

    def own(signum, frame):
        received.append(signum)

    def train():
        for step in range(8):
            if step == 4:
                os.kill(os.getpid(), signal.SIGTERM)
            if step == 5:
                signal.signal(signal.SIGINT, own)  # replaced while the window runs: kept afterwards
            step_profiler()

    signal.signal(signal.SIGTERM, own)
    profiler(output_dir=str(tmp_path), **SCHEDULE)(train)()
    assert received == [signal.SIGTERM]
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [3, 4, 5]
    assert signal.getsignal(signal.SIGTERM) is own and signal.getsignal(signal.SIGINT) is own


@pytest.mark.parametrize("while_torch", ["stops", "exports"])
def test_a_sigterm_the_program_handles_while_writing_stops_nothing(tmp_path, handlers, monkeypatch, ds_caplog,
                                                                    while_torch):
    """Graceful preemption (SLURM's --signal, a handler that sets a flag and checkpoints): a SIGTERM that
    arrives while a cycle is written reaches the program's handler once the files are on disk; the run,
    its later cycles, their operator summary and the other writers (the ZeRO-3 recorders) go on."""
    if while_torch == "exports":
        _export_sending(monkeypatch, signal.SIGTERM)
    else:
        stop = torch.profiler.profile.stop_trace

        def stop_sending(self):
            os.kill(os.getpid(), signal.SIGTERM)
            return stop(self)

        monkeypatch.setattr(torch.profiler.profile, "stop_trace", stop_sending)
    received, other_writer_closed, summaries = [], [], []
    outputs.call_before_signal_exit(lambda: other_writer_closed.append(True))
    monkeypatch.setattr(profiler_run, "show_comms_summary", lambda *args: summaries.append(args))
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))

    def train():
        for _ in range(6):
            step_profiler()

    try:
        profiler(output_dir=str(tmp_path), skip_first=0, wait=0, warmup=1, active=2, repeat=2)(train)()
        assert received == [signal.SIGTERM, signal.SIGTERM]  # one per cycle written
        assert other_writer_closed == [] and len(summaries) == 1  # a normal end: the comms summary is shown
        assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [1, 2, 4, 5]
        assert "interrupted" not in ds_caplog.text and "leaves out" not in ds_caplog.text
    finally:
        outputs._signal_exit_callbacks.clear()


def test_a_run_that_returns_after_a_users_except_keyboardinterrupt_shows_no_comms_summary(tmp_path, handlers,
                                                                                      monkeypatch):
    """The comms logger's summary has barriers: never after Ctrl-C, even when the function catches it."""
    summaries = []
    monkeypatch.setattr(profiler_run, "show_comms_summary", lambda *args: summaries.append(args))

    def train():
        try:
            for step in range(8):
                if step == 4:
                    os.kill(os.getpid(), signal.SIGINT)
                step_profiler()
        except KeyboardInterrupt:
            return "saved"

    assert profiler(output_dir=str(tmp_path), **SCHEDULE)(train)() == "saved"
    assert summaries == []
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [3]  # step 4 never finished


def test_torchs_sigchld_handler_installed_after_the_window_opened_is_held_while_writing(tmp_path, handlers,
                                                                                        monkeypatch):
    """A DataLoader iterator made once the window is open installs torch's SIGCHLD handler over ours;
    a worker dying while the profiler writes must still not raise into the write."""
    calls = []

    def torch_like_handler(signum, frame):  # torch's raises "DataLoader worker (pid N) is killed by signal"
        calls.append(signum)
        raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Terminated.")

    _export_sending(monkeypatch, signal.SIGCHLD)
    previous_sigchld = signal.getsignal(signal.SIGCHLD)

    def train():
        for step in range(6):
            if step == 3:  # the first active step: the window's handlers are in place
                signal.signal(signal.SIGCHLD, torch_like_handler)
            step_profiler()

    try:
        profiler(output_dir=str(tmp_path), **SCHEDULE)(train)()
        assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [3, 4, 5]
        assert calls == []  # held while writing, then not delivered: the write is done
        assert signal.getsignal(signal.SIGCHLD) is torch_like_handler  # given back
    finally:
        signal.signal(signal.SIGCHLD, previous_sigchld)


def test_sigchld_handlers_that_call_the_one_they_found_never_loop(tmp_path, handlers, monkeypatch):
    """torch's SIGCHLD handler calls the handler it found, which may be this guard's: one DataLoader before
    the window (set aside as it opens), another made inside it (set aside while writing), two windows."""
    calls = []
    previous_sigchld = signal.getsignal(signal.SIGCHLD)

    def torch_like(name):
        found = signal.getsignal(signal.SIGCHLD)

        def handler(signum, frame):
            calls.append(name)
            if callable(found):
                found(signum, frame)

        signal.signal(signal.SIGCHLD, handler)

    def train():
        for step in range(10):
            if step == 3:
                torch_like("later loader")
            if step in (4, 8):
                calls.clear()
                signal.raise_signal(signal.SIGCHLD)
                # Never a loop, torch's newest handler once (torch's handler checks every loader's workers).
                # In the second window the guard sets aside the newest handler, which leads back to it:
                # the call ends there, so the oldest is not reached again.
                expected = ["first loader", "later loader"] if step == 4 else ["later loader"]
                assert sorted(calls) == expected, (step, calls)
            step_profiler()

    try:
        torch_like("first loader")
        profiler(output_dir=str(tmp_path), skip_first=0, wait=2, warmup=1, active=2, repeat=2)(train)()
        assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [3, 4, 8, 9]
    finally:
        signal.signal(signal.SIGCHLD, previous_sigchld)


def test_sigint_while_writing_is_held_until_the_window_is_on_disk(tmp_path, handlers, monkeypatch):
    _export_sending(monkeypatch, signal.SIGINT)
    steps_run = []

    def train():
        for step in range(20):
            steps_run.append(step)
            step_profiler()

    with pytest.raises(KeyboardInterrupt):
        profiler(output_dir=str(tmp_path), **SCHEDULE)(train)()
    assert steps_run[-1] == 5  # raised in the step_profiler() that ended the window, once it was written
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [3, 4, 5]
    assert profiler_calls._current is None and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_signal_while_the_first_window_starts_still_ends_the_run_cleanly(tmp_path, handlers, monkeypatch):
    enter = torch.autograd.profiler.record_function.__enter__

    def ctrl_c_then_enter(self):  # the step range opens with the handlers in place
        if self.name == "ProfilerStep#0":
            os.kill(os.getpid(), signal.SIGINT)  # held until the transition is done, then delivered
        return enter(self)

    monkeypatch.setattr(torch.autograd.profiler.record_function, "__enter__", ctrl_c_then_enter)
    ran = []
    with pytest.raises(KeyboardInterrupt):
        profiler(output_dir=str(tmp_path), skip_first=0, wait=0, warmup=0, active=2)(lambda: ran.append(1))()
    assert ran == []  # raised as the call began, before the function ran
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [0]
    assert profiler_calls._current is None and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert not torch.autograd.profiler._is_profiler_enabled


@pytest.mark.parametrize("signums, deadline, cause", [
    ((signal.SIGINT, ) * 3, 25.0, "SIGINT received 3 times"),
    ((signal.SIGINT, ), 0.0, "0 s passed since the first SIGTERM/SIGINT"),
])
def test_the_write_gives_up_at_a_third_sigint_or_the_deadline_and_says_so(tmp_path, handlers, monkeypatch, ds_caplog,
                                                                        signums, deadline, cause):
    _export_sending(monkeypatch, *signums)
    monkeypatch.setattr(profiler_signals, "DEADLINE_S", deadline)

    def train():
        for step in range(10):
            if step == 4:
                raise ValueError("boom")
            step_profiler()

    with pytest.raises(KeyboardInterrupt):  # the held SIGINT, delivered once the profiler is done
        profiler(output_dir=str(tmp_path), **SCHEDULE)(train)()
    errors = [r.getMessage() for r in ds_caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1
    assert errors[0].startswith(f"profiler: {tmp_path / 'trace_rank_0.json'} was not written (gave up writing: {cause}")
    cycle_file, = (tmp_path / "rank_0").iterdir()  # exported before the signals were seen
    assert profiler_steps(read_trace(cycle_file)) == [3, 4]


@pytest.mark.parametrize("failure", [KeyboardInterrupt, SystemExit, OSError])
def test_a_failed_write_is_one_error_line_naming_the_file_whatever_the_exception(tmp_path, handlers, monkeypatch,
                                                                                 ds_caplog, failure):

    def export(self, path, use_python_export=False):
        raise failure("disk says no")

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", export)
    decorated = profiler(output_dir=str(tmp_path), **SCHEDULE)(lambda: [step_profiler() for _ in range(8)] and "done")
    if issubclass(failure, Exception):
        assert decorated() == "done"  # training goes on
    else:
        with pytest.raises(failure):  # an interruption from elsewhere is not swallowed
            decorated()
    errors = [r.getMessage() for r in ds_caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and str(tmp_path / "rank_0") in errors[0]
    assert f"({failure.__name__}: disk says no)" in errors[0]
    assert profiler_calls._current is None


def test_outside_the_main_thread_no_handlers_and_one_line_says_so(tmp_path, handlers, ds_caplog):

    def train():
        for _ in range(12):
            train_step()
            step_profiler()

    thread = threading.Thread(target=profiler(output_dir=str(tmp_path), skip_first=0, wait=0, warmup=1, active=2,
                                              repeat=3)(train))
    thread.start()
    thread.join()
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [1, 2, 4, 5, 7, 8]
    assert ds_caplog.text.count("outside the main thread") == 1
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


_JOB = textwrap.dedent("""
    import signal, sys, time, torch
    from ds_profutils import profiler, step_profiler

    if sys.argv[2] == "slow-export":  # a large window's export, so signals arrive while it runs
        export = torch.profiler.profile.export_chrome_trace
        def slow_export(self, path, use_python_export=False):
            time.sleep(3)
            return export(self, path, use_python_export)
        torch.profiler.profile.export_chrome_trace = slow_export

    @profiler(output_dir=sys.argv[1], skip_first=0, wait=0, warmup=1, active=1000)
    def train():
        model = torch.nn.Linear(8, 8)
        data = torch.utils.data.TensorDataset(torch.randn(100000, 8))
        loader = torch.utils.data.DataLoader(data, batch_size=2, num_workers=1, persistent_workers=True)
        for step, (batch,) in enumerate(loader):
            model(batch).sum().backward()
            if step == 3:
                print("recording", flush=True)
            step_profiler()
            time.sleep(0.001)

    train()
""")


def _start_job(tmp_path, mode):
    job = subprocess.Popen([sys.executable, "-c", _JOB, str(tmp_path), mode],
                           stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT,
                           text=True)
    for line in job.stdout:
        if line.strip() == "recording":
            return job
    raise AssertionError(f"the job ended before recording: {job.wait()}")


def _assert_complete_trace(tmp_path):
    steps = profiler_steps(read_trace(tmp_path / "trace_rank_0.json"))
    assert steps[0] == 1 and steps == list(range(1, steps[-1] + 1)) and len(steps) >= 3
    cycle_file, = (tmp_path / "rank_0").iterdir()
    assert profiler_steps(read_trace(cycle_file)) == steps
    assert not [p for p in tmp_path.rglob(".*")], "temporary files left behind"


def test_sigterm_writes_the_window_then_ends_the_process_as_sigterm_would(tmp_path):
    job = _start_job(tmp_path, "plain")
    try:
        job.send_signal(signal.SIGTERM)  # what the launcher sends, 30 s before SIGKILL
        output, _ = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == -signal.SIGTERM, output  # "killed by SIGTERM", as without the profiler
    assert "rank 0 interrupted at step" in output and "was not written" not in output
    _assert_complete_trace(tmp_path)


def test_a_second_sigterm_and_a_dying_dataloader_worker_do_not_cut_the_write(tmp_path):
    """The launcher's order: SIGTERM reaches the rank, its DataLoader workers die (torch's SIGCHLD handler
    would raise into the write), and a second SIGTERM comes while the rank writes."""
    job = _start_job(tmp_path, "slow-export")
    try:
        worker, = psutil.Process(job.pid).children()
        job.send_signal(signal.SIGTERM)
        for line in job.stdout:
            if "rank 0 interrupted at step" in line:
                break
        worker.terminate()
        worker.wait(timeout=30)
        job.send_signal(signal.SIGTERM)
        output, _ = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == -signal.SIGTERM, output
    assert "was not written" not in output and "DataLoader worker" not in output, output
    _assert_complete_trace(tmp_path)
